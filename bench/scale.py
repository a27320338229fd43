"""Scale: thousands of worker sessions on one coordinator, and placement among them.

Phases (all in one run):

1. **Registration.** ``--sims`` processes (separate from the coordinator) open ``--workers``
   websocket sessions between them on ``/v1/worker``, each speaking the real protocol
   (``hello`` → ``welcome``, then a ``heartbeat`` every interval with ±10 % jitter and a
   random first phase, as the agent does). Time to all registered; the coordinator's RSS
   growth per session.
2. **Steady state.** After one heartbeat interval to settle, the coordinator's CPU over
   ``--window`` seconds, as a share of one core.
3. **Restart.** The coordinator is killed (SIGKILL) and started again on the same port; the
   sessions reconnect with the agent's backoff (full jitter, ``U(0, min(30, 0.5 * 2**n))``).
   Time from the new coordinator listening to all registered, and the connection attempts
   that took (a storm shows as attempts far above the number of workers).
4. **Placement** (in-process, on the sans-I/O core: no sockets). ``--workers`` registered
   workers, all busy, and ``--queued`` plans waiting: the time the core takes to place the
   next plan when a worker frees a slot (a ``done``), p50/p99, and the time to queue one
   more plan while every worker is busy.

    python bench/scale.py                                  # 10,000 sessions, 100,000 queued plans
    python bench/scale.py --workers 200 --queued 1000 --window 2 --heartbeat 1 --json   # smoke

A simulator process is this file run with ``simulate``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import signal
import sys
import time
from typing import Any

import _harness as h
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from protocol import Codec
from protocol.messages import Capabilities, Done, Heartbeat, Hello, Load, Submit, ToWorker, Welcome

# ---------------------------------------------------------------------------- simulated workers


class Sim:
    """Many simulated worker sessions in one process."""

    def __init__(self, url: str, prefix: str, count: int, connect_concurrency: int) -> None:
        self.url = url.rstrip("/") + "/v1/worker"
        self.prefix = prefix
        self.count = count
        self.codec = Codec("msgpack", ToWorker, "coordinator")
        self.registered = 0
        self.attempts = 0
        self.failures = 0
        self.gate = asyncio.Semaphore(connect_concurrency)  # only the first connects are paced
        self.all_registered = asyncio.Event()
        self.rng = random.Random()

    def _hello(self, worker_id: str) -> bytes:
        caps = Capabilities(cpu_cores=8, ram_bytes=32 * 10**9, ops=["echo"], tags=["sim"], max_concurrency=1,
                            hostname=worker_id)
        return self.codec.encode([Hello(worker_id=worker_id, capabilities=caps, version="bench")])

    async def session(self, index: int) -> None:
        worker_id = f"{self.prefix}{index}"
        hello = self._hello(worker_id)
        beat = self.codec.encode([Heartbeat(load=Load())])
        failures = 0
        first = True
        while True:
            registered = False
            self.attempts += 1
            try:
                if first:
                    async with self.gate:
                        ws = await connect(self.url, compression=None, open_timeout=30, proxy=None)
                    first = False
                else:
                    ws = await connect(self.url, compression=None, open_timeout=30, proxy=None)
                async with ws:
                    await ws.send(hello)
                    welcome = None
                    while welcome is None:
                        for msg in self.codec.decode(await asyncio.wait_for(ws.recv(), 30)):
                            if isinstance(msg, Welcome):
                                welcome = msg
                    registered = True
                    failures = 0
                    self.registered += 1
                    if self.registered == self.count:
                        print(json.dumps({"all_registered": time.monotonic(), "attempts": self.attempts,
                                          "failures": self.failures}), flush=True)
                    interval = welcome.heartbeat_interval_s
                    next_beat = time.monotonic() + self.rng.uniform(0, interval)  # phases spread out
                    while True:
                        try:
                            async with asyncio.timeout_at(asyncio.get_running_loop().time()
                                                          + max(0.0, next_beat - time.monotonic())):
                                await ws.recv()  # assigns never come (no plans); errors are ignored
                        except TimeoutError:
                            await ws.send(beat)
                            next_beat += interval * self.rng.uniform(0.9, 1.1)
            except (OSError, ConnectionClosed, InvalidHandshake, TimeoutError):
                pass
            if registered:
                self.registered -= 1
            else:
                self.failures += 1
                failures += 1
            # The agent's backoff: full jitter, base 0.5 s, cap 30 s (worker_agent/agent.py).
            await asyncio.sleep(self.rng.uniform(0, min(30.0, 0.5 * 2 ** min(failures, 10))))


async def simulate(url: str, prefix: str, count: int, concurrency: int, deadline_s: float) -> None:
    sim = Sim(url, prefix, count, concurrency)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    print(json.dumps({"started": time.monotonic()}), flush=True)
    tasks = [asyncio.create_task(sim.session(i)) for i in range(count)]
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline_s):
            await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(json.dumps({"final": True, "attempts": sim.attempts, "failures": sim.failures}), flush=True)


# ---------------------------------------------------------------------------- phases 1-3


async def sessions_phase(ns: argparse.Namespace) -> dict[str, Any]:
    async with h.fleet(ns.store) as f:
        hb = ["--heartbeat-interval", str(ns.heartbeat), "--heartbeat-timeout", str(ns.heartbeat * 3)]
        await f.start_coordinator(*hb)
        assert f.coordinator is not None
        profiler = h.Profiler(ns.profile)
        profiler.attach("coordinator-registration", f.coordinator.pid, duration_s=int(ns.deadline))
        await asyncio.sleep(0.5)  # let the fresh process settle before its baseline RSS is read
        rss0 = h.rss_bytes(f.coordinator.pid)
        per = [ns.workers // ns.sims + (1 if i < ns.workers % ns.sims else 0) for i in range(ns.sims)]
        me = str(h.BENCH / "scale.py")
        t0 = time.monotonic()
        cpu_reg0 = h.cpu_seconds(f.coordinator.pid)
        sims = [
            await h.spawn(f"sim-{i}", sys.executable, me, "simulate", "--url", f.url, "--prefix", f"sim{i}-",
                          "--count", str(n), "--concurrency", str(ns.connect_concurrency),
                          "--deadline", str(ns.deadline))
            for i, n in enumerate(per) if n
        ]
        f.others += sims
        starts = [await s.wait_for_line(r'"started"', 60) for s in sims]
        t0 = max(t0, min(json.loads(m.string)["started"] for m in starts))
        lines = [await s.wait_for_line(r'"all_registered"', ns.deadline) for s in sims]
        registered_s = max(json.loads(m.string)["all_registered"] for m in lines) - t0
        cpu_reg = h.cpu_seconds(f.coordinator.pid) - cpu_reg0
        profiler.finish()
        await asyncio.sleep(ns.heartbeat)  # one interval: every session has sent its first beat
        rss1 = h.rss_bytes(f.coordinator.pid)
        cpu0 = h.cpu_seconds(f.coordinator.pid)
        w0 = time.monotonic()
        profiler.attach("coordinator-steady", f.coordinator.pid, duration_s=int(ns.deadline))
        await asyncio.sleep(ns.window)  # the measurement window itself
        cpu_pct = 100 * (h.cpu_seconds(f.coordinator.pid) - cpu0) / (time.monotonic() - w0)
        profiler.finish()

        # Restart: kill -9, then a new coordinator on the same port and data dir.
        f.coordinator.kill()
        await f.coordinator.stop()
        for s in sims:
            s.lines.clear()
        t_kill = time.monotonic()
        await f.start_coordinator(*hb, port=f.port)
        t_up = time.monotonic()
        profiler.attach("coordinator-restart", f.coordinator.pid, duration_s=int(ns.deadline))
        lines = [await s.wait_for_line(r'"all_registered"', ns.deadline) for s in sims]
        profiler.finish()
        reports = [json.loads(m.string) for m in lines]
        again_s = max(r["all_registered"] for r in reports) - t_up
        for s in sims:
            s.proc.send_signal(signal.SIGTERM)
        finals = [json.loads((await s.wait_for_line(r'"final"', 60)).string) for s in sims]
        attempts = sum(r["attempts"] for r in finals)
        failures = sum(r["failures"] for r in finals)
        store_used = f.store_used
    return {
        "workers": ns.workers,
        "sim_processes": len(per),
        "heartbeat_interval_s": ns.heartbeat,
        "store_used": store_used,
        "registration_s": round(registered_s, 3),
        "registration_cpu_s": round(cpu_reg, 3),
        "coordinator_rss_base_mib": round(rss0 / 2**20, 1),
        "coordinator_rss_mib": round(rss1 / 2**20, 1),
        "kib_per_session": round((rss1 - rss0) / ns.workers / 1024, 2),
        "steady_cpu_pct_of_one_core": round(cpu_pct, 2),
        "steady_window_s": ns.window,
        "restart_down_s": round(t_up - t_kill, 3),
        "reregistration_s": round(again_s, 3),
        "connection_attempts_total": attempts,
        "failed_attempts_total": failures,
        "attempts_per_worker_after_restart": round((attempts - ns.workers) / ns.workers, 2),
    }


# ---------------------------------------------------------------------------- phase 4 (in-process)


# What each worker reports before the placement phase (``--placement-load``): ``none`` keeps them
# plain (coordinator/capacity.py); ``energy`` gives each its own measured µJ/token and some queued
# tokens; ``energy-tied`` the same, but 8 figures shared by 1,250 workers each (joule_weighted then
# compares the busyness of the free workers tied on the least energy, at most
# ``--placement-candidates`` of them); ``tokens`` queued tokens only (the policy ranks the room
# index's first ``--placement-candidates`` workers; 0: the whole pool in one pass); ``carbon``
# (``carbon-tied``) each worker's own µJ/token and zone intensity (8 shared pairs), placed by
# carbon_weighted; ``latency`` (``latency-tied``) each its own p50 latency (8 shared), placed by
# latency_weighted (both answered by their pool indexes, coordinator/capacity.py).
PLACEMENT_LOADS = ("none", "energy", "energy-tied", "tokens", "carbon", "carbon-tied", "latency", "latency-tied")
# The policy a load is placed by (the coordinator's default for the others).
PLACEMENT_POLICY = {
    "carbon": "carbon_weighted",
    "carbon-tied": "carbon_weighted",
    "latency": "latency_weighted",
    "latency-tied": "latency_weighted",
}


def _placement_load(kind: str, i: int) -> Load | None:
    if kind == "energy":
        return Load(uj_per_token=100.0 + (i * 7919 % 10_007) * 0.01, queued_tokens=i % 50)
    if kind == "energy-tied":
        return Load(uj_per_token=100.0 + 10 * (i % 8), queued_tokens=i % 50)
    if kind == "tokens":
        return Load(queued_tokens=i % 50)
    if kind == "carbon":
        return Load(
            uj_per_token=100.0 + (i * 7919 % 10_007) * 0.01,
            zone_intensity_g_per_kwh=50.0 + (i * 104_729 % 9_973) * 0.05,
            queued_tokens=i % 50,
        )
    if kind == "carbon-tied":
        return Load(uj_per_token=100.0 + 10 * (i % 8), zone_intensity_g_per_kwh=200.0, queued_tokens=i % 50)
    if kind == "latency":
        return Load(latency_p50_ms=20.0 + (i * 7919 % 10_007) * 0.01, queued_tokens=i % 50)
    if kind == "latency-tied":
        return Load(latency_p50_ms=20.0 + 5 * (i % 8), queued_tokens=i % 50)
    return None


def placement_phase(
    workers: int, queued: int, samples: int, budget_s: float, load: str = "none", candidates: int | None = None
) -> dict[str, Any]:
    """The sans-I/O core with ``workers`` workers (one slot each), filled, then ``queued`` waiting plans.

    ``load``: what each worker reports first (:data:`PLACEMENT_LOADS`). ``candidates``: the
    coordinator's ``--placement-candidates`` (None: its default).

    Building that state is itself measured: each submit that is placed on a free worker is a
    placement decision among the free workers, and each submit made while all are busy is a
    queueing (the core explains why it waits). The queue is filled for at most ``budget_s``
    seconds; the report gives the queue length reached. Then ``samples`` times a worker
    finishes its plan and the core places the best queued plan on it.
    """
    import structlog

    from coordinator.core import Coordinator, CoreConfig
    from coordinator.placement.placer import PlacementConfig

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings only
    ids = itertools.count()
    settings: dict[str, Any] = {} if candidates is None else {"candidates": candidates}
    if load in PLACEMENT_POLICY:
        settings["policy"] = PLACEMENT_POLICY[load]
    # One client fills the queue (``queued`` plans): no plan quota, as the core had before it took the server's.
    config = CoreConfig(placement=PlacementConfig(**settings), max_plans_per_client=0)
    core = Coordinator(config, new_id=lambda: f"{next(ids):016x}")
    now = 1.0
    caps = Capabilities(cpu_cores=8, ram_bytes=32 * 10**9, ops=["echo"], tags=["sim"], max_concurrency=1)
    register: list[float] = []
    for i in range(workers):
        t = time.perf_counter()
        core.open_session(i + 1, "worker", now, principal="worker")
        core.receive(i + 1, Hello(worker_id=f"w{i}", capabilities=caps), now)
        core.take_effects()
        register.append(time.perf_counter() - t)
    for i in range(workers):
        if (report := _placement_load(load, i)) is not None:
            core.receive(i + 1, Heartbeat(load=report), now)
            core.take_effects()
    client = workers + 1
    core.open_session(client, "client", now, principal="bench")
    lease: dict[int, str] = {}  # worker conn -> the plan it holds
    req_ids = itertools.count(1)

    def submit() -> float:
        t = time.perf_counter()
        core.receive(client, Submit(req_id=next(req_ids), op="echo", args=None, subscribe=False), now)
        dt = time.perf_counter() - t
        for conn, msgs in core.take_effects().sends.items():
            for m in msgs:
                if type(m).__name__ == "Assign":
                    lease[conn] = m.plan_id
        return dt

    placed = [submit() for _ in range(workers)]
    enqueue: list[float] = []
    t_fill = time.perf_counter()
    while len(enqueue) < queued and time.perf_counter() - t_fill < budget_s:
        enqueue.append(submit())
    place_next: list[float] = []
    conns = list(lease)
    for k in range(min(samples, len(enqueue))):
        conn = conns[k % len(conns)]
        t = time.perf_counter()
        core.receive(conn, Done(plan_id=lease[conn], attempt=1, outcome="succeeded", result=None), now)
        place_next.append(time.perf_counter() - t)
        for m in core.take_effects().sends.get(conn, ()):
            if type(m).__name__ == "Assign":
                lease[conn] = m.plan_id

    # The reaper's tick with every worker alive (nothing to reap): what each tick costs at this scale.
    reaper: list[float] = []
    for _ in range(min(samples, 500)):
        t = time.perf_counter()
        core.tick(now)
        reaper.append(time.perf_counter() - t)
        core.take_effects()

    def us(samples_s: list[float], pct: float) -> float:
        return round(h.percentile(samples_s, pct) * 1e6, 1)

    return {
        "workers": workers,
        "worker_load": load,
        "placement_candidates": getattr(config.placement, "candidates", None),
        "placement_policy": getattr(config.placement, "policy", None),
        "queued_asked": queued,
        "queued_reached": len(enqueue),
        "queue_fill_budget_s": budget_s,
        "register_p50_us": us(register, 50),
        "register_last_1000_p50_us": us(register[-1000:], 50),
        "submit_placed_on_free_worker_p50_us": us(placed, 50),
        "submit_placed_on_free_worker_p99_us": us(placed, 99),
        "submit_placed_last_1000_p50_us": us(placed[-1000:], 50),
        "submit_queued_all_busy_p50_us": us(enqueue, 50),
        "submit_queued_all_busy_p99_us": us(enqueue, 99),
        "done_then_place_next_p50_us": us(place_next, 50),
        "done_then_place_next_p99_us": us(place_next, 99),
        "place_next_samples": len(place_next),
        "reaper_tick_p50_us": us(reaper, 50),
        "reaper_tick_p99_us": us(reaper, 99),
    }


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "simulate"))
    parser.add_argument("--workers", type=int, default=10_000, help="worker sessions (default 10000)")
    parser.add_argument("--sims", type=int, default=4, help="simulator processes (default 4)")
    parser.add_argument("--heartbeat", type=float, default=10.0, help="heartbeat interval, s (default 10)")
    parser.add_argument("--window", type=float, default=30.0, help="steady-state window, s (default 30)")
    parser.add_argument("--queued", type=int, default=100_000, help="queued plans in the placement phase")
    parser.add_argument("--samples", type=int, default=2000, help="placement decisions timed (default 2000)")
    parser.add_argument("--placement-budget", type=float, default=60.0,
                        help="seconds spent filling the queue at most (default 60)")
    parser.add_argument("--connect-concurrency", type=int, default=64, help="first connects in flight per sim")
    parser.add_argument("--skip-sessions", action="store_true", help="only the in-process placement phase")
    parser.add_argument("--skip-placement", action="store_true", help="only the session phases")
    parser.add_argument("--placement-load", choices=PLACEMENT_LOADS, default="none",
                        help="what workers report before the placement phase (default none)")
    parser.add_argument("--placement-candidates", type=int, default=None, metavar="K",
                        help="the coordinator's --placement-candidates in the placement phase (default: its default)")
    parser.add_argument("--deadline", type=float, default=600.0, help="give up after this many seconds")
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="sim-", help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", type=int, default=64, help=argparse.SUPPRESS)
    h.common_args(parser)
    ns = parser.parse_args(argv)
    h.configure(ns)
    if ns.mode == "simulate":
        h.run_loop(simulate(ns.url, ns.prefix, ns.count, ns.concurrency, ns.deadline))
        return 0
    result: dict[str, Any] = {"bench": "scale", "system": "fleetwire", "machine": h.machine()}
    if not ns.skip_sessions:
        result["sessions"] = h.run_loop(sessions_phase(ns))
    if not ns.skip_placement:
        result["placement"] = placement_phase(
            ns.workers, ns.queued, ns.samples, ns.placement_budget, ns.placement_load, ns.placement_candidates
        )
    lines = ["fleetwire scale:"]
    if "sessions" in result:
        s = result["sessions"]
        lines += [
            f"  {s['workers']} worker sessions from {s['sim_processes']} processes, store {s['store_used']}",
            f"  registration: all in {s['registration_s']} s (coordinator CPU {s['registration_cpu_s']} s)",
            f"  memory: {s['kib_per_session']} KiB per session (RSS {s['coordinator_rss_base_mib']} -> "
            f"{s['coordinator_rss_mib']} MiB)",
            f"  steady state: {s['steady_cpu_pct_of_one_core']} % of one core (heartbeat every "
            f"{s['heartbeat_interval_s']} s, {s['steady_window_s']} s window)",
            f"  restart: all registered again {s['reregistration_s']} s after the new coordinator listened "
            f"({s['attempts_per_worker_after_restart']} extra attempts per worker)",
        ]
    if "placement" in result:
        p = result["placement"]
        lines += [
            f"  placement, in-process core, {p['workers']} workers with one slot each, reporting "
            f"{p['worker_load']} (--placement-load), policy {p['placement_policy']}, "
            f"placement candidates {p['placement_candidates']}:",
            f"    register a worker p50 {p['register_p50_us']} µs (last 1000: {p['register_last_1000_p50_us']} µs)",
            f"    submit placed on a free worker p50 {p['submit_placed_on_free_worker_p50_us']} µs, "
            f"p99 {p['submit_placed_on_free_worker_p99_us']} µs (last 1000: {p['submit_placed_last_1000_p50_us']} µs)",
            f"    submit queued while all are busy p50 {p['submit_queued_all_busy_p50_us']} µs, "
            f"p99 {p['submit_queued_all_busy_p99_us']} µs "
            f"({p['queued_reached']} of {p['queued_asked']} queued within {p['queue_fill_budget_s']} s)",
            f"    done -> next queued plan placed p50 {p['done_then_place_next_p50_us']} µs, "
            f"p99 {p['done_then_place_next_p99_us']} µs",
            f"    reaper tick (nothing stale) p50 {p['reaper_tick_p50_us']} µs, p99 {p['reaper_tick_p99_us']} µs",
        ]
    h.emit(result, ns.json, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
