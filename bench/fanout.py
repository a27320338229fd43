"""Fan-out: one plan streams N ephemeral events to S subscribers; deliveries per second.

Set-up, so that every subscriber is attached before the first event and nothing waits on a
sleep: the plan (op ``stream``, from ``_bench_handlers``) is submitted while no worker
handles that op, so it waits in the queue; S SDK clients in separate processes ``watch``
it and say they are ready; only then does a worker that handles ``stream`` start, and the
plan runs. Each subscriber notes when its first ``tok`` event and its terminal event came.
Deliveries/s = events received by all subscribers / (last terminal - first ``tok``).

The second run adds one *slow* subscriber (a raw websocket with a 4 KiB receive buffer that
reads one frame every ``--slow-delay-ms``, so the coordinator meets TCP backpressure on its
session), to show whether it slows the others down.

    python bench/fanout.py                               # 10,000 events to 100 subscribers
    python bench/fanout.py --events 300 --subscribers 4 --json   # the smoke size

A subscriber process is this file run with ``subscribe``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import time
from typing import Any

import _harness as h
from websockets.asyncio.client import connect

from fleetwire import Client
from protocol import Codec
from protocol.messages import Subscribe, ToClient


async def subscriber(url: str, plan_id: str, clients: int, deadline_s: float) -> dict[str, Any]:
    """Run ``clients`` SDK sessions watching ``plan_id``; report when the stream came."""
    sessions = [Client(url) for _ in range(clients)]
    for c in sessions:
        await c.connect()
    plans = [await c.watch(plan_id) for c in sessions]
    print("ready", flush=True)
    firsts: list[float] = []
    lasts: list[float] = []
    counts: list[int] = []

    async def follow(plan: Any) -> None:
        first = 0.0
        n = 0
        async for event in plan.events():
            if event.kind == "tok":
                n += 1
                if not first:
                    first = time.monotonic()
        lasts.append(time.monotonic())
        firsts.append(first)
        counts.append(n)

    async with asyncio.timeout(deadline_s):
        await asyncio.gather(*(follow(p) for p in plans))
    for c in sessions:
        await c.close()
    return {"first": min(firsts), "last": max(lasts), "events": sum(counts), "min_events": min(counts)}


async def slow_subscriber(url: str, plan_id: str, delay_s: float, deadline_s: float) -> None:
    """A client that subscribes, then reads one frame every ``delay_s`` (until stopped, or the deadline)."""
    codec = Codec("msgpack", ToClient, "coordinator")
    # A small receive buffer, so the kernel cannot absorb the whole stream for it: the
    # coordinator's writer to this session meets TCP backpressure after a few frames.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    async with connect(url.rstrip("/") + "/v1/client", sock=sock, compression=None, max_size=None) as ws:
        await ws.send(codec.encode([Subscribe(req_id=1, plan_ids=[plan_id])]))
        await ws.recv()  # subscribed
        print("ready", flush=True)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline_s):
                while True:
                    await asyncio.sleep(delay_s)  # the slowness being measured, not a wait for state
                    await ws.recv()


async def measure(
    events: int, subscribers: int, procs: int, store: str, slow: bool, slow_delay_s: float, deadline_s: float
) -> dict[str, Any]:
    async with h.fleet(store) as f:
        await f.start_coordinator()
        assert f.coordinator is not None
        async with Client(f.url) as client:
            plan = await client.submit("stream", args={"count": events})
            me = str(h.BENCH / "fanout.py")
            per_proc = [subscribers // procs + (1 if i < subscribers % procs else 0) for i in range(procs)]
            subs = [
                await h.spawn(f"subscriber-{i}", sys.executable, me, "subscribe", "--url", f.url, "--plan", plan.id,
                              "--clients", str(n), "--deadline", str(deadline_s))
                for i, n in enumerate(per_proc) if n
            ]
            f.others += subs
            slow_proc = None
            if slow:
                slow_proc = await h.spawn("slow", sys.executable, me, "slow", "--url", f.url, "--plan", plan.id,
                                          "--delay", str(slow_delay_s), "--deadline", str(deadline_s))
                f.others.append(slow_proc)
            for p in f.others:
                await p.wait_for_line("^ready", 60)
            cpu0 = h.cpu_seconds(f.coordinator.pid)
            await f.start_worker("streamer", "--handler", "stream=_bench_handlers:stream")
            await plan.result()
            reports = []
            for p in subs:
                line = await p.wait_for_line(r"^\{", deadline_s)
                reports.append(json.loads(line.string))
            coordinator_cpu = h.cpu_seconds(f.coordinator.pid) - cpu0
        store_used = f.store_used
    first = min(r["first"] for r in reports)
    last = max(r["last"] for r in reports)
    delivered = sum(r["events"] for r in reports)
    return {
        "events": events,
        "subscribers": subscribers,
        "slow_subscriber": slow,
        "delivered": delivered,
        "complete": delivered == events * subscribers,
        "fewest_per_subscriber": min(r["min_events"] for r in reports),
        "elapsed_s": round(last - first, 4),
        "deliveries_per_s": round(delivered / max(last - first, 1e-9), 1),
        "coordinator_cpu_s": round(coordinator_cpu, 3),
        "store_used": store_used,
    }


async def both(ns: argparse.Namespace) -> dict[str, Any]:
    """Runs without and with a slow subscriber, alternating, ``--repeat`` times; the median run of each."""
    variants = [False] if ns.no_slow else [False, True]
    runs: dict[bool, list[dict[str, Any]]] = {v: [] for v in variants}
    store_used = ""
    for _ in range(ns.repeat):
        for slow in variants:
            r = await measure(ns.events, ns.subscribers, ns.procs, ns.store, slow, ns.slow_delay_ms / 1e3,
                              ns.deadline)
            store_used = r.pop("store_used")
            runs[slow].append(r)

    def median(rs: list[dict[str, Any]]) -> dict[str, Any]:
        ordered = sorted(rs, key=lambda r: r["deliveries_per_s"])
        chosen = dict(ordered[len(ordered) // 2])
        chosen["runs_deliveries_per_s"] = [r["deliveries_per_s"] for r in rs]
        chosen["complete"] = all(r["complete"] for r in rs)
        return chosen

    result: dict[str, Any] = {"bench": "fanout", "system": "fleetwire", "store_used": store_used,
                              "plain": median(runs[False]), "machine": h.machine()}
    if True in runs:
        result["with_slow_subscriber"] = median(runs[True])
        result["slow_effect"] = round(
            result["with_slow_subscriber"]["deliveries_per_s"] / result["plain"]["deliveries_per_s"], 3
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="bench", choices=("bench", "subscribe", "slow"))
    parser.add_argument("--events", type=int, default=10_000, help="events the plan streams (default 10000)")
    parser.add_argument("--subscribers", type=int, default=100, help="subscribing sessions (default 100)")
    parser.add_argument("--procs", type=int, default=4, help="processes the subscribers run in (default 4)")
    parser.add_argument("--slow-delay-ms", type=float, default=20.0, help="the slow subscriber's pause per frame")
    parser.add_argument("--no-slow", action="store_true", help="skip the run with a slow subscriber")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each variant; the median is reported")
    parser.add_argument("--deadline", type=float, default=120.0, help="give up after this many seconds")
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--plan", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--delay", type=float, default=0.02, help=argparse.SUPPRESS)
    h.common_args(parser)
    ns = parser.parse_args(argv)
    h.configure(ns)
    if ns.mode == "subscribe":
        print(json.dumps(h.run_loop(subscriber(ns.url, ns.plan, ns.clients, ns.deadline))), flush=True)
        return 0
    if ns.mode == "slow":
        h.run_loop(slow_subscriber(ns.url, ns.plan, ns.delay, ns.deadline))
        return 0
    result = h.run_loop(both(ns))
    lines = [f"fleetwire fan-out: {ns.events} events to {ns.subscribers} subscribers, store {result['store_used']}"]
    for key in ("plain", "with_slow_subscriber"):
        if key in result:
            r = result[key]
            lines.append(f"  {key.replace('_', ' ')}: {r['deliveries_per_s']:,.0f} deliveries/s median "
                         f"({r['delivered']} in {r['elapsed_s']} s; complete: {r['complete']}; "
                         f"coordinator CPU {r['coordinator_cpu_s']} s; runs {r['runs_deliveries_per_s']})")
    h.emit(result, ns.json, lines)
    ok = result["plain"]["complete"] and result.get("with_slow_subscriber", {"complete": True})["complete"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
