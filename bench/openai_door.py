"""The OpenAI front door (issue #30, docs/OPENAI.md): what it adds over calling an engine directly.

Four measurements, each printed beside its peer measured in the same run:

1. **Time to first byte.** One coordinator process and one ``fleetwire worker --inference-url``
   fronting the example's fake vLLM engine (``examples/inference_fleet/fake_engine.py``, no token
   delay), all on 127.0.0.1. Sequential streamed chat requests, by a raw HTTP client and by the
   official ``openai`` package, through the door and straight to the engine: the time from the
   request's first byte to the first text chunk. The door's overhead is the difference of the p50s
   (the path through the door adds the coordinator, a websocket hop each way and the worker agent).
2. **Streamed requests per second.** The coordinator alone is measured: its workers are
   in-bench raw websocket workers (``--fast-worker``, one process) that answer each ``generate``
   with one token and ``done`` at once, a fake engine with no cost; the load is C keep-alive
   connections of raw HTTP streamed chat requests for D seconds (and, beside it, the official
   ``openai`` client's ``AsyncOpenAI`` at lower concurrency). Figures: requests/s, the
   coordinator's CPU seconds per request, time to the first chunk under load.
3. **Memory per open stream.** S streams held open (the fast workers send one token and hold the
   plan until it is cancelled): the coordinator's RSS with them open minus before, divided by S.
4. **Prefix hit rate of multi-turn chats**, kv_aware on the door's own hints vs round robin: the
   real core in this process (no sockets), W workers with a KV budget, K four-turn conversations
   interleaved; a turn hits when it is placed on the worker that served the conversation's
   previous turn (the one holding its prefix).

    python bench/openai_door.py                  # all four, default sizes
    python bench/openai_door.py --quick --json   # the smoke size

The goals of issue #30 are printed beside the figures (<= 1 ms p50 added, >= 5,000 streamed
requests/s on 2 cores with tiny responses): on a shared 2-core machine the load generator, the
workers and the coordinator share those cores, so the requests/s is a floor for the coordinator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from typing import Any

import _harness as h
import msgspec

HTTP_OK = b"HTTP/1.1 200"
TEXT = re.compile(rb'"content": ?"[^"]')  # a chunk with text (the door's JSON has no spaces, the engine's has)
MODEL = "m1"


# ---------------------------------------------------------------------------------------------- raw HTTP


def chat_request(port: int, text: str, *, stream: bool = True, keep_alive: bool = True) -> bytes:
    body = json.dumps({"model": MODEL, "stream": stream, "messages": [{"role": "user", "content": text}]}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer bench\r\nContent-Length: {len(body)}\r\n"
            f"{'' if keep_alive else 'Connection: close' + chr(13) + chr(10)}\r\n").encode() + body


async def read_stream(reader: asyncio.StreamReader, started: float) -> float:
    """Read one streamed answer (chunked, through ``data: [DONE]``); returns the time to its first text chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(HTTP_OK):
        length = re.search(rb"Content-Length: (\d+)", head)
        body = await reader.readexactly(int(length.group(1))) if length else b""
        raise RuntimeError(f"not 200: {head[:40]!r} {body[:300]!r}")
    first = 0.0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.strip(), 16)
        if size == 0:
            await reader.readexactly(2)
            return first
        chunk = await reader.readexactly(size + 2)
        if not first and TEXT.search(chunk):
            first = time.perf_counter() - started


async def raw_ttfb(port: int, requests: int) -> list[float]:
    """Sequential streamed requests on one kept-alive connection: time to the first text chunk of each."""
    reader, writer = await asyncio.open_connection(h.HOST, port)
    samples = []
    try:
        for i in range(requests):
            started = time.perf_counter()
            writer.write(chat_request(port, f"hello number {i}"))
            samples.append(await read_stream(reader, started))
    finally:
        writer.close()
    return samples


async def sdk_ttfb(url: str, requests: int) -> list[float]:
    """The fleet's own path without the door: the SDK submits the same generate plan; time to its first token."""
    from fleetwire import Client

    samples = []
    async with Client(url) as client:
        for i in range(requests):
            started = time.perf_counter()
            plan = await client.submit("generate", {"messages": [{"role": "user", "content": f"hello number {i}"}],
                                                    "model": MODEL})  # fmt: skip
            first = 0.0
            async for event in plan.events():
                if not first and event.kind == "token":
                    first = time.perf_counter() - started
            samples.append(first)
    return samples


async def openai_ttfb(base_url: str, requests: int) -> list[float]:
    """The official client: time from ``create(stream=True)`` to its first chunk with text."""
    import httpx
    import openai

    samples = []
    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False)) as client:  # fmt: skip
        for i in range(requests):
            started = time.perf_counter()
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello number {i}"}], stream=True)
            first = 0.0
            async for chunk in stream:
                if not first and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            samples.append(first)
    return samples


# ---------------------------------------------------------------------------------------------- fast workers


async def fast_workers(url: str, count: int, hold: bool) -> None:
    """``count`` raw websocket workers: each generate gets one token and done at once (or is held, ``hold``)."""
    import websockets

    from protocol import Codec
    from protocol.messages import (
        Accept,
        Assign,
        Cancel,
        Capabilities,
        Done,
        Event,
        Heartbeat,
        Hello,
        Load,
        ToWorker,
        Welcome,
    )

    codec = Codec("msgpack", ToWorker, "coordinator")
    result = {"text": "hi", "finish_reason": "stop", "model": MODEL,
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip

    async def one(index: int) -> None:
        async with websockets.connect(f"{url}/v1/worker", subprotocols=["fleetwire.v1.msgpack"],  # type: ignore[list-item]
                                      max_size=None, compression=None) as ws:  # fmt: skip
            caps = Capabilities(ops=["generate"], models=[MODEL], max_concurrency=100_000, cpu_cores=1)
            await ws.send(codec.encode([Hello(worker_id=f"fast-{index}", capabilities=caps)]))

            async def beat() -> None:
                while True:
                    await asyncio.sleep(3)
                    await ws.send(codec.encode([Heartbeat(load=Load())]))

            beating = asyncio.create_task(beat())
            try:
                async for frame in ws:
                    out: list[Any] = []
                    for msg in codec.decode(frame):
                        if isinstance(msg, Assign):
                            out.append(Accept(plan_id=msg.plan_id, attempt=msg.attempt))
                            out.append(Event(plan_id=msg.plan_id, kind="token", data={"text": "hi"},
                                             attempt=msg.attempt, ephemeral=True))  # fmt: skip
                            if not hold:
                                out.append(Done(plan_id=msg.plan_id, attempt=msg.attempt, outcome="succeeded",
                                                result=result))  # fmt: skip
                        elif isinstance(msg, Cancel):
                            out.append(Done(plan_id=msg.plan_id, attempt=msg.attempt, outcome="cancelled"))
                        elif isinstance(msg, Welcome):
                            print(f"fast worker {index} registered", flush=True)
                    if out:
                        await ws.send(codec.encode(out))
            finally:
                beating.cancel()

    await asyncio.gather(*(one(i) for i in range(count)))


# ---------------------------------------------------------------------------------------------- load


async def raw_load(port: int, connections: int, seconds: float) -> dict[str, Any]:
    """``connections`` kept-alive connections, each sending streamed requests back to back for ``seconds``."""
    done = 0
    firsts: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def one(index: int) -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection(h.HOST, port)
        request = chat_request(port, f"tiny {index}")
        try:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                writer.write(request)
                try:
                    firsts.append(await read_stream(reader, started))
                    done += 1
                except (RuntimeError, asyncio.IncompleteReadError):
                    errors += 1
                    return
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(connections)))
    elapsed = time.perf_counter() - started
    return {"requests": done, "errors": errors, "seconds": round(elapsed, 3),
            "requests_per_s": round(done / elapsed, 1), "first_chunk": h.summary_ms(firsts)}  # fmt: skip


async def openai_load(base_url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    import httpx
    import openai

    done = 0
    deadline = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0,
                                  http_client=httpx.AsyncClient(trust_env=False, limits=limits)) as client:  # fmt: skip
        async def one() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "tiny"}], stream=True)
                async for _ in stream:
                    pass
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"requests": done, "requests_per_s": round(done / elapsed, 1)}


async def open_streams(port: int, count: int) -> list[asyncio.StreamWriter]:
    """``count`` streamed requests left open after their first chunk (the fast workers hold their plans)."""
    writers = []
    for i in range(count):
        reader, writer = await asyncio.open_connection(h.HOST, port)
        writer.write(chat_request(port, f"held {i}"))
        await reader.readuntil(b"\r\n\r\n")
        writers.append(writer)
    return writers


# ---------------------------------------------------------------------------------------------- prefix hits


def prefix_hit_rate(policy: str, workers: int, conversations: int, turns: int = 4) -> dict[str, Any]:
    """Turns placed on the worker that served their conversation's previous turn, through the real core."""
    from coordinator.core import Coordinator, CoreConfig
    from coordinator.openai_api import parse_request
    from coordinator.placement.placer import PlacementConfig
    from protocol.messages import Accept, Assign, Capabilities, Done, Hello

    core = Coordinator(CoreConfig(placement=PlacementConfig(policy=policy)), new_id=iter(range(10**9)).__next__)
    for w in range(workers):
        core.open_session(w + 1, "worker", 0.0, principal="worker")
        caps = Capabilities(ops=["generate"], models=[MODEL], max_concurrency=64, kv_blocks=4096, kv_block_tokens=16)
        core.receive(w + 1, Hello(worker_id=f"w{w}", capabilities=caps), 0.0)
    client = 1000
    core.open_session(client, "client", 0.0, principal="alice")
    core.take_effects()
    history: list[list[dict[str, str]]] = [
        [{"role": "system", "content": f"conversation {c}: you are a terse assistant. " * 6}]
        for c in range(conversations)
    ]
    last: dict[int, str] = {}
    hits = turns_counted = 0
    req = 0
    now = 1.0
    for turn in range(turns):
        for c in range(conversations):
            history[c].append({"role": "user", "content": f"turn {turn} of {c}: please reverse these words. " * 4})
            body = msgspec.json.encode({"model": MODEL, "messages": history[c], "max_tokens": 32})
            req += 1
            core.receive(client, parse_request("chat", body).submit(req), now)
            effects = core.take_effects()
            for conn_id, msgs in effects.sends.items():
                for msg in msgs:
                    if isinstance(msg, Assign):
                        worker = f"w{conn_id - 1}"
                        if turn > 0:
                            turns_counted += 1
                            hits += last.get(c) == worker
                        last[c] = worker
                        core.receive(conn_id, Accept(plan_id=msg.plan_id, attempt=msg.attempt), now)
                        core.receive(conn_id, Done(plan_id=msg.plan_id, attempt=msg.attempt, outcome="succeeded",
                                                   result={"text": "ok"}), now)  # fmt: skip
            core.take_effects()
            history[c].append({"role": "assistant", "content": f"answer {turn} of {c}, reversed words. " * 4})
            now += 0.001
    return {"policy": policy, "turns_after_the_first": turns_counted, "hits": hits,
            "hit_rate": round(hits / max(1, turns_counted), 3)}  # fmt: skip


# ---------------------------------------------------------------------------------------------- main


async def measure(ns: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": h.machine()}
    requests = 40 if ns.quick else ns.requests
    # 1. time to first byte: door vs engine directly
    async with h.fleet("memory") as f:
        fake = h.ROOT / "examples" / "inference_fleet" / "fake_engine.py"
        engine = await h.spawn("engine", sys.executable, str(fake), "--port", "0", "--name", "e0", "--model", MODEL,
                               "--token-delay", "0")  # fmt: skip
        f.others.append(engine)
        engine_url = (await engine.wait_for_line(r"listening on (http://\S+)")).group(1)
        engine_port = int(engine_url.rsplit(":", 1)[1])
        await f.start_coordinator()
        await f.start_worker("w0", "--inference-url", engine_url)
        await f.wait_workers()
        await asyncio.sleep(0.5)  # the worker's capabilities (its engine's models) are in its hello already
        await raw_ttfb(f.port, 10)  # warm-up: imports, connections
        await raw_ttfb(engine_port, 10)
        door, direct = await raw_ttfb(f.port, requests), await raw_ttfb(engine_port, requests)
        await sdk_ttfb(f.url, 5)
        sdk = await sdk_ttfb(f.url, requests)
        od, oe = (await openai_ttfb(f"http://{h.HOST}:{f.port}/v1", requests),
                  await openai_ttfb(f"{engine_url}/v1", requests))  # fmt: skip
        result["ttfb"] = {
            "raw": {"door": h.summary_ms(door), "engine": h.summary_ms(direct),
                    "added_p50_ms": round((h.percentile(door, 50) - h.percentile(direct, 50)) * 1e3, 3)},
            "sdk": {"fleet": h.summary_ms(sdk),
                    "door_over_sdk_p50_ms": round((h.percentile(door, 50) - h.percentile(sdk, 50)) * 1e3, 3)},
            "openai": {"door": h.summary_ms(od), "engine": h.summary_ms(oe),
                       "added_p50_ms": round((h.percentile(od, 50) - h.percentile(oe, 50)) * 1e3, 3)},
            "requests": requests,
        }  # fmt: skip
    # 2 and 3. requests/s and memory, the coordinator alone
    for hold in (False, True):
        async with h.fleet("memory") as f:
            await f.start_coordinator("--openai-queue-timeout", "60")
            workers = await h.spawn("fast-workers", sys.executable, __file__, "--fast-worker", f.url,
                                    "--fast-count", str(ns.fast_workers), *(["--hold"] if hold else []))  # fmt: skip
            f.others.append(workers)
            for _ in range(ns.fast_workers):
                await workers.wait_for_line(r"fast worker \d+ registered")
            assert f.coordinator is not None
            pid = f.coordinator.pid
            if not hold:
                seconds = 3.0 if ns.quick else ns.seconds
                await raw_load(f.port, 4, 1.0)  # warm-up
                cpu0 = h.cpu_seconds(pid)
                load = await raw_load(f.port, ns.connections, seconds)
                load["coordinator_cpu_ms_per_request"] = round(
                    (h.cpu_seconds(pid) - cpu0) * 1e3 / max(1, load["requests"]), 3)
                load["connections"] = ns.connections
                result["raw_load"] = load
                result["openai_load"] = {**await openai_load(f"http://{h.HOST}:{f.port}/v1", ns.openai_concurrency,
                                                             seconds), "concurrency": ns.openai_concurrency}
            else:
                streams = 200 if ns.quick else ns.streams
                await open_streams(f.port, 20)  # warm-up: a first allocation of everything a stream uses
                before = h.rss_bytes(pid)
                held = await open_streams(f.port, streams)
                await asyncio.sleep(0.5)
                after = h.rss_bytes(pid)
                result["memory"] = {"streams": streams, "rss_before_mib": round(before / 2**20, 1),
                                    "rss_after_mib": round(after / 2**20, 1),
                                    "kib_per_open_stream": round((after - before) / streams / 1024, 1)}  # fmt: skip
                for writer in held:
                    writer.close()
    # 4. prefix hit rate
    conversations = 41 if ns.quick else 201  # not a multiple of the workers: round robin's turns do not line up
    result["prefix"] = [prefix_hit_rate(policy, 8, conversations) for policy in ("kv_aware", "round_robin")]
    return result


def lines(r: dict[str, Any]) -> list[str]:
    t, raw, oa, mem = r["ttfb"], r["raw_load"], r["openai_load"], r["memory"]
    out = [
        f"OpenAI front door — {r['machine'].get('cpus')} CPUs, {r['machine'].get('cpu', '?')}",
        f"time to first text chunk, {t['requests']} sequential streamed requests (p50 / p99 ms):",
        f"  raw HTTP   door {t['raw']['door']['p50_ms']} / {t['raw']['door']['p99_ms']}   "
        f"engine directly {t['raw']['engine']['p50_ms']} / {t['raw']['engine']['p99_ms']}   "
        f"added p50 {t['raw']['added_p50_ms']} ms (goal <= 1 ms)",
        f"  the fleet without the door (SDK submit of the same generate plan) {t['sdk']['fleet']['p50_ms']} / "
        f"{t['sdk']['fleet']['p99_ms']}: the door's own share of the p50 {t['sdk']['door_over_sdk_p50_ms']} ms",
        f"  openai pkg door {t['openai']['door']['p50_ms']} / {t['openai']['door']['p99_ms']}   "
        f"engine directly {t['openai']['engine']['p50_ms']} / {t['openai']['engine']['p99_ms']}   "
        f"added p50 {t['openai']['added_p50_ms']} ms",
        f"streamed requests/s through one coordinator (tiny answers, fast workers): raw HTTP x{raw['connections']} "
        f"{raw['requests_per_s']}/s (goal >= 5,000), coordinator {raw['coordinator_cpu_ms_per_request']} ms CPU per "
        f"request, first chunk under load p50 {raw['first_chunk']['p50_ms']} ms; openai pkg x{oa['concurrency']} "
        f"{oa['requests_per_s']}/s; errors {raw['errors']}",
        f"memory: {mem['streams']} open streams {mem['rss_before_mib']} -> {mem['rss_after_mib']} MiB = "
        f"{mem['kib_per_open_stream']} KiB per open stream",
        "prefix hit rate of four-turn chats (turns placed where their previous turn went): "
        + ", ".join(f"{p['policy']} {p['hit_rate']:.0%} ({p['hits']}/{p['turns_after_the_first']})"
                    for p in r["prefix"]),
    ]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="the smoke size")
    parser.add_argument("--requests", type=int, default=300, help="sequential requests per TTFB sample")
    parser.add_argument("--connections", type=int, default=64, help="raw HTTP connections of the load")
    parser.add_argument("--openai-concurrency", type=int, default=16, help="concurrent openai-package streams")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each load")
    parser.add_argument("--streams", type=int, default=2000, help="open streams for the memory figure")
    parser.add_argument("--fast-workers", type=int, default=2, help="raw websocket workers of the load")
    parser.add_argument("--fast-worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--fast-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.fast_worker:
        h.run_loop(fast_workers(ns.fast_worker, ns.fast_count, ns.hold))
        return 0
    result = h.run_loop(measure(ns))
    h.emit(result, ns.json, lines(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
