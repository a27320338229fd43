"""The floor: a 3-party relay on raw websockets + msgspec + uvloop, shaped like fleetwire.

Three processes, as in fleetwire: a *client* (this process), a *relay* (the coordinator's
place) and a *worker*. Each item makes six messages, as a fleetwire plan makes at least:

    client → relay   submit        relay → client  accepted
    relay  → worker  assign        worker → relay  done
    relay  → client  result        client → relay  ack (the client's read of the result)

The relay keeps only a dict of items in flight; there is no placement, no plan record, no
event stream. Two framings: ``--per-frame 1`` (one message per websocket frame) and
``--per-frame 64`` (up to 64 queued messages coalesced per frame, as fleetwire does).

    python bench/raw_relay.py throughput --items 20000 --per-frame 1
    python bench/raw_relay.py latency --samples 2000
    python bench/raw_relay.py pingpong --samples 2000   # 2-party RTT, the transport alone

The relay and the worker are this same file run with ``serve-relay`` / ``serve-worker``.
Everything binds and dials 127.0.0.1; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import _harness as h
import msgspec
from websockets.asyncio.client import ClientConnection, connect
from websockets.asyncio.server import ServerConnection, serve


class Msg(msgspec.Struct, omit_defaults=True):
    """One relay message, encoded like a fleetwire message: a map with a string ``type``.

    ``type`` is s (submit), a (accepted), g (assign), d (done), r (result) or k (ack);
    ``plan_id`` is a 16-hex-digit id like a generated fleetwire plan id.
    """

    type: str
    plan_id: str
    data: Any = None


def _pid(item: int) -> str:
    return f"{item:016x}"


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(list[Msg])


class Sender:
    """One connection's writer: queued messages go out ``per_frame`` at a time."""

    def __init__(self, ws: Any, per_frame: int) -> None:
        self.ws = ws
        self.per_frame = per_frame
        self.queue: list[Msg] = []
        self.wake = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    def send(self, msg: Msg) -> None:
        self.queue.append(msg)
        self.wake.set()

    async def _run(self) -> None:
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                while self.queue:
                    batch, self.queue = self.queue[: self.per_frame], self.queue[self.per_frame:]
                    await self.ws.send(ENC.encode(batch))
        except Exception:
            return


async def serve_relay(per_frame: int) -> None:
    """The middle party: routes submits to the worker and results back to the client."""
    worker: Sender | None = None
    client: Sender | None = None
    worker_ready = asyncio.Event()
    in_flight: dict[str, Sender] = {}  # plan id -> the client that submitted it

    async def handler(ws: ServerConnection) -> None:
        nonlocal worker, client
        assert ws.request is not None
        if ws.request.path == "/worker":
            worker = Sender(ws, per_frame)
            worker_ready.set()
            async for frame in ws:
                for m in DEC.decode(frame):
                    owner = in_flight.pop(m.plan_id, None)
                    if owner is not None:
                        owner.send(Msg("r", m.plan_id, m.data))
        else:
            await worker_ready.wait()
            client = Sender(ws, per_frame)
            async for frame in ws:
                for m in DEC.decode(frame):
                    if m.type == "s":
                        in_flight[m.plan_id] = client
                        client.send(Msg("a", m.plan_id))
                        assert worker is not None
                        worker.send(Msg("g", m.plan_id, m.data))

    async with serve(handler, h.HOST, 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"relay listening on {port}", flush=True)
        await asyncio.get_running_loop().create_future()


async def serve_worker(port: int, per_frame: int) -> None:
    """The worker: answers every assign with a done."""
    async with connect(f"ws://{h.HOST}:{port}/worker", compression=None, max_size=None) as ws:
        out = Sender(ws, per_frame)
        print("worker connected", flush=True)
        async for frame in ws:
            for m in DEC.decode(frame):
                out.send(Msg("d", m.plan_id, m.data))


async def serve_echo() -> None:
    """The 2-party reference: echo every frame back."""

    async def handler(ws: ServerConnection) -> None:
        async for frame in ws:
            await ws.send(frame)

    async with serve(handler, h.HOST, 0, compression=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"relay listening on {port}", flush=True)
        await asyncio.get_running_loop().create_future()


# ---------------------------------------------------------------------------- client side


async def _start(per_frame: int, mode: str = "serve-relay") -> tuple[list[h.Proc], int]:
    me = str(h.BENCH / "raw_relay.py")
    relay = await h.spawn("relay", sys.executable, me, mode, "--per-frame", str(per_frame))
    port = int((await relay.wait_for_line(r"listening on (\d+)")).group(1))
    if mode != "serve-relay":
        return [relay], port
    worker = await h.spawn("worker", sys.executable, me, "serve-worker", "--port", str(port),
                           "--per-frame", str(per_frame))
    await worker.wait_for_line("worker connected")
    return [relay, worker], port


async def _results(ws: ClientConnection, out: Sender, want: int, done: dict[str, float]) -> None:
    async for frame in ws:
        for m in DEC.decode(frame):
            if m.type == "r":
                done[m.plan_id] = time.perf_counter()
                out.send(Msg("k", m.plan_id))
                if len(done) >= want:
                    return


async def throughput(items: int, per_frame: int, window: int) -> dict[str, Any]:
    procs, port = await _start(per_frame)
    try:
        pids = {p.name: p.pid for p in procs}
        async with connect(f"ws://{h.HOST}:{port}/client", compression=None, max_size=None) as ws:
            out = Sender(ws, per_frame)
            done: dict[str, float] = {}
            cpu0 = {n: h.cpu_seconds(p) for n, p in pids.items()}
            self0 = time.process_time()
            t0 = time.perf_counter()
            reader = asyncio.create_task(_results(ws, out, items, done))
            sent = 0
            while sent < items:
                # Keep at most ``window`` items in flight, as a client with a queue would.
                while sent < items and sent - len(done) < window:
                    out.send(Msg("s", _pid(sent), sent))
                    sent += 1
                await asyncio.sleep(0)
                if reader.done():
                    break
            await asyncio.wait_for(reader, 120)
            elapsed = time.perf_counter() - t0
            cpu = {n: round(h.cpu_seconds(p) - cpu0[n], 3) for n, p in pids.items()}
            cpu["client"] = round(time.process_time() - self0, 3)
    finally:
        for p in procs:
            await p.stop()
    return {
        "bench": "throughput", "system": "raw_relay", "per_frame": per_frame, "items": items,
        "elapsed_s": round(elapsed, 4), "items_per_s": round(items / elapsed, 1),
        "cpu_us_per_item": {n: round(s / items * 1e6, 1) for n, s in cpu.items()},
    }


async def latency(samples: int, warmup: int) -> dict[str, Any]:
    procs, port = await _start(1)
    try:
        pids = {p.name: p.pid for p in procs}
        async with connect(f"ws://{h.HOST}:{port}/client", compression=None) as ws:
            times = []
            cpu0: dict[str, float] = {}
            for i in range(warmup + samples):
                t0 = time.perf_counter()
                await ws.send(ENC.encode([Msg("s", _pid(i), i)]))
                got_result = False
                while not got_result:
                    for m in DEC.decode(await asyncio.wait_for(ws.recv(), 30)):
                        got_result = got_result or m.type == "r"
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
                elif i == warmup - 1 or not warmup:
                    cpu0 = {n: h.cpu_seconds(p) for n, p in pids.items()}
                await ws.send(ENC.encode([Msg("k", _pid(i))]))
            cpu = {n: round((h.cpu_seconds(p) - cpu0.get(n, 0.0)) / samples * 1e6, 1) for n, p in pids.items()}
    finally:
        for p in procs:
            await p.stop()
    return {"bench": "latency", "system": "raw_relay", "samples": samples, **h.summary_ms(times),
            "cpu_us_per_item": cpu}


async def pingpong(samples: int, warmup: int) -> dict[str, Any]:
    procs, port = await _start(1, mode="serve-echo")
    try:
        async with connect(f"ws://{h.HOST}:{port}/", compression=None) as ws:
            times = []
            payload = ENC.encode([Msg("s", _pid(0), 0)])
            for i in range(warmup + samples):
                t0 = time.perf_counter()
                await ws.send(payload)
                await asyncio.wait_for(ws.recv(), 30)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
    finally:
        for p in procs:
            await p.stop()
    return {"bench": "pingpong", "system": "raw_websockets", "samples": samples, **h.summary_ms(times)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("throughput", "latency", "pingpong", "serve-relay", "serve-worker",
                                         "serve-echo"))
    parser.add_argument("--items", type=int, default=20_000, help="items for throughput (default 20000)")
    parser.add_argument("--per-frame", type=int, default=1, help="messages per frame (default 1)")
    parser.add_argument("--window", type=int, default=2000, help="items in flight at most (default 2000)")
    parser.add_argument("--samples", type=int, default=2000, help="latency samples (default 2000)")
    parser.add_argument("--warmup", type=int, default=200, help="untimed samples first (default 200)")
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    if ns.mode == "serve-relay":
        h.run_loop(serve_relay(ns.per_frame))
        return 0
    if ns.mode == "serve-worker":
        h.run_loop(serve_worker(ns.port, ns.per_frame))
        return 0
    if ns.mode == "serve-echo":
        h.run_loop(serve_echo())
        return 0
    if ns.mode == "throughput":
        result = h.run_loop(throughput(ns.items, ns.per_frame, ns.window))
        text = (f"raw relay throughput, {ns.per_frame} msg/frame: {result['items_per_s']:,.0f} items/s "
                f"(CPU µs per item {result['cpu_us_per_item']})")
    elif ns.mode == "latency":
        result = h.run_loop(latency(ns.samples, ns.warmup))
        text = (f"raw relay latency: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms "
                f"(CPU µs per item {result['cpu_us_per_item']})")
    else:
        result = h.run_loop(pingpong(ns.samples, ns.warmup))
        text = f"raw websockets ping-pong RTT: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms"
    print(json.dumps(result) if ns.json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
