#!/usr/bin/env python3
"""Fair share, preemption and the ledger (issue #27) with real processes: ``python bench/fairness.py --live``.

A coordinator (``fleetwire coordinator --token-file``, memory store) and workers (``fleetwire worker``) run as
processes on 127.0.0.1; each principal is a ``fleetwire.Client`` with its own token. Plans are the built-in
``sleep`` op, so a plan's length is known and the figures measure the scheduling, not the work. Times are taken
where the client sees the plan's events (``running``, its terminal event).

* (a) ``flood``: alice (team a) submits a flood of short plans at once on one worker; bob (team b) submits one
  plan every second. Bob's p99 sojourn (submit to end) against the same plan on the empty fleet: <= 2x.
* (b) ``weights``: three principals in teams of weights 1:2:3, each with a backlog; each team's share of the
  slot-seconds served in the window after a warm-up, against 1/6, 2/6, 3/6 (+-5 %).
* (d) ``preempt``: alice's preemptible plans hold every slot past ``--preemption-min-run``; bob submits one
  plan: it starts within ``--preemption-grace`` + 1 s.
* ``usage``: ``fleetwire usage --json`` (the admin token) after the runs: every principal has a row.

(c), the service gap between two backlogged principals, is the simulator's (bench/fairness.py): a live run
adds only noise to a bound of a few plan lengths. (e), the throughput cost, is bench/throughput.py (plans/s,
and the coordinator's CPU per plan, which bounds it) and bench/core_per_plan.py's callgrind count, run
interleaved in one sitting on this tree and on a copy with fair share unwired (coordinator/core.py sets no
``registry.watcher`` and skips ``sharing.plan_ended``; ``FairQueue`` builds its ``PlanQueue`` with no order):
the same code but for fair share. A tree from before it (``git worktree add /tmp/f27-before aeab040^``) also
lacks what came after (plan graphs, carbon holds, tracing), so it bounds the cost from above. On 2026-12-06
(tree 9ce12c2, one principal as in bench/throughput.py): callgrind 277,049 against 264,102 instructions per plan
with no queueing (+4.9 %), 315,119 against 300,363 with 8,000 of 10,000 plans queued (+4.9 %); coordinator CPU
per plan end to end, 8 interleaved rounds (ABBA) of 20,000 plans at load 3-7 on 2 cores: medians 91.0 against
88.25 us, per-round ratios 0.94-1.04 but for one of 1.53, median 0.98: within this machine's noise.

    python bench/fairness.py --live           # ~2.5 min: a flood of 5,000, a 60 s window for (b)
    python bench/fairness.py --live --quick   # ~70 s
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _harness as h

from fleetwire import Client
from fleetwire.plan import Plan

TERMINAL = ("succeeded", "failed", "cancelled")
WORKER_TOKEN = "bench-worker-token-0123456789"
ADMIN_TOKEN = "bench-admin-token-0123456789a"
PRINCIPALS = {"alice": "a", "bob": "b", "p1": "t1", "p2": "t2", "p3": "t3"}  # principal -> team


def token(name: str) -> str:
    return f"bench-{name}-token-0123456789abcdef"


def token_file(directory: str) -> str:
    """Client tokens of :data:`PRINCIPALS` in their teams, and teams t1:t2:t3 of weights 1:2:3."""
    text = "".join(
        f'[[token]]\nname = "{name}"\nrole = "client"\nteam = "{team}"\n'
        f'hash = "sha256:{hashlib.sha256(token(name).encode()).hexdigest()}"\n\n'
        for name, team in PRINCIPALS.items()
    )
    text += "".join(f'[[team]]\nname = "t{w}"\nweight = {w}\n\n' for w in (1, 2, 3))
    path = Path(directory) / "tokens.toml"
    path.write_text(text)
    return str(path)


class Watched:
    """A plan's times as its client sees them: submitted, running, ended."""

    def __init__(self, plan: Plan, submitted: float) -> None:
        self.plan = plan
        self.submitted = submitted
        self.started: float | None = None
        self.ended: float | None = None
        self.kinds: list[str] = []
        self.running = asyncio.Event()
        self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        async for event in self.plan.events():
            self.kinds.append(event.kind)
            if event.kind == "running":
                self.started = time.monotonic()
                self.running.set()
            elif event.kind in TERMINAL:
                self.ended = time.monotonic()


async def submit(client: Client, seconds: float, count: int = 1, **kw: Any) -> list[Watched]:
    now = time.monotonic()
    if count == 1:
        plans = [await client.submit("sleep", {"seconds": seconds}, **kw)]
    else:
        plans = await client.submit_many("sleep", [{"seconds": seconds}] * count)
    return [Watched(plan, now) for plan in plans]


class LiveFleet:
    """A coordinator with the token file and some workers, as processes."""

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp
        self.procs: list[h.Proc] = []
        self.url = ""

    async def start(self, workers: Sequence[int], *coordinator_flags: str) -> None:
        env = h.bench_env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN, FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN)
        coordinator = await h.spawn("coordinator", sys.executable, "-m", "fleetwire", "coordinator", "--host",
                                    h.HOST, "--port", "0", "--store", "memory", "--token-file", token_file(self.tmp),
                                    "--log-level", "warning", "--max-plans-per-client", "0", *coordinator_flags,
                                    env=env)  # fmt: skip
        self.procs.append(coordinator)
        self.url = (await coordinator.wait_for_line(r"listening on (ws://\S+)")).group(1)
        for i, slots in enumerate(workers):
            worker = await h.spawn(f"w{i}", sys.executable, "-m", "fleetwire", "worker", "--url", self.url, "--id",
                                   f"w{i}", "--max-concurrency", str(slots), "--log-level", "warning",
                                   env=h.bench_env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN))  # fmt: skip
            self.procs.append(worker)
            await worker.wait_for_line("registered", 60)

    async def stop(self) -> None:
        for proc in reversed(self.procs):
            await proc.stop()
        self.procs.clear()

    async def usage(self) -> dict[str, Any]:
        proc = await h.spawn("usage", sys.executable, "-m", "fleetwire", "usage", "--json", "--url", self.url,
                             "--token", ADMIN_TOKEN)  # fmt: skip
        await proc.proc.wait()
        await proc.stop()  # the process has ended: this waits for its reader to take the last line
        return json.loads(next(line for line in reversed(proc.lines) if line.startswith("{")))  # type: ignore[no-any-return]


async def flood(fleet: LiveFleet, *, plans: int, slots: int, run_s: float, trickle: int) -> dict[str, Any]:
    """(a) A flood on one worker; a trickle of one plan a second: its p99 sojourn against the empty fleet."""
    async with Client(fleet.url, token=token("alice")) as alice, Client(fleet.url, token=token("bob")) as bob:
        empty = [await submit(bob, run_s) for _ in range(3)]  # the same plan, alone on the fleet
        for [w] in empty:
            await w.task
        alone = min((w.ended or 0.0) - w.submitted for [w] in empty)
        flood_plans = await submit(alice, run_s, plans)
        bobs: list[Watched] = []
        for _ in range(trickle):
            bobs += await submit(bob, run_s)
            await asyncio.sleep(1.0)
        await asyncio.gather(*(w.task for w in bobs))
        queued_then = sum(w.ended is None for w in flood_plans)
        for w in flood_plans:
            if w.ended is None:
                await w.plan.cancel()
        await asyncio.gather(*(w.task for w in flood_plans), return_exceptions=True)
    sojourn = sorted((w.ended or 0.0) - w.submitted for w in bobs)
    p99 = sojourn[min(len(sojourn) - 1, int(0.99 * len(sojourn)))]
    # Its wait for a slot: at most until the next of alice's plans ends (fair share gives bob that slot). The
    # flood's plans start in waves, so that is up to one plan length, and the sojourn up to 2x its plan's.
    waits = sorted((w.started or 0.0) - w.submitted for w in bobs)
    p99_wait = waits[min(len(waits) - 1, int(0.99 * len(waits)))]
    return {"scenario": "a flood (live)", "flood_plans": plans, "slots": slots, "plan_s": run_s,
            "trickle_plans": len(bobs), "flood_left_queued": queued_then, "empty_fleet_s": round(alone, 3),
            "p99_sojourn_s": round(p99, 3), "ratio": round(p99 / alone, 2), "p99_wait_s": round(p99_wait, 3),
            "met": p99 <= 2 * alone}  # fmt: skip


async def weights(fleet: LiveFleet, *, slots: int, run_s: float, warmup_s: float, window_s: float) -> dict[str, Any]:
    """(b) Teams t1:t2:t3 of weights 1:2:3, backlogged: their shares of one window's slot-seconds."""
    per_team = int((warmup_s + window_s) * slots / run_s) + 50  # each alone could keep every slot busy
    clients = [Client(fleet.url, token=token(f"p{i}")) for i in (1, 2, 3)]
    for client in clients:
        await client.connect()
    try:
        watched = {f"t{i}": await submit(client, run_s, per_team) for i, client in zip((1, 2, 3), clients, strict=True)}
        t0 = time.monotonic()
        await asyncio.sleep(warmup_s + window_s)
        start, end = t0 + warmup_s, t0 + warmup_s + window_s
        served = {team: sum(max(0.0, min(w.ended or end, end) - max(w.started, start))
                            for w in ws if w.started is not None) for team, ws in watched.items()}  # fmt: skip
        for ws in watched.values():
            for w in ws:
                if w.ended is None:
                    await w.plan.cancel()
        await asyncio.gather(*(w.task for ws in watched.values() for w in ws), return_exceptions=True)
    finally:
        for client in clients:
            await client.close()
    total = sum(served.values()) or 1.0
    shares = {team: round(s / total, 3) for team, s in served.items()}
    worst = max(abs(served[f"t{i}"] / total / (i / 6) - 1.0) for i in (1, 2, 3))
    return {"scenario": "b weights 1:2:3 (live)", "slots": slots, "plan_s": run_s, "window_s": window_s,
            "shares": shares, "worst_deviation_pct": round(100 * worst, 2), "met": worst <= 0.05}  # fmt: skip


async def preempt(fleet: LiveFleet, *, slots: int, grace_s: float, min_run_s: float) -> dict[str, Any]:
    """(d) Alice's preemptible plans hold every slot past the minimum run; bob's plan starts within grace + 1 s."""
    async with Client(fleet.url, token=token("alice")) as alice, Client(fleet.url, token=token("bob")) as bob:
        held = [(await submit(alice, 3600.0, preemptible=True))[0] for _ in range(slots)]
        await asyncio.wait_for(asyncio.gather(*(w.running.wait() for w in held)), 60)
        await asyncio.sleep(min_run_s + 0.5)  # every one of them preemptible now
        [waiting] = await submit(bob, 0.5)
        await waiting.task
        delay = (waiting.started or 0.0) - waiting.submitted
        for w in held:
            await w.plan.cancel()
        await asyncio.gather(*(w.task for w in held), return_exceptions=True)
    preempted = sum("preempted" in w.kinds for w in held)
    return {"scenario": "d preemption (live)", "grace_s": grace_s, "start_delay_s": round(delay, 3),
            "preempted": preempted, "met": delay <= grace_s + 1.0}  # fmt: skip


async def run(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fleetwire-fairness-") as tmp:
        fleet = LiveFleet(tmp)
        grace_s, min_run_s = 5.0, 2.0
        await fleet.start([8, 8], "--preemption-grace", str(grace_s), "--preemption-min-run", str(min_run_s))
        try:
            rows.append(await flood(fleet, plans=1000 if quick else 5000, slots=16, run_s=0.5,
                                    trickle=10 if quick else 30))  # fmt: skip
            rows.append(await weights(fleet, slots=16, run_s=0.5, warmup_s=10.0 if quick else 20.0,
                                      window_s=30.0 if quick else 60.0))  # fmt: skip
            rows.append(await preempt(fleet, slots=16, grace_s=grace_s, min_run_s=min_run_s))
            usage = await fleet.usage()
            names = sorted(row["name"] for row in usage["rows"])
            rows.append({"scenario": "usage (live)", "principals": names,
                         "met": set(PRINCIPALS) <= set(names)})  # fmt: skip
        finally:
            await fleet.stop()
    return rows


def main(quick: bool, as_json: bool) -> int:
    for row in asyncio.run(run(quick)):
        print(json.dumps(row) if as_json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main("--quick" in sys.argv, "--json" in sys.argv))
