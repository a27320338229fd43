"""A legitimate client's latency while hostile peers hit the same coordinator (RELIABILITY.md rows 16, 19-21).

    python bench/hostile_neighbors.py [--requests 2000] [--json]

One coordinator (default limits) on loopback in this process. A legitimate client sends
``list_workers`` requests one at a time and records each round trip; the figures are its
p50/p99 with no neighbour, then next to each hostile neighbour in turn:

* ``flood``: a client sending single-message frames as fast as it can (throttled, then 4429,
  then reconnecting);
* ``oversize``: a client sending 10 MiB frames in a loop (each closed 1009, reconnecting);
* ``slowloris``: 500 connections that never finish their handshake (dropped at the handshake
  timeout, set to 2 s here), plus how long a fresh legitimate connect takes meanwhile;
* ``slow consumer``: a subscriber that stops reading while a worker streams 32 KiB events
  (closed 4503; the coordinator's RSS growth is printed).

The matrix asks others' p99 to move by less than 10 % (rows 16, 20), a legit connect under
1 s during slowloris (row 19) and bounded memory for a slow consumer (row 21). Benchmarks
are not tests: this prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
import structlog
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.limits import Limits
from coordinator.server import CoordinatorServer, ServerSettings

WORKER, CLIENT = "bench-worker-token", "bench-client-token"


async def _open(url: str, role: str = "client", **kw: Any) -> ClientConnection:
    token = WORKER if role == "worker" else CLIENT
    return await connect(f"{url}/v1/{role}", additional_headers={"Authorization": f"Bearer {token}"},
                         subprotocols=["fleetwire.v1.msgpack"], compression=None, max_size=None,  # type: ignore[list-item]
                         **kw)


async def _latencies(url: str, n: int) -> list[float]:
    ws = await _open(url)
    request = msgspec.msgpack.encode({"type": "list_workers", "req_id": 1})
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await ws.send(request)
        await ws.recv()
        out.append(time.perf_counter() - start)
    await ws.close()
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(statistics.median(ordered) * 1e3, 3),
            "p99_ms": round(ordered[int(len(ordered) * 0.99) - 1] * 1e3, 3)}


async def _flood(url: str, stop: asyncio.Event, counts: dict[str, int]) -> None:
    frame = msgspec.msgpack.encode({"type": "list_workers", "req_id": 2})
    while not stop.is_set():
        ws = await _open(url)
        reader = asyncio.create_task(_drain(ws))
        with contextlib.suppress(ConnectionClosed, AttributeError):
            while not stop.is_set():
                await ws.send(frame)
                counts["sent"] += 1
        with contextlib.suppress(AttributeError):
            await ws.close()
        await reader
        counts[f"closed {ws.close_code}"] = counts.get(f"closed {ws.close_code}", 0) + 1


async def _oversize(url: str, stop: asyncio.Event, counts: dict[str, int]) -> None:
    blob = bytes(10 << 20)
    while not stop.is_set():
        ws = await _open(url)
        with contextlib.suppress(ConnectionClosed, AttributeError):
            await ws.send(blob)
            await ws.recv()
        counts[f"closed {ws.close_code}"] = counts.get(f"closed {ws.close_code}", 0) + 1


async def _drain(ws: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


async def _neighbour(url: str, name: str, fn: Any, n: int) -> dict[str, Any]:
    stop = asyncio.Event()
    counts: dict[str, int] = {"sent": 0}
    task = asyncio.create_task(fn(url, stop, counts))
    await asyncio.sleep(0.5)  # let it get going
    result = _summary(await _latencies(url, n))
    stop.set()
    await asyncio.wait_for(task, 30)
    return {"neighbour": name, **result, "neighbour_counts": counts}


async def _slowloris(url: str, n: int) -> dict[str, Any]:
    host, port = url.removeprefix("ws://").split(":")
    loris = [await asyncio.open_connection(host, int(port)) for _ in range(500)]
    for _, writer in loris:
        writer.write(b"GET /v1/client HTTP/1.1\r\nHost: x\r\n")
    start = time.perf_counter()
    ws = await _open(url)
    connect_s = time.perf_counter() - start
    await ws.close()
    result = _summary(await _latencies(url, n))
    dropped = 0
    for reader, writer in loris:
        with contextlib.suppress(TimeoutError, ConnectionError):
            if await asyncio.wait_for(reader.read(), 10) == b"":
                dropped += 1
        writer.close()
    return {"neighbour": "slowloris x500", **result, "legit_connect_ms": round(connect_s * 1e3, 2),
            "dropped_at_timeout": dropped}


async def _slow_consumer(url: str) -> dict[str, Any]:
    rss = psutil.Process()
    worker = await _open(url, "worker")
    await worker.send(msgspec.msgpack.encode({"type": "hello", "worker_id": "b1",
                                              "capabilities": {"ops": ["echo"], "max_concurrency": 1}}))
    await worker.recv()
    slow = await _open(url, ping_interval=None)
    await slow.send(msgspec.msgpack.encode({"type": "submit", "req_id": 1, "op": "echo", "plan_id": "s"}))
    assign = msgspec.msgpack.decode(await worker.recv())
    slow.transport.pause_reading()
    before = rss.memory_info().rss
    peak = before
    blob = "x" * 32_768
    sent = 0
    start = time.perf_counter()
    event = {"type": "event", "plan_id": "s", "attempt": assign["attempt"], "kind": "log", "data": blob}
    while sent < 20_000 and time.perf_counter() - start < 20:
        await worker.send(msgspec.msgpack.encode([event] * 10))
        sent += 10
        if sent % 500 == 0:
            peak = max(peak, rss.memory_info().rss)
            await worker.ping()
    slow.transport.abort()
    await worker.close()
    return {"neighbour": "slow consumer", "events_streamed": sent,
            "rss_growth_mb": round((peak - before) / 2**20, 1)}


async def run(requests: int) -> list[dict[str, Any]]:
    structlog.configure(processors=[lambda *_: (_ for _ in ()).throw(structlog.DropEvent)])
    server = CoordinatorServer(ServerSettings(port=0, worker_tokens=(WORKER,), client_tokens=(CLIENT,),
                                              store="memory", limits=Limits(handshake_timeout_s=2.0)))
    await server.start()
    url = server.url
    rows = [{"neighbour": "none", **_summary(await _latencies(url, requests))}]
    rows.append(await _neighbour(url, "flood", _flood, requests))
    rows.append(await _neighbour(url, "oversize 10 MiB", _oversize, requests))
    rows.append(await _slowloris(url, requests))
    try:
        rows.append(await _slow_consumer(url))
    except (ConnectionClosed, InvalidStatus) as exc:
        rows.append({"neighbour": "slow consumer", "error": repr(exc)})
    await server.stop()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="round trips per measurement (default 2000)")
    parser.add_argument("--json", action="store_true")
    ns = parser.parse_args()
    rows = asyncio.run(run(ns.requests))
    if ns.json:
        print(json.dumps(rows))
        return 0
    base = rows[0].get("p99_ms") or 1.0
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in ("neighbour", "p50_ms", "p99_ms")}
        p99 = row.get("p99_ms")
        delta = f" ({(p99 / base - 1) * 100:+.0f}% p99)" if p99 is not None and row is not rows[0] else ""
        print(f"{row['neighbour']:<18} p50 {row.get('p50_ms', '-')} ms  p99 {p99 if p99 is not None else '-'} ms"
              f"{delta}  {extra or ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
