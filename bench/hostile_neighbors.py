"""A legitimate client's latency while hostile peers hit the same coordinator (RELIABILITY.md rows 16, 19-21).

    python bench/hostile_neighbors.py [--requests 2000] [--json]

A coordinator process (`fleetwire coordinator`, default limits but a 2 s handshake timeout)
on loopback. A legitimate client in this process sends ``list_workers`` requests one at a
time and records each round trip; the figures are its p50/p99 with no neighbour, then next
to each hostile neighbour in turn (the flooding and oversize neighbours are child processes,
so their own CPU does not slow the measuring client):

* ``flood``: a client sending single-message frames as fast as it can (throttled, then 4429,
  then reconnecting);
* ``oversize``: a client sending 10 MiB frames in a loop (each closed 1009, reconnecting);
* ``slowloris``: 500 connections that never finish their handshake (dropped at the handshake
  timeout, set to 2 s here), plus how long a fresh legitimate connect takes meanwhile;
* ``slow consumer``: a subscriber that stops reading while a worker streams 32 KiB events
  (closed 4503); the coordinator's RSS growth is printed, next to the same stream with a
  subscriber that reads (the plan's own event history is held either way).

The matrix asks others' p99 to move by less than 10 % (rows 16, 20), a legit connect under
1 s during slowloris (row 19) and bounded memory for a slow consumer (row 21). Benchmarks
are not tests: this prints, it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

WORKER, CLIENT = "bench-worker-token", "bench-client-token"
ROOT = Path(__file__).resolve().parent.parent


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


async def _drain(ws: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


async def _flood(url: str) -> None:
    """Child process: single-message frames as fast as possible, reconnecting after each close."""
    frame = msgspec.msgpack.encode({"type": "list_workers", "req_id": 2})
    closes: dict[str, int] = {}
    while True:
        ws = await _open(url)
        reader = asyncio.create_task(_drain(ws))
        with contextlib.suppress(ConnectionClosed, AttributeError):
            while True:
                await ws.send(frame)
        with contextlib.suppress(AttributeError):
            await ws.close()
        await reader
        closes[str(ws.close_code)] = closes.get(str(ws.close_code), 0) + 1
        print(json.dumps(closes), flush=True)


async def _oversize(url: str) -> None:
    """Child process: 10 MiB frames, one per connection, reconnecting after each 1009."""
    blob = bytes(10 << 20)
    closes: dict[str, int] = {}
    while True:
        ws = await _open(url)
        with contextlib.suppress(ConnectionClosed, AttributeError):
            await ws.send(blob)
            await ws.recv()
        closes[str(ws.close_code)] = closes.get(str(ws.close_code), 0) + 1
        print(json.dumps(closes), flush=True)


async def _with_child(url: str, name: str, n: int) -> dict[str, Any]:
    child = await asyncio.create_subprocess_exec(sys.executable, __file__, "--neighbour", name, "--url", url,
                                                 stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    await asyncio.sleep(1.0)  # let it get going
    result = _summary(await _latencies(url, n))
    child.send_signal(signal.SIGTERM)
    out = (await child.communicate())[0].decode().strip().splitlines()
    return {"neighbour": name, **result, "its_closes": json.loads(out[-1]) if out else {}}


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


async def _stream(url: str, coordinator: psutil.Process, plan_id: str, *, reads: bool) -> dict[str, Any]:
    """A worker streams 32 KiB events of one plan to a subscriber that reads, or that stops reading."""
    worker = await _open(url, "worker")
    await worker.send(msgspec.msgpack.encode({"type": "hello", "worker_id": f"b-{plan_id}",
                                              "capabilities": {"ops": ["echo"], "max_concurrency": 1}}))
    await worker.recv()
    sub = await _open(url, ping_interval=None)
    await sub.send(msgspec.msgpack.encode({"type": "submit", "req_id": 1, "op": "echo", "plan_id": plan_id}))
    assign = msgspec.msgpack.decode(await worker.recv())
    reader = asyncio.create_task(_drain(sub)) if reads else None
    if not reads:
        sub.transport.pause_reading()
    before = peak = coordinator.memory_info().rss
    event = {"type": "event", "plan_id": plan_id, "attempt": assign["attempt"], "kind": "log", "data": "x" * 32_768}
    for sent in range(0, 20_000, 10):
        await worker.send(msgspec.msgpack.encode([event] * 10))
        if sent % 500 == 0:
            peak = max(peak, coordinator.memory_info().rss)
            await (await worker.ping())
    peak = max(peak, coordinator.memory_info().rss)
    if reader is not None:
        await sub.close()
        await reader
    else:
        sub.transport.abort()
    await worker.close()
    return {"neighbour": "slow consumer" if not reads else "reading subscriber", "events_streamed": 20_000,
            "coordinator_rss_growth_mb": round((peak - before) / 2**20, 1), "closed": sub.close_code}


async def run(requests: int) -> list[dict[str, Any]]:
    env = {**os.environ, "FLEETWIRE_WORKER_TOKEN": WORKER, "FLEETWIRE_CLIENT_TOKEN": CLIENT}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwire", "coordinator", "--port", "0", "--store", "memory",
        "--handshake-timeout", "2", "--log-level", "error", env=env, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await proc.stdout.readline()).decode()
    url = line.split("listening on ", 1)[1].split()[0]
    coordinator = psutil.Process(proc.pid)
    try:
        rows: list[dict[str, Any]] = [{"neighbour": "none", **_summary(await _latencies(url, requests))}]
        rows.append(await _with_child(url, "flood", requests))
        rows.append(await _with_child(url, "oversize", requests))
        rows.append(await _slowloris(url, requests))
        rows.append(await _stream(url, coordinator, "reading", reads=True))
        rows.append(await _stream(url, coordinator, "slow", reads=False))
    finally:
        proc.send_signal(signal.SIGTERM)
        await proc.wait()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="round trips per measurement (default 2000)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--neighbour", choices=("flood", "oversize"), help=argparse.SUPPRESS)  # child processes
    parser.add_argument("--url", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.neighbour is not None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        asyncio.run(_flood(ns.url) if ns.neighbour == "flood" else _oversize(ns.url))
        return 0
    rows = asyncio.run(run(ns.requests))
    if ns.json:
        print(json.dumps(rows))
        return 0
    base = rows[0]["p99_ms"]
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in ("neighbour", "p50_ms", "p99_ms")}
        p99 = row.get("p99_ms")
        timing = ""
        if p99 is not None:
            delta = f" ({(p99 / base - 1) * 100:+.0f}% vs none)" if row is not rows[0] else ""
            timing = f"p50 {row['p50_ms']} ms  p99 {p99} ms{delta}"
        print(f"{row['neighbour']:<20} {timing}  {extra or ''}".rstrip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
