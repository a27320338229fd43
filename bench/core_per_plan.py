"""CPU per no-op plan in each process: the coordinator core, the client SDK, the worker agent.

``--side core`` (the default): the coordinator core alone: no sockets, no store, no event loop, a fake clock.

Drives ``coordinator.Coordinator`` directly the way the driver does: one client submits N
``echo`` plans in batches (each subscribed, as ``Client.submit_many`` does), two workers with
room for 1000 plans each accept, emit one event and finish every plan assigned to them, and
the effects are taken after each batch, with the collector tuned as the daemon tunes it
(``fleetwire/cli/serve.py``). The figure is CPU microseconds per plan (best of
``--repeat`` runs) and, when valgrind is installed, callgrind instructions per plan: the
difference between two runs of different sizes, so start-up and imports cancel out. The
instruction count hardly moves with machine load, so it is the signal to compare trees by.

    python bench/core_per_plan.py                          # this tree
    python bench/core_per_plan.py --compare /tmp/wt_old    # and another tree, same sitting
    python bench/core_per_plan.py --no-callgrind --plans 50000
    python bench/core_per_plan.py --profile [--compare PATH]  # cProfile calls and time per plan
    python bench/core_per_plan.py --side client [--compare PATH]  # the client SDK's per-plan path
    python bench/core_per_plan.py --side worker [--compare PATH]  # the worker agent's per-plan path

``--side client``: a real ``fleetwire.Client`` without a socket (the collector as a user's process has
it): ``submit_many`` of N echo plans in batches (the caller's ids), the session's writer encoding its frames,
then the coordinator's frames fed to the session as its reader would (per plan: ``accepted``, ``queued``,
``leased``; then ``running``, ``echo``, ``succeeded``, encoded beforehand) and every plan's ``result()``
awaited. ``--side submits``: the client's submit path alone (``run_submits``: ``submits.batch`` and
``end_submit_spans``), the collector off (set ``OTEL_BSP_SCHEDULE_DELAY`` long so its exporter posts only at the
end, counted). ``--side worker``: a real ``worker_agent.Agent`` without a socket (the collector tuned as the
worker daemon tunes it): frames of ``assign`` decoded and dispatched as its reader does, the plans run by
the built-in ``echo`` on its loop, the outbox encoded into frames and acked as its writer and the
coordinator do; with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, the daemon's tracer and the assigns' ``traceparent``
as the coordinator forwards them at ``OTEL_TRACES_SAMPLER_ARG`` (``_worker_tracing``). For these two the frames
made beforehand (and the client or agent built) are measured apart (``--setup-only``) and taken off, so the figure
is the SDK's or the agent's own instructions per plan.

One client holds every plan of a run unfinished at once, so the core's per-client limits
(``max_plans_per_client``, 10,000 by default; ``max_bytes_per_client``) are lifted where the tree
has them; a submit the core still refuses stops the run with the core's ``error`` (code and message).

``--compare PATH`` runs the same measurement against the tree at PATH (a checkout of this
repository, through PYTHONPATH) and prints both and their ratio. Only the core's public
surface is used (``open_session``, ``receive``, ``take_effects``), so older trees work too.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from _echo_core import CLIENT, WORKERS, echo_core

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_plans(plans: int, batch: int) -> float:
    """Run ``plans`` echo plans through a fresh core; CPU seconds spent (setup excluded)."""
    import itertools

    from protocol.messages import Accept, Assign, Done, Error, Event, Submit

    ids = (f"p{i}" for i in itertools.count(1))
    core = echo_core(lambda: next(ids))
    workers, client = WORKERS, CLIENT
    gc.collect()
    gc.freeze()  # as the daemon does after start-up (fleetwire/cli/serve.py tune_gc_for_daemon)
    gc.set_threshold(50_000, 20, 100)  # DAEMON_GC_THRESHOLDS, spelled out so older trees measure alike
    pending: dict[int, list[Any]] = {conn: [] for conn in workers}
    seqs = dict.fromkeys(workers, 0)

    def pump() -> None:
        for conn, msgs in core.take_effects().sends.items():
            if conn in pending:
                pending[conn].extend(m for m in msgs if isinstance(m, Assign))
            elif conn == client:  # a refused submit would leave the run waiting for plans that never come
                refused = next((m for m in msgs if isinstance(m, Error)), None)
                if refused is not None:
                    raise RuntimeError(f"the core refused a submit: {refused.code}: {refused.message}")

    now = 1.0
    done = 0
    t0 = time.process_time()
    for start in range(0, plans, batch):
        for i in range(start, min(plans, start + batch)):
            core.receive(client, Submit(req_id=i + 1, op="echo", args=i, subscribe=True), now)
        pump()
        now += 0.001
    while done < plans:
        progressed = False
        for conn in workers:
            assigned, pending[conn] = pending[conn][:batch], pending[conn][batch:]
            seq = seqs[conn]  # numbered as an agent numbers them (acked, re-sends dropped)
            for a in assigned:
                pid, attempt = a.plan_id, a.attempt
                core.receive(conn, Accept(plan_id=pid, attempt=attempt, seq=seq + 1), now)
                core.receive(conn, Event(plan_id=pid, attempt=attempt, kind="echo", data=a.args, seq=seq + 2), now)
                finished = Done(plan_id=pid, attempt=attempt, outcome="succeeded", result=a.args, seq=seq + 3)
                core.receive(conn, finished, now)
                seq += 3
                done += 1
                progressed = True
            seqs[conn] = seq
            pump()
            now += 0.001
        if not progressed:
            raise RuntimeError(f"stuck after {done} of {plans} plans")
    spent = time.process_time() - t0
    gc.unfreeze()
    return spent


def _client_frames(plans: int, batch: int) -> list[tuple[int, int, bytes, bytes]]:
    """The coordinator's frames to the client, per batch: (first, count, accepted + queued + leased, the rest)."""
    import msgspec

    from protocol.messages import Accepted, Event

    frames = []
    for start in range(0, plans, batch):
        count = min(plans, start + batch) - start
        first, rest = [], []
        for i in range(start + 1, start + count + 1):
            pid, placed = f"p{i}", {"worker_id": "bench-1", "attempt": 1}
            first += [Accepted(req_id=i, plan_id=pid, state="queued"),
                      Event(plan_id=pid, kind="queued", data={}, seq=1),
                      Event(plan_id=pid, kind="leased", data=placed, seq=2, attempt=1)]
            rest += [Event(plan_id=pid, kind="running", data=placed, seq=3, attempt=1),
                     Event(plan_id=pid, kind="echo", data=i, seq=4, attempt=1),
                     Event(plan_id=pid, kind="succeeded", data={"result": i, **placed}, seq=5, attempt=1)]
        frames.append((start, count, msgspec.msgpack.encode(first), msgspec.msgpack.encode(rest)))
    return frames


def run_client(plans: int, batch: int, setup_only: bool = False) -> float:
    """``plans`` echo plans through a socketless ``Client`` (see the module docstring); CPU seconds spent."""
    import asyncio

    from fleetwire import Client

    frames = _client_frames(plans, batch)
    ids = [f"p{i}" for i in range(1, plans + 1)]

    async def main() -> float:
        client = Client("ws://127.0.0.1:9", reconnect=False)
        client._ws = object()  # type: ignore[assignment]  # connected, as far as submits go: the bench is the socket
        session = client._session
        if setup_only:
            return 0.0
        gc.collect()
        t0 = time.process_time()
        for start, count, first, rest in frames:
            task = asyncio.ensure_future(client.submit_many("echo", range(start, start + count),
                                                            plan_ids=ids[start:start + count]))
            while session.pending_requests < count:  # noqa: ASYNC110  (loop turns: the submits' task queues them)
                await asyncio.sleep(0)
            while session.next_frame() is not None:  # the writer's encoding
                pass
            session.receive_frame(first)  # the reader's
            submitted = await task
            session.receive_frame(rest)
            for plan in submitted:
                await plan.result()
        return time.process_time() - t0

    return asyncio.run(main())


def run_submits(plans: int, batch: int, setup_only: bool = False) -> float:
    """The client's submit path alone: ``submits.batch`` (each batch's submits made, their spans started when
    tracing, encoded) and ``end_submit_spans``, ``plans`` echo plans in batches, on a socketless session; the
    collector off and ``random`` seeded, so two trees draw the same sampled plans. CPU seconds spent."""
    import random

    from fleetwire import Client, submits
    from fleetwire.tracing import client_tracing, end_submit_spans
    from protocol.messages import Requirements

    client = Client("ws://127.0.0.1:9", reconnect=False)
    session = client._session
    tracing = client_tracing()  # built before the count, as a client's first submit builds it
    ids = [f"p{i}" for i in range(1, plans + 1)]
    requirements = Requirements()
    random.seed(1)
    if setup_only:
        return 0.0
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    for start in range(0, plans, batch):
        spans: list[Any] = []
        submits.batch(session, "echo", range(start, min(plans, start + batch)), ids[start : start + batch],
                      requirements=requirements, priority=0, timeout_s=None, max_attempts=3,
                      max_inline_bytes=1 << 20, spans=spans)  # fmt: skip
        end_submit_spans(spans)
    spent = time.process_time() - t0
    gc.enable()
    if tracing is not None:
        tracing.shutdown()  # the sampled spans' export, counted (no post while the run goes on: a long delay)
    return spent


def run_worker(plans: int, batch: int, setup_only: bool = False) -> float:
    """``plans`` echo plans through a socketless worker ``Agent`` (see the module docstring); CPU seconds spent."""
    import asyncio

    import msgspec

    from protocol.messages import Ack, Assign

    tracing, parents = _worker_tracing(plans)
    frames = [msgspec.msgpack.encode([Assign(plan_id=f"p{i}", attempt=1, op="echo", args=i, traceparent=parents[i - 1])
                                      for i in range(start + 1, min(plans, start + batch) + 1)])
              for start in range(0, plans, batch)]

    async def main() -> float:
        from worker_agent import agent as agent_module
        from worker_agent.outbox import encode_frames

        agent = agent_module.Agent("ws://127.0.0.1:9", worker_id="bench-1", max_concurrency=batch, tracing=tracing)
        codec = agent._codec("fleetwire.v1.msgpack")
        outbox, send_queue, runner = agent._outbox, agent._send_queue, agent.runner
        max_frame_bytes = agent.settings.max_frame_bytes
        if setup_only:
            return 0.0
        gc.collect()
        gc.freeze()  # the worker daemon's collector settings, as for the core (fleetwire/cli/serve.py)
        gc.set_threshold(50_000, 20, 100)
        t0 = time.process_time()
        for frame in frames:
            for msg in codec.decode(frame):  # the reader
                agent._dispatch(msg)
            while runner.running_count:  # noqa: ASYNC110  (loop turns: the plans' tasks run to their end)
                await asyncio.sleep(0)
            while outbox:  # the writer
                for _frame, msgs in encode_frames(codec, outbox.take(agent_module.MAX_BATCH), max_frame_bytes):
                    outbox.sent(msgs)
            agent._dispatch(Ack(seq=send_queue._seq))  # the coordinator's ack
        spent = time.process_time() - t0
        gc.unfreeze()
        if outbox.unacked:
            raise RuntimeError(f"{outbox.unacked} messages left unacked")
        return spent

    return asyncio.run(main())


def _worker_tracing(plans: int) -> tuple[Any, list[str]]:
    """With ``OTEL_EXPORTER_OTLP_ENDPOINT`` set: the worker daemon's tracer (its exporter child, as ``fleetwire
    worker`` starts it) and each assign's ``traceparent`` as the coordinator forwards the SDK's at
    ``OTEL_TRACES_SAMPLER_ARG``: one plan in 1/ratio a sampled context, the others ``"00"`` (the caller's "no"), or
    ``"0"`` to a worker that says it reads it (``capabilities.short_unsampled``). Off: no tracer, no ``traceparent``."""
    import random

    from protocol.messages import Capabilities
    from wireio.tracing import SERVICE_WORKER, Sampler, Tracing

    tracing = Tracing.from_env(SERVICE_WORKER, export_process=True)
    if tracing is None:
        return None, [""] * plans
    ratio = Sampler.from_env(os.environ).ratio
    every = round(1 / ratio) if ratio > 0 else 0
    rnd = random.Random(1)
    contexts = [f"00-{rnd.getrandbits(128):032x}-{rnd.getrandbits(64):016x}-01" for _ in range(100)]
    unsampled = "0" if "short_unsampled" in Capabilities.__struct_fields__ else "00"  # as the coordinator forwards it
    return tracing, [contexts[i % 100] if every and i % every == 0 else unsampled for i in range(plans)]


RUNS = {"core": run_plans, "client": run_client, "submits": run_submits, "worker": run_worker}


def _run(ns: argparse.Namespace, setup_only: bool = False) -> float:
    if ns.side == "core":
        return run_plans(ns.plans, ns.batch)
    return RUNS[ns.side](ns.plans, ns.batch, setup_only)  # type: ignore[operator]


def _child(ns: argparse.Namespace) -> int:
    """Inside the measured tree: print one JSON line."""
    if ns.profile:
        import cProfile
        import pstats

        _run(argparse.Namespace(**{**vars(ns), "plans": min(ns.plans, ns.batch)}))  # imports, compiling: unprofiled
        prof = cProfile.Profile()
        prof.enable()
        _run(ns)
        prof.disable()
        stats = pstats.Stats(prof)
        table = stats.stats  # type: ignore[attr-defined]
        rows = sorted(table.items(), key=lambda kv: -kv[1][2])
        calls = sum(v[1] for v in table.values())
        print(f"{calls / ns.plans:.1f} calls per plan; by own time (own us, cumulative us, calls per plan):")
        for (path, line, name), (_cc, nc, tt, ct, _callers) in rows[: ns.top]:
            where = "/".join(path.split("/")[-2:])
            per = 1e6 / ns.plans
            print(f"{tt * per:7.2f} {ct * per:7.2f} {nc / ns.plans:6.2f}  {name} ({where}:{line})")
        return 0
    if ns.once:
        _run(ns, ns.setup_only)
        return 0
    best = min(_run(ns) for _ in range(ns.repeat))
    print(json.dumps({"us_per_plan": round(best / ns.plans * 1e6, 2)}))
    return 0


def _python(tree: str, args: list[str], valgrind_out: str | None = None) -> str:
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}
    cmd = [sys.executable, os.path.join(HERE, "core_per_plan.py"), "--child", *args]
    if valgrind_out is not None:
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={valgrind_out}", *cmd]
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _callgrind_total(tree: str, args: list[str], out: str) -> tuple[int, int]:
    """A run's instructions, and those of them in the garbage collector (``gc_collect_main``, inclusive)."""
    _python(tree, args, valgrind_out=out)
    with open(out) as fh:
        total = next(int(line.split()[1]) for line in fh if line.startswith("summary:"))
    if shutil.which("callgrind_annotate") is None:
        return total, 0
    listing = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out], capture_output=True,
                             text=True, check=False).stdout  # fmt: skip
    collector = (line.split()[0] for line in listing.splitlines() if ":gc_collect_main " in line)
    return total, int(next(collector, "0").replace(",", ""))


def _instructions(tree: str, small: int, large: int, ns: argparse.Namespace) -> tuple[float, float]:
    """Callgrind instructions per plan: (Ir(large) - Ir(small)) / (large - small), less the same difference of
    a ``--setup-only`` run (the client's and the worker's frames made beforehand) for those sides; and the same
    less the collector's share. Which runs a collection falls in moves the first by up to ~1.5k a plan between
    runs of one tree (a young generation of 50,000 objects is scanned at once), so the second is the steadier."""
    side = ["--side", ns.side, "--batch", str(ns.batch)]
    _python(tree, ["--once", "--plans", "1", *side])  # byte-compiles what changed, so no counted run pays for it
    per_plan = less_gc = 0.0
    with tempfile.TemporaryDirectory() as scratch:
        tmp = scratch
        if ns.cg_dir:  # kept: one folder a tree, for callgrind_annotate (or --diff) of two trees or levels
            tmp = os.path.join(ns.cg_dir, tree.strip("/").replace("/", "_") or "root")
            os.makedirs(tmp, exist_ok=True)
        for extra, sign in [([], 1)] + ([(["--setup-only"], -1)] if ns.side != "core" else []):
            tail = ".setup" if extra else ""
            (small_ir, small_gc), (large_ir, large_gc) = (
                _callgrind_total(tree, ["--once", "--plans", str(n), *side, *extra], os.path.join(tmp, f"cg.{n}{tail}"))
                for n in (small, large))  # fmt: skip
            per_plan += sign * (large_ir - small_ir) / (large - small)
            less_gc += sign * (large_ir - large_gc - small_ir + small_gc) / (large - small)
    return per_plan, less_gc


def measure(tree: str, ns: argparse.Namespace) -> dict[str, Any]:
    args = ["--plans", str(ns.plans), "--batch", str(ns.batch), "--repeat", str(ns.repeat), "--side", ns.side]
    result: dict[str, Any] = {"tree": tree, **json.loads(_python(tree, args).strip().splitlines()[-1])}
    if ns.callgrind:
        per_plan, less_gc = _instructions(tree, ns.cg_plans // 4, ns.cg_plans, ns)
        result["instructions_per_plan"] = round(per_plan)
        result["less_gc"] = round(less_gc)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans per timed run (default 20000)")
    parser.add_argument("--batch", type=int, default=500, help="messages between take_effects (default 500)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best counts (default 5)")
    parser.add_argument("--compare", metavar="PATH", help="also measure the tree at PATH and print the ratio")
    parser.add_argument("--no-callgrind", dest="callgrind", action="store_false", help="skip the instruction count")
    parser.add_argument("--cg-dir", default="", help="keep the callgrind outputs here (a folder a tree: cg.N, and "
                        "cg.N.setup, --setup-only's, for the client and worker; callgrind_annotate them)")
    parser.add_argument("--cg-plans", type=int, default=2_000, help="plans in the larger callgrind run (default 2000)")
    parser.add_argument("--profile", action="store_true", help="cProfile (each tree): calls and time per plan")
    parser.add_argument("--top", type=int, default=30, help="rows of --profile (default 30)")
    parser.add_argument("--json", action="store_true", help="one JSON line instead of text")
    parser.add_argument("--side", choices=sorted(RUNS), default="core",
                        help="whose per-plan path: the coordinator core (default), the client SDK, the worker")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setup-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        return _child(ns)
    trees = [ROOT] + ([os.path.abspath(ns.compare)] if ns.compare else [])
    if ns.profile:
        for tree in trees:
            print(f"== {tree}")
            args = ["--profile", "--plans", str(ns.plans), "--batch", str(ns.batch), "--top", str(ns.top),
                    "--side", ns.side]
            print(_python(tree, args))
        return 0
    if ns.callgrind and shutil.which("valgrind") is None:
        print("valgrind not found: timing only", file=sys.stderr)
        ns.callgrind = False
    results = [measure(tree, ns) for tree in trees]
    if len(results) == 2:
        this, other = results
        ratios = {f"ratio_{k}": round(this[k] / other[k], 3) for k in this if k != "tree" and k in other}
        results.append(ratios)
    if ns.json:
        print(json.dumps({"bench": "core_per_plan", "side": ns.side, "plans": ns.plans, "trees": results[:len(trees)],
                          **(results[-1] if len(results) > len(trees) else {})}))
        return 0
    for r in results:
        print("  ".join(f"{k}={v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
