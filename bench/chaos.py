"""Chaos: N plans while workers are killed and restarted at random and the coordinator restarts twice.

Real processes on 127.0.0.1: a coordinator on a SQLite store (short heartbeat timeouts), four
workers, and this process as the client (the SDK, resuming across restarts). While the plans
run, a chaos task picks a random worker every 0.3-1 s and kills it (SIGKILL mostly, SIGTERM
sometimes, SIGSTOP past the heartbeat timeout now and then), restarting it under the same id;
the coordinator is killed with SIGKILL once a third of the plans have ended and stopped with
SIGTERM at two thirds, each time restarted on the same port and store.

Every plan has a client-chosen id (its idempotency key) and the client follows every stream.
At the end it reports:

* ``submitted``, ``succeeded``, ``failed`` (by code);
* ``lost``: plans acknowledged (``accepted``) that reached no terminal state by the deadline;
* ``duplicated``: plans the coordinator holds beyond those submitted, plus plans whose stream
  went on after the terminal event the client saw (a second outcome);
* ``violations``: streams whose seqs are not 1, 2, 3, ... (a ``resync`` marker counts for the
  run of seqs it stands for), or whose terminal event is not the last;
* what the chaos did, and how many plans ran more than one attempt (at-least-once execution).

    python bench/chaos.py --plans 5000
    python bench/chaos.py --plans 40 --json          # the smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import signal
import time
from collections import Counter
from typing import Any

import _harness as h

from fleetwire import Client
from fleetwire.plan import Plan
from protocol.messages import TERMINAL_STATES

COORDINATOR_FLAGS = ("--heartbeat-interval", "0.25", "--heartbeat-timeout", "1.5", "--reaper-interval", "0.1",
                     "--log-level", "warning")  # fmt: skip
WORKER_FLAGS = ("--reconnect-base", "0.05", "--reconnect-cap", "0.5", "--drain-timeout", "0.5")


class Chaos:
    """The fleet, the chaos schedule and what it did."""

    def __init__(self, fleet: h.Fleet, workers: int, seed: int) -> None:
        self.fleet = fleet
        self.worker_ids = [f"chaos-{i + 1}" for i in range(workers)]
        self.procs: dict[str, h.Proc] = {}
        self.rng = random.Random(seed)
        self.actions: Counter[str] = Counter()
        self.coordinator_restarts = 0
        self._busy: set[str] = set()  # one action at a time per worker
        self._background: set[asyncio.Task[None]] = set()

    async def start_worker(self, worker_id: str) -> None:
        proc = await self.fleet.start_worker(worker_id, *WORKER_FLAGS, max_concurrency=32)
        self.procs[worker_id] = proc

    async def hit_a_worker(self) -> None:
        worker_id = self.rng.choice(self.worker_ids)
        proc = self.procs[worker_id]
        if worker_id in self._busy or proc.proc.returncode is not None:
            return
        self._busy.add(worker_id)
        try:
            await self._hit(worker_id, proc)
        finally:
            self._busy.discard(worker_id)

    async def _hit(self, worker_id: str, proc: h.Proc) -> None:
        roll = self.rng.random()
        if roll < 0.15:  # frozen past the heartbeat timeout, then thawed: its attempts are fenced
            self.actions["sigstop"] += 1
            proc.proc.send_signal(signal.SIGSTOP)
            await asyncio.sleep(2.0)
            with contextlib.suppress(ProcessLookupError):
                proc.proc.send_signal(signal.SIGCONT)
            return
        if roll < 0.35:
            self.actions["sigterm"] += 1
            proc.proc.send_signal(signal.SIGTERM)
        else:
            self.actions["sigkill"] += 1
            proc.kill()
        await proc.proc.wait()
        await asyncio.sleep(self.rng.uniform(0.05, 0.5))
        await self.start_worker(worker_id)

    async def restart_coordinator(self, sig: signal.Signals) -> None:
        fleet = self.fleet
        assert fleet.coordinator is not None
        self.coordinator_restarts += 1
        self.actions[f"coordinator {sig.name}"] += 1
        if sig == signal.SIGKILL:
            fleet.coordinator.kill()
            await fleet.coordinator.proc.wait()
        else:
            await fleet.coordinator.stop()
        fleet.others.append(fleet.coordinator)
        await fleet.start_coordinator(*COORDINATOR_FLAGS, port=fleet.port)

    async def run(self, progress: Any, total: int, stop: asyncio.Event) -> None:
        """Hit workers until ``stop``; restart the coordinator at a third and two thirds of ``total``."""
        marks = [(total // 3, signal.SIGKILL), (2 * total // 3, signal.SIGTERM)]
        while not stop.is_set():
            if marks and progress() >= marks[0][0]:
                await self.restart_coordinator(marks.pop(0)[1])
            task = asyncio.create_task(self.hit_a_worker())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            try:
                await asyncio.wait_for(stop.wait(), self.rng.uniform(0.3, 1.0))
            except TimeoutError:
                pass
        for mark, sig in marks:  # a run shorter than the schedule still restarts twice
            del mark
            await self.restart_coordinator(sig)
        await asyncio.gather(*self._background, return_exceptions=True)


def check_stream(plan: Plan, events: list[Any]) -> tuple[bool, int]:
    """(the stream is in order, resync markers in it)."""
    expected, ordered = 1, True
    for e in events:  # a resync marker (seq = its last_seq) stands for the run first_seq..last_seq
        first = e.data.get("first_seq", e.seq) if e.kind == "resync" and isinstance(e.data, dict) else e.seq
        if first != expected or e.seq < first:
            ordered = False
            break
        expected = e.seq + 1
    terminal = [i for i, e in enumerate(events) if e.kind in TERMINAL_STATES]
    ordered = ordered and len(terminal) == 1 and terminal[0] == len(events) - 1
    return ordered, sum(e.kind == "resync" for e in events)


async def follow(plan: Plan, deadline: float) -> list[Any]:
    events: list[Any] = []
    try:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            async for event in plan.events():
                events.append(event)
    except (TimeoutError, ConnectionError, OSError):
        pass
    return events


async def measure(plans: int, workers: int, seed: int, deadline_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    async with h.fleet("sqlite") as fleet:
        await fleet.start_coordinator(*COORDINATOR_FLAGS)
        chaos = Chaos(fleet, workers, seed)
        for worker_id in chaos.worker_ids:
            await chaos.start_worker(worker_id)
        await fleet.wait_workers()
        t0 = time.monotonic()
        deadline = t0 + deadline_s
        async with Client(fleet.url, token="", reconnect_base_s=0.05, reconnect_cap_s=0.5,
                          reconnect_give_up_s=deadline_s) as client:  # fmt: skip
            submitted: list[Plan] = []
            followers: list[asyncio.Task[list[Any]]] = []
            stop = asyncio.Event()
            chaos_task = asyncio.create_task(chaos.run(lambda: sum(p.done() for p in submitted), plans, stop))
            chunk = max(1, min(500, plans // 10))
            for start in range(0, plans, chunk):
                count = min(chunk, plans - start)
                args = [{"seconds": round(rng.uniform(0.0, 0.2), 3)} for _ in range(count)]
                ids = [f"chaos-{seed}-{n}" for n in range(start, start + count)]
                batch = await client.submit_many("sleep", args, plan_ids=ids, max_attempts=10)
                submitted += batch
                followers += [asyncio.create_task(follow(plan, deadline)) for plan in batch]
                await asyncio.sleep(0.2)  # spread the submits over the chaos
            streams = await asyncio.gather(*followers)
            stop.set()
            await chaos_task
            infos = {}
            for plan in submitted:
                try:
                    infos[plan.id] = await client.get_plan(plan.id)
                except Exception as exc:  # a plan the coordinator forgot is lost; say which
                    infos[plan.id] = exc
            held = (await client.plans(limit=1)).total if hasattr(client, "plans") else len(submitted)
        elapsed = time.monotonic() - t0
    outcomes: Counter[str] = Counter()
    failed_codes: Counter[str] = Counter()
    lost = violations = resyncs = reran = after_terminal = 0
    requeues: Counter[str] = Counter()
    for plan, events in zip(submitted, streams, strict=True):
        for event in events:
            if event.kind == "requeued" and isinstance(event.data, dict):
                reason = str(event.data.get("reason", ""))
                requeues[re.sub(r"chaos-\d+|\d+(\.\d+)?", "#", reason)] += 1
        terminal = next((e for e in events if e.kind in TERMINAL_STATES), None)
        if terminal is None:
            lost += 1
            continue
        outcomes[terminal.kind] += 1
        if terminal.kind == "failed":
            failed_codes[str(terminal.data.get("code"))] += 1
        ordered, markers = check_stream(plan, events)
        violations += not ordered
        resyncs += markers
        reran += int(terminal.data.get("attempt", 1) or 1) > 1 if isinstance(terminal.data, dict) else 0
        info = infos.get(plan.id)
        if not hasattr(info, "last_seq") or info.last_seq != terminal.seq or info.state != terminal.kind:
            after_terminal += 1
    duplicated = max(0, held - len(submitted)) + after_terminal
    return {
        "bench": "chaos",
        "submitted": len(submitted),
        "succeeded": outcomes["succeeded"],
        "failed": outcomes["failed"],
        "failed_codes": dict(failed_codes),
        "cancelled": outcomes["cancelled"],
        "lost": lost,
        "duplicated": duplicated,
        "plans_held_by_coordinator": held,
        "violations": violations,
        "resyncs": resyncs,
        "plans_rerun": reran,
        "requeue_reasons": dict(requeues.most_common(8)),
        "chaos": dict(chaos.actions),
        "coordinator_restarts": chaos.coordinator_restarts,
        "workers": workers,
        "elapsed_s": round(elapsed, 2),
        "seed": seed,
        "machine": h.machine(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=5000, help="plans to run (default 5000)")
    parser.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    parser.add_argument("--seed", type=int, default=1, help="chaos and workload seed (default 1)")
    parser.add_argument("--deadline", type=float, default=600.0, help="seconds for every plan to end (default 600)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ns = parser.parse_args(argv)
    r = h.run_loop(measure(ns.plans, ns.workers, ns.seed, ns.deadline))
    h.emit(r, ns.json, [
        f"fleetwire chaos: {r['submitted']} plans, {r['workers']} workers, {r['elapsed_s']} s",
        f"  submitted {r['submitted']}  succeeded {r['succeeded']}  failed {r['failed']} {r['failed_codes'] or ''}",
        f"  lost {r['lost']}  duplicated {r['duplicated']}  event-order violations {r['violations']}",
        f"  chaos: {r['chaos']}; coordinator restarts {r['coordinator_restarts']}; "
        f"plans re-run {r['plans_rerun']}; resync markers {r['resyncs']}",
    ])
    return 0 if r["lost"] == r["duplicated"] == r["violations"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
