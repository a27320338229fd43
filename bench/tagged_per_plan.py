"""Callgrind instructions per echo plan through the pure core, plans and workers tagged or not (issue #29).

Cluster mode routes a plan by its pool's tag, so a cluster coordinator's plans carry one tag and its workers
carry it too (``pool:NAME``): the tagged placement path (``submit_problem``'s name caps, ``Signature.of``,
``Signature.meets``, ``PlanQueue._tagged_pairs``). This runs ``bench/core_per_plan.py``'s echo loop (two
workers, one client, batches of 500) with and without one such tag, and prints the instructions a plan of each:
the difference of two runs (500 and 2,000 plans) under callgrind, so start-up and imports cancel out.

    python bench/tagged_per_plan.py                       # this tree
    python bench/tagged_per_plan.py --compare /tmp/wt_old # and another checkout, same sitting
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TAG = "pool:bench"


def run(plans: int, tagged: bool, batch: int = 500) -> None:
    """``plans`` echo plans through a fresh core (imports here: the tree is PYTHONPATH's)."""
    import dataclasses

    from coordinator import Coordinator, CoreConfig
    from protocol.messages import Accept, Assign, Capabilities, Done, Error, Event, Hello, Requirements, Submit

    fields = {f.name for f in dataclasses.fields(CoreConfig)}
    ids = (f"p{i}" for i in itertools.count(1))
    lifted = {k: 0 for k in ("max_plans_per_client", "max_bytes_per_client") if k in fields}
    core = Coordinator(CoreConfig(**lifted), new_id=lambda: next(ids))
    workers, client = (1, 2), 3
    for conn in workers:
        core.open_session(conn, "worker", 0.0, address=f"127.0.0.1:{4000 + conn}")
        caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=1000,
                            tags=[TAG] if tagged else [])  # fmt: skip
        core.receive(conn, Hello(worker_id=f"bench-{conn}", capabilities=caps), 0.0)
    core.open_session(client, "client", 0.0, principal="bench")
    core.take_effects()
    requirements = Requirements(tags=[TAG]) if tagged else Requirements()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # the daemon's (fleetwire/cli/serve.py)
    pending: dict[int, list[Any]] = {conn: [] for conn in workers}
    seqs = dict.fromkeys(workers, 0)

    def pump() -> None:
        for conn, msgs in core.take_effects().sends.items():
            if conn in pending:
                pending[conn].extend(m for m in msgs if isinstance(m, Assign))
            elif (refused := next((m for m in msgs if isinstance(m, Error)), None)) is not None:
                raise RuntimeError(f"the core refused a submit: {refused.code}: {refused.message}")

    now, done = 1.0, 0
    for start in range(0, plans, batch):
        for i in range(start, min(plans, start + batch)):
            core.receive(client, Submit(req_id=i + 1, op="echo", args=i, subscribe=True, requirements=requirements),
                         now)  # fmt: skip
        pump()
        now += 0.001
    while done < plans:
        before = done
        for conn in workers:
            assigned, pending[conn] = pending[conn][:batch], pending[conn][batch:]
            seq = seqs[conn]
            for a in assigned:
                core.receive(conn, Accept(plan_id=a.plan_id, attempt=a.attempt, seq=seq + 1), now)
                core.receive(conn, Event(plan_id=a.plan_id, attempt=a.attempt, kind="echo", data=a.args, seq=seq + 2),
                             now)  # fmt: skip
                core.receive(conn, Done(plan_id=a.plan_id, attempt=a.attempt, outcome="succeeded", result=a.args,
                                        seq=seq + 3), now)  # fmt: skip
                seq += 3
                done += 1
            seqs[conn] = seq
            pump()
            now += 0.001
        if done == before:
            raise RuntimeError(f"stuck after {done} of {plans} plans")


def instructions(tree: str, tagged: bool, small: int = 500, large: int = 2000) -> float:
    """Callgrind instructions a plan in ``tree``: (Ir(large) - Ir(small)) / (large - small)."""
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}
    me = [sys.executable, os.path.abspath(__file__), "--child", "--tagged" if tagged else "--untagged"]
    subprocess.run([*me, "1"], env=env, cwd=tree, check=True, capture_output=True)  # byte-compile first
    from _harness import callgrind_total  # the parent's only: a child's count has no more imports than before

    with tempfile.TemporaryDirectory() as tmp:
        totals = [callgrind_total(tree, [*me[1:], str(n)], os.path.join(tmp, f"cg.{n}")) for n in (small, large)]
    return (totals[1] - totals[0]) / (large - small)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="PATH", help="also measure the checkout at PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tagged", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--untagged", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("plans", nargs="?", type=int, default=0, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.child:
        run(ns.plans, ns.tagged)
        return 0
    trees = [ROOT] + ([os.path.abspath(ns.compare)] if ns.compare else [])
    for tree in trees:
        untagged, tagged = instructions(tree, False), instructions(tree, True)
        print(f"{tree}: untagged {untagged:,.0f}, tagged {tagged:,.0f} instructions a plan "
              f"(the tag's cost {tagged - untagged:+,.0f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
