"""The OpenAI front door (issue #30, docs/OPENAI.md): what it adds over calling an engine directly.

Five measurements, each printed beside its peer measured in the same run:

1. **Time to first byte.** One coordinator process and one ``fleetwire worker --inference-url``
   fronting the example's fake vLLM engine (``examples/inference_fleet/fake_engine.py``, no token
   delay), all on 127.0.0.1. Sequential streamed chat requests, by a raw HTTP client and by the
   official ``openai`` package (async and sync), through the door and straight to the engine: the
   time from the request's first byte to the first text chunk. The door's overhead is the
   difference of the p50s (the path through the door adds the coordinator, a websocket hop each
   way and the worker agent); the CPU each process spent per request through the door is printed
   beside. Then the same requests for a model only a raw websocket worker serves: the
   coordinator's own share (no worker agent, no engine), on the in-memory store and on the default
   durable one (SQLite: a plan is committed, fsync included, before it is placed); and the SDK's
   submit of the same plan to the same worker: the fleet's path without the door. The TTFB figures
   other than (1)'s SQLite ones (durable, and ``--openai-durable off``) use ``--store memory``:
   what the door adds, not what the disk does.
2. **Streamed requests per second.** The coordinator alone is measured: its workers are
   in-bench raw websocket workers (``--fast-worker``, one process) that answer each ``generate``
   with one token and ``done`` at once, a fake engine with no cost; the load is C keep-alive
   connections of streamed chat requests for D seconds, made by ``wrk`` (C, with a Lua script
   POSTing the request) when it is installed, else by this process's asyncio generator. With 2+
   CPUs and ``taskset``, the coordinator is pinned to CPU 0 and the generator and the fast workers
   to CPU 1. The figures that hold on a shared machine are CPU per request, per process
   (coordinator, generator, fast workers): the coordinator is one thread, so it serves at most
   1 / its CPU per request; two cores carrying the generator too serve at most 2 / everyone's.
   The lower of the two is the goal's figure (``two_core_requests_per_s``); the wall-clock rate
   beside it is what the cores left by the machine's other tenants gave. Beside it, the official
   ``openai`` client at lower concurrency (``AsyncOpenAI``, and ``OpenAI`` in threads).
3. **Memory per open stream.** S streams held open (the fast workers send one token and hold the
   plan until it is cancelled): the coordinator's RSS with them open minus before, divided by S.
4. **Prefix hit rate of multi-turn chats**, kv_aware on the door's own hints vs round robin: the
   real core in this process (no sockets), W workers with a KV budget, K four-turn conversations
   interleaved; a turn hits when it is placed on the worker that served the conversation's
   previous turn (the one holding its prefix).
5. **Where a request's CPU goes** (:func:`door_steps`): the door's pure steps and the core's share
   of the plan, timed in this process by CPU time (best of rounds); the rest of (2)'s coordinator
   CPU per request is I/O.
6. **Where the first byte's time goes** (``--timeline``, :func:`timeline`): the coordinator, a
   worker agent and the fake engine in one process, the steps of each request marked; each
   step's median time since the one before.
7. **Instructions per request** (``--only callgrind``, :func:`callgrind`): the coordinator under
   callgrind serving a fixed count of (2)'s tiny streamed requests, twice; the stable figure of
   its CPU per request on a shared machine.

    python bench/openai_door.py                  # one to five, default sizes
    python bench/openai_door.py --quick --json   # a short run
    python bench/openai_door.py --generator python   # the load from this process (no wrk)
    python bench/openai_door.py --timeline-only --requests 300   # only six
    python bench/openai_door.py --only load --seconds 5 --profile /tmp/prof   # only (2)'s raw load, profiled

The goals of issue #30 are printed beside the figures (<= 1 ms p50 added, >= 5,000 streamed
requests/s on 2 cores with tiny responses).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Final

import _harness as h
import msgspec

HTTP_OK = b"HTTP/1.1 200"
TEXT = re.compile(rb'"content": ?"[^"]')  # a chunk with text (the door's JSON has no spaces, the engine's has)
MODEL = "m1"
SECTIONS: Final = ("ttfb", "load", "clients", "memory", "prefix", "steps", "timeline", "callgrind")  # --only's


# ---------------------------------------------------------------------------------------------- raw HTTP


FAST_MODEL = "fast"  # served by the raw websocket workers only


def chat_body(text: str, *, model: str = MODEL, stream: bool = True) -> str:
    return json.dumps({"model": model, "stream": stream, "messages": [{"role": "user", "content": text}]})


def chat_request(port: int, text: str, *, stream: bool = True, keep_alive: bool = True, model: str = MODEL) -> bytes:
    body = chat_body(text, model=model, stream=stream).encode()
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


async def raw_ttfb(port: int, requests: int, model: str = MODEL) -> list[float]:
    """Sequential streamed requests on one kept-alive connection: time to the first text chunk of each."""
    reader, writer = await asyncio.open_connection(h.HOST, port)
    samples = []
    try:
        for i in range(requests):
            started = time.perf_counter()
            writer.write(chat_request(port, f"hello number {i}", model=model))
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
                                                    "model": MODEL}, requirements={"model": MODEL})  # fmt: skip
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


def sync_openai_ttfb(base_url: str, requests: int) -> list[float]:
    """The official sync client (``OpenAI``), in a thread: time from ``create(stream=True)`` to its first text."""
    import httpx
    import openai

    samples = []
    with openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0,
                       http_client=httpx.Client(trust_env=False)) as client:  # fmt: skip
        for i in range(requests):
            started = time.perf_counter()
            stream = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"hello number {i}"}], stream=True)
            first = 0.0
            for chunk in stream:
                if not first and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - started
            samples.append(first)
    return samples


# ---------------------------------------------------------------------------------------------- fast workers


async def fast_workers(url: str, count: int, hold: bool, model: str = MODEL) -> None:
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
    result = {"text": "hi", "finish_reason": "stop", "model": model,
              "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}  # fmt: skip

    async def one(index: int) -> None:
        async with websockets.connect(f"{url}/v1/worker", subprotocols=["fleetwire.v1.msgpack"],  # type: ignore[list-item]
                                      max_size=None, compression=None) as ws:  # fmt: skip
            caps = Capabilities(ops=["generate"], models=[model], max_concurrency=100_000, cpu_cores=1)
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


async def raw_load(port: int, connections: int, seconds: float, model: str = MODEL) -> dict[str, Any]:
    """``connections`` kept-alive connections, each sending streamed requests back to back for ``seconds``."""
    done = 0
    firsts: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def one(index: int) -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection(h.HOST, port)
        request = chat_request(port, f"tiny {index}", model=model)
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


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer bench"
"""


def wrk_load(port: int, connections: int, seconds: float, model: str, cpus: str | None) -> dict[str, Any]:
    """``wrk`` (one thread, ``connections`` kept-alive connections) POSTing streamed chats for ``seconds``."""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT % json.dumps(chat_body("tiny", model=model)))
    try:
        command = ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", script.name,
                   f"http://{h.HOST}:{port}/v1/chat/completions"]  # fmt: skip
        if cpus is not None:
            command = ["taskset", "-c", cpus, *command]
        started = time.perf_counter()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        usage = os.wait4(proc.pid, 0)[2]  # the generator's own CPU
        out = proc.stdout.read() if proc.stdout is not None else ""
        elapsed = time.perf_counter() - started
    finally:
        os.unlink(script.name)
    requests = int(m.group(1)) if (m := re.search(r"(\d+) requests in", out)) else 0
    bad = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses: (\d+)", out))
    bad += sum(int(n) for n in re.findall(r"(?:connect|read|write|timeout) (\d+)", out))
    latency = {q: v for q, v in re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.MULTILINE)}
    generator_cpu_s = round(usage.ru_utime + usage.ru_stime, 3)
    return {"generator": "wrk", "requests": requests, "errors": bad, "seconds": round(elapsed, 3),
            "requests_per_s": round(requests / elapsed, 1), "generator_cpu_s": generator_cpu_s,
            "latency_p50": latency.get("50", "?"), "latency_p99": latency.get("99", "?"),
            "raw": out if requests == 0 else ""}  # fmt: skip


def pin(pid: int, cpus: str) -> bool:
    """Every thread of ``pid`` on ``cpus`` (``taskset -a``); False where that is not possible."""
    if not shutil.which("taskset"):
        return False
    return subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(pid)], capture_output=True).returncode == 0


def cpu_figures(result: dict[str, Any], coordinator_s: float, workers_s: float) -> dict[str, float]:
    """CPU µs per request of each process of the load, and the rate two cores would serve by them.

    The figures do not depend on the other tenants of a shared machine (the wall-clock rate does): the
    coordinator is one thread, so it serves at most 1 / its CPU per request; with the generator and the
    fast workers beside it, two cores serve at most 2 / the sum of everyone's. The lower of the two is
    the rate of a 2-core machine with the load generator on it, as the issue's goal counts it.
    """
    requests = max(1, result["requests"])
    coordinator_us = coordinator_s * 1e6 / requests
    others_us = (result["generator_cpu_s"] + workers_s) * 1e6 / requests
    two_cores = min(1e6 / coordinator_us, 2e6 / (coordinator_us + others_us)) if coordinator_us else 0.0
    return {"coordinator_cpu_ms_per_request": round(coordinator_us / 1e3, 4),
            "coordinator_us_per_request": round(coordinator_us, 1),
            "generator_us_per_request": round(result["generator_cpu_s"] * 1e6 / requests, 1),
            "workers_us_per_request": round(workers_s * 1e6 / requests, 1),
            "requests_per_s_per_coordinator_core": round(1e6 / coordinator_us, 1) if coordinator_us else 0.0,
            "two_core_requests_per_s": round(two_cores, 1)}  # fmt: skip


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


def sync_openai_load(base_url: str, threads: int, seconds: float) -> dict[str, Any]:
    """The official sync client: ``threads`` threads, each its own ``OpenAI`` client, streaming back to back."""
    import httpx
    import openai

    done = [0] * threads
    deadline = time.perf_counter() + seconds

    def one(index: int) -> None:
        with openai.OpenAI(base_url=base_url, api_key="bench", max_retries=0,
                           http_client=httpx.Client(trust_env=False)) as client:  # fmt: skip
            while time.perf_counter() < deadline:
                for _ in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tiny"}],
                                                        stream=True):  # fmt: skip
                    pass
                done[index] += 1

    started = time.perf_counter()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    return {"requests": sum(done), "requests_per_s": round(sum(done) / elapsed, 1), "threads": threads}


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

    core = Coordinator(CoreConfig(placement=PlacementConfig(policy=policy)), new_id=map(str, range(10**9)).__next__)
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


# ---------------------------------------------------------------------------------------------- steps


def door_steps(requests: int, rounds: int) -> dict[str, Any]:
    """5. The coordinator's work for one tiny streamed request, step by step, in this process (no sockets).

    The door's own steps (coordinator/openai_api/: the head and body cut from the bytes, the body checked
    and its hints computed, the answer made from the plan's events) and the core's share of the plan
    (the core driven directly as the door drives it: a session opened, the submit, the worker's accept,
    one token and done, the session closed). Each figure is the best of ``rounds`` runs of ``requests``.
    The rest of the coordinator's CPU per request under load (2) is its I/O: the HTTP connection's and the
    worker's websocket reads and writes, the event loop, the driver's commit and delivery.
    """
    from coordinator.core import Coordinator, CoreConfig
    from coordinator.openai_api import Reply, RequestReader, parse_request
    from protocol.messages import Accept, Assign, Capabilities, Done, Event, Hello
    from protocol.prompts import PrefixMemo

    wire = chat_request(8000, "tiny")
    body = wire.split(b"\r\n\r\n", 1)[1]
    reader = RequestReader()
    parsed = parse_request("chat", body)
    events = [("leased", {"worker_id": "w0", "attempt": 1}), ("running", {"worker_id": "w0", "attempt": 1}),
              ("token", {"text": "hi"}),
              ("succeeded", {"result": {"text": "hi", "finish_reason": "stop",
                                        "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
                             "worker_id": "w0", "attempt": 1})]  # fmt: skip

    def intake() -> None:
        reader.feed(wire)

    def checks() -> None:
        parse_request("chat", body)

    long_chat = msgspec.json.encode({"model": MODEL, "stream": True, "messages": [
        {"role": "system", "content": "You answer briefly. " * 40},
        *({"role": role, "content": f"turn {n}: " + "some words of a conversation " * 50}
          for n in range(5) for role in ("user", "assistant"))]})  # fmt: skip

    def checks_long() -> None:
        parse_request("chat", long_chat)

    memo = PrefixMemo()  # the door's (frontdoor/openai_http.py): a chat's earlier turns' blocks are remembered

    def checks_long_remembered() -> None:
        parse_request("chat", long_chat, hasher=memo.hashes)

    def reply() -> None:
        answer = Reply(parsed, created=1, now=0.0, queue_timeout_s=30.0)
        answer.accepted("oai-0123456789ab1")
        for kind, data in events:
            answer.event(kind, data, 0.0)

    core = Coordinator(CoreConfig(), new_id=map(str, range(10**12)).__next__)
    core.open_session(1, "worker", 0.0, principal="worker")
    caps = Capabilities(ops=["generate"], models=[MODEL], max_concurrency=100_000, cpu_cores=1)
    core.receive(1, Hello(worker_id="w0", capabilities=caps), 0.0)
    core.take_effects()
    ids = iter(range(2, 10**12))

    def core_plan() -> None:
        conn = next(ids)
        core.open_session(conn, "client", 0.0, principal="client")
        submit = parsed.submit(1)
        submit.plan_id = f"oai-0123456789ab{conn:x}"
        core.receive(conn, submit, 0.0)
        for msg in core.take_effects().sends.get(1, ()):
            if type(msg) is Assign:
                core.receive(1, Accept(plan_id=msg.plan_id, attempt=msg.attempt), 0.0)
                core.receive(1, Event(plan_id=msg.plan_id, kind="token", data={"text": "hi"}, attempt=msg.attempt,
                                      ephemeral=True), 0.0)  # fmt: skip
                core.receive(1, Done(plan_id=msg.plan_id, attempt=msg.attempt, outcome="succeeded",
                                     result={"text": "hi", "finish_reason": "stop"}), 0.0)  # fmt: skip
        core.take_effects()
        core.close_session(conn, 0.0)
        core.take_effects()

    def best_us(step: Any) -> float:
        step()
        best = float("inf")
        for _ in range(rounds):  # CPU time: on a shared machine, wall time counts the other tenants' turns
            started = time.process_time()
            for _ in range(requests):
                step()
            best = min(best, time.process_time() - started)
        return round(best / requests * 1e6, 2)

    figures = {"intake_us": best_us(intake), "checks_us": best_us(checks), "reply_us": best_us(reply),
               "long_chat_tokens": parse_request("chat", long_chat).hints.prompt_tokens,
               "long_chat_checks_us": best_us(checks_long),
               "long_chat_remembered_checks_us": best_us(checks_long_remembered)}
    figures["door_us"] = round(figures["intake_us"] + figures["checks_us"] + figures["reply_us"], 2)
    figures["core_us"] = best_us(core_plan)
    return {**figures, "requests": requests, "rounds": rounds}


# ---------------------------------------------------------------------------------------------- callgrind


async def counted_load(port: int, connections: int, total: int) -> None:
    """``total`` streamed requests over ``connections`` kept-alive connections, back to back (a fixed count)."""
    left = total

    async def one(index: int) -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection(h.HOST, port)
        request = chat_request(port, f"tiny {index}")
        try:
            while left > 0:
                left -= 1
                writer.write(request)
                await read_stream(reader, time.perf_counter())
        finally:
            writer.close()

    await asyncio.gather(*(one(i) for i in range(connections)))


async def callgrind_run(ns: argparse.Namespace, requests: int, out: str) -> int:
    """The coordinator's callgrind instructions over its whole life, serving ``requests`` tiny streamed requests
    (after 20 of warm-up) from one fast worker over ``ns.cg_connections`` connections."""
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m", "fleetwire",
            "coordinator", "--host", h.HOST, "--port", "0", "--insecure", "--log-level", "warning", "--store",
            "memory", "--openai-queue-timeout", "120", *(f for pair in h.BENCH_LIMITS.items() for f in pair),
            *shlex.split(ns.coordinator_args)]  # fmt: skip
    coordinator = await h.spawn("coordinator", *argv, env=h.bench_env(PYTHONHASHSEED="0"))
    workers = None
    try:
        url = (await coordinator.wait_for_line(r"listening on (ws://\S+)", 600)).group(1)
        port = int(url.rsplit(":", 1)[1])
        workers = await h.spawn("fast-workers", sys.executable, __file__, "--fast-worker", url, "--fast-count", "1")
        await workers.wait_for_line(r"fast worker \d+ registered", 600)
        await counted_load(port, 4, 20)
        await counted_load(port, ns.cg_connections, requests)
    finally:
        if workers is not None:
            await workers.stop()
        await coordinator.stop(grace_s=600)
    return _callgrind_total(out)


def _callgrind_total(out: str) -> int:
    with open(out) as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("summary:"))


async def callgrind(ns: argparse.Namespace) -> dict[str, Any]:
    """7. The coordinator's callgrind instructions per tiny streamed request (``--only callgrind``): two runs of
    ``cg_requests / 5`` and ``cg_requests`` requests, the difference over the difference of their counts (startup
    and shutdown cancel out). Stable on a shared machine where CPU time is not."""
    small, large = ns.cg_requests // 5, ns.cg_requests
    with tempfile.TemporaryDirectory() as tmp:
        small_ir = await callgrind_run(ns, small, os.path.join(tmp, "small"))
        large_ir = await callgrind_run(ns, large, os.path.join(tmp, "large"))
    return {"requests": [small, large], "connections": ns.cg_connections,
            "instructions_per_request": round((large_ir - small_ir) / (large - small))}  # fmt: skip


# ---------------------------------------------------------------------------------------------- timeline

#: The steps of a request's first byte that --timeline marks: (module, class or None, function, step, after it
#: returned, only when): the first time each is reached in a request is its mark.
_STEPS: list[tuple[str, str | None, str, str, bool, Any]] = [
    ("coordinator.io.frontdoor.openai_http", "OpenAIConnection", "data_received", "door: the request's bytes in",
     False, None),
    ("coordinator.openai_api.intake", "RequestReader", "feed", "door: head and body cut", True, None),
    ("coordinator.io.frontdoor.openai_http", "OpenAIEntry", "admit", "door: key and rate admitted", True, None),
    ("coordinator.io.frontdoor.openai_http", None, "parse_request", "door: body checked, hints computed", True, None),
    ("coordinator.io.frontdoor.openai_exchange", "Exchange", "start", "door: exchange made", False, None),
    ("coordinator.io.frontdoor.core_driver", "CoreDriver", "receive", "core: submit taken, plan placed", True,
     lambda _driver, _conn, msg, _now: type(msg).__name__ == "Submit"),
    # (at the delivery's start: a lone step's assign is written inside it, Session.send_now, before flush returns)
    ("coordinator.io.frontdoor.core_driver", "CoreDriver", "deliver", "driver: committed, delivered", False,
     lambda *_: "core: submit taken, plan placed" in _MARKS),
    ("coordinator.io.frontdoor.connection", None, "send_frame", "coordinator: assign frame sent", False,
     lambda *_: "driver: committed, delivered" in _MARKS),
    # (or written by the delivering step itself while the worker's session writer is parked: Session.send_now)
    ("coordinator.io.frontdoor.connection", "Session", "send_now", "coordinator: assign frame sent", False,
     lambda *_: "driver: committed, delivered" in _MARKS),
    ("worker_agent.agent", "Agent", "_dispatch", "agent: assign decoded", False,
     lambda _agent, msg: type(msg).__name__ == "Assign"),
    ("worker_agent.inference", "InferenceEngine", "generate", "agent: handler started", False, None),
    ("worker_agent.engine_http", "EngineClient", "_exchange", "agent: request written to the engine", False, None),
    ("worker_agent.engine_http", "EngineClient", "_exchange", "engine: its answer's head in", True, None),
    ("worker_agent.handlers", "Context", "emit", "agent: first token emitted", False,
     lambda _ctx, kind, *_a, **_k: kind == "token"),
    ("worker_agent.agent", None, "send_frame", "agent: frame with the token sent", False,
     lambda *_: "agent: first token emitted" in _MARKS),
    # (or written at once by the emit's own step, when the agent's writer has that path and it can)
    ("worker_agent.agent", None, "write_frame_now", "agent: frame with the token sent", False,
     lambda *_: "agent: first token emitted" in _MARKS),
    # The coordinator's side of the token's frame: its bytes read (the websocket's data_received), the frame decoded
    # and handed to the session (right from data_received while its reader idles: ``take``; else by the reader
    # task: ``received``), the core's step.
    # (FailFastConnection's: a small frame whole in one read no longer reaches websockets' own data_received)
    ("coordinator.io.frontdoor.connection", "FailFastConnection", "data_received",
     "coordinator: the token's frame read", False, lambda *_: "agent: frame with the token sent" in _MARKS),
    ("coordinator.io.frontdoor.core_driver", "CoreSession", "take", "coordinator: frame decoded, session has it",
     False, lambda _session, msgs, *_a, **_k: any(getattr(m, "kind", "") == "token" for m in msgs)),
    ("coordinator.io.frontdoor.core_driver", "CoreSession", "received", "coordinator: frame decoded, session has it",
     False, lambda _session, msgs, *_: any(getattr(m, "kind", "") == "token" for m in msgs)),
    ("coordinator.io.frontdoor.core_driver", "CoreDriver", "receive", "core: token taken", True,
     lambda _driver, _conn, msg, _now: getattr(msg, "kind", "") == "token"),
    ("coordinator.io.frontdoor.openai_exchange", "Exchange", "deliver", "door: token delivered", False,
     lambda _exchange, msgs: any(getattr(m, "kind", "") == "token" for m in msgs)),
    ("coordinator.io.frontdoor.openai_http", "OpenAIConnection", "write", "door: first byte written", False,
     lambda *_: "door: token delivered" in _MARKS),
]
_MARKS: dict[str, float] = {}
_ORDER: Final = [*dict.fromkeys(step for _module, _owner, _name, step, _after, _when in _STEPS),
                 "client: first text read"]


def _marked(fn: Any, step: str, after: bool, when: Any) -> Any:
    import functools
    import inspect

    def mark(*args: Any, **kwargs: Any) -> None:
        if step not in _MARKS and (when is None or when(*args, **kwargs)):
            _MARKS[step] = time.perf_counter()

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def marked_async(*args: Any, **kwargs: Any) -> Any:
            if not after:
                mark(*args, **kwargs)
            result = await fn(*args, **kwargs)
            if after:
                mark(*args, **kwargs)
            return result
        return marked_async

    @functools.wraps(fn)
    def marked(*args: Any, **kwargs: Any) -> Any:
        if not after:
            mark(*args, **kwargs)
        result = fn(*args, **kwargs)
        if after:
            mark(*args, **kwargs)
        return result
    return marked


async def timeline(requests: int, token_delay_s: float = 0.0) -> dict[str, Any]:
    """6. Where the first byte's time goes (``--timeline``): the coordinator, a worker agent and the fake engine
    (in a thread) in this one process and loop, so the steps of a request run one after another; sequential
    streamed requests, each step's median time since the one before it. Wall clock: on a busy machine every
    gap grows by the other tenants' turns, so read the shares more than the microseconds."""
    import importlib
    import statistics

    from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
    from worker_agent import Agent
    from worker_agent.inference import InferenceEngine
    from worker_agent.telemetry import Telemetry

    spec = importlib.util.spec_from_file_location("fake_engine", h.ROOT / "examples" / "inference_fleet" /
                                                  "fake_engine.py")  # fmt: skip
    assert spec is not None and spec.loader is not None
    fake_engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake_engine)
    saved = []
    for module_name, owner_name, name, step, after, when in _STEPS:
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        if name not in owner.__dict__:  # a step of a newer tree (the baseline may not have it)
            continue
        saved.append((owner, name, owner.__dict__[name]))
        setattr(owner, name, _marked(getattr(owner, name), step, after, when))
    worker_token, client_token = "bench-worker-token-0123", "bench-client-token-0123"
    server = CoordinatorServer(ServerSettings(port=0, worker_tokens=(worker_token,), client_tokens=(client_token,),
                                              store="memory"))  # fmt: skip
    fake = fake_engine.FakeEngine(name="e0", model=MODEL, token_delay_s=token_delay_s).start()
    gaps: dict[str, list[float]] = {}
    firsts: list[float] = []
    try:
        await server.start()
        engine = InferenceEngine(fake.url, metrics_interval_s=60.0)
        agent = Agent(server.url, worker_token, worker_id="w0", telemetry=Telemetry(engine=engine))
        agent.add_handler("generate", engine.generate)
        running = asyncio.create_task(agent.run())
        assert server.openai is not None
        while not server.openai.models.serves(MODEL, time.monotonic()):  # noqa: ASYNC110 - no event says it
            await asyncio.sleep(0.02)
        reader, writer = await asyncio.open_connection(h.HOST, server.port)
        for i in range(requests + 20):
            _MARKS.clear()
            started = time.perf_counter()
            request = chat_request(server.port, f"hello {i}")
            writer.write(request.replace(b"Bearer bench", b"Bearer " + client_token.encode()))
            first = await read_stream(reader, started)
            if i < 20:
                continue  # warm-up
            firsts.append(first)
            previous = started
            for step, at in sorted(_MARKS.items(), key=lambda item: item[1]):
                gaps.setdefault(step, []).append(at - previous)
                previous = at
            gaps.setdefault("client: first text read", []).append(started + first - previous)
        writer.close()
        agent.stop()
        await asyncio.wait_for(running, 10)
    finally:
        await server.stop()
        fake.stop()
        for owner, name, original in saved:
            setattr(owner, name, original)
    return {"requests": requests, "first_text_p50_ms": round(statistics.median(firsts) * 1e3, 3),
            "steps_us": {step: round(statistics.median(gaps[step]) * 1e6, 1) for step in _ORDER if step in gaps}}


# ---------------------------------------------------------------------------------------------- main


async def ttfb(ns: argparse.Namespace, requests: int) -> dict[str, Any]:
    """1. Time to the first text chunk: the door, the engine directly, the coordinator's own share, the SDK."""
    async with h.fleet("memory") as f:
        fake = h.ROOT / "examples" / "inference_fleet" / "fake_engine.py"
        engine = await h.spawn("engine", sys.executable, str(fake), "--port", "0", "--name", "e0", "--model", MODEL,
                               "--token-delay", str(ns.token_delay))  # fmt: skip
        f.others.append(engine)
        engine_url = (await engine.wait_for_line(r"listening on (http://\S+)")).group(1)
        engine_port = int(engine_url.rsplit(":", 1)[1])
        coordinator = await f.start_coordinator()
        agent = await f.start_worker("w0", "--inference-url", engine_url)
        fast = await h.spawn("fast-workers", sys.executable, __file__, "--fast-worker", f.url, "--fast-count", "1",
                             "--fast-model", FAST_MODEL)  # fmt: skip
        f.others.append(fast)
        await f.wait_workers()
        await fast.wait_for_line(r"fast worker \d+ registered")
        await asyncio.sleep(0.5)  # the worker's capabilities (its engine's models) are in its hello already
        for port, model in ((f.port, MODEL), (engine_port, MODEL), (f.port, FAST_MODEL)):
            await raw_ttfb(port, 20, model)  # warm-up: imports, connections
        processes = {"coordinator": coordinator.pid, "agent": agent.pid, "engine": engine.pid}
        before, own_before = {name: h.cpu_seconds(pid) for name, pid in processes.items()}, time.process_time()
        door = await raw_ttfb(f.port, requests)
        cpu_us = {name: round((h.cpu_seconds(pid) - before[name]) * 1e6 / requests) for name, pid in processes.items()}
        cpu_us["client"] = round((time.process_time() - own_before) * 1e6 / requests)
        direct = await raw_ttfb(engine_port, requests)
        own = await raw_ttfb(f.port, requests, FAST_MODEL)
        await sdk_ttfb(f.url, 5)
        sdk = await sdk_ttfb(f.url, requests)
        od, oe = (await openai_ttfb(f"http://{h.HOST}:{f.port}/v1", requests),
                  await openai_ttfb(f"{engine_url}/v1", requests))  # fmt: skip
        sd = await asyncio.to_thread(sync_openai_ttfb, f"http://{h.HOST}:{f.port}/v1", requests)
        se = await asyncio.to_thread(sync_openai_ttfb, f"{engine_url}/v1", requests)
    durable = await durable_ttfb(requests)
    # (A coordinator before the flag: its durable figure twice.)
    volatile = await durable_ttfb(requests, *(("--openai-durable", "off") if h.coordinator_has_flag("--openai-durable")
                                              else ()))

    def added(through: list[float], direct: list[float]) -> float:
        return round((h.percentile(through, 50) - h.percentile(direct, 50)) * 1e3, 3)

    return {
        "raw": {"door": h.summary_ms(door), "engine": h.summary_ms(direct), "added_p50_ms": added(door, direct),
                "cpu_us_per_request": cpu_us},
        "coordinator_only": {"door": h.summary_ms(own), "added_p50_ms": added(own, direct),
                             "sqlite": h.summary_ms(durable), "sqlite_added_p50_ms": added(durable, direct),
                             "sqlite_nondurable": h.summary_ms(volatile),
                             "sqlite_nondurable_added_p50_ms": added(volatile, direct)},
        "sdk": {"fleet": h.summary_ms(sdk), "door_over_sdk_p50_ms": added(door, sdk)},
        "openai": {"door": h.summary_ms(od), "engine": h.summary_ms(oe), "added_p50_ms": added(od, oe)},
        "openai_sync": {"door": h.summary_ms(sd), "engine": h.summary_ms(se), "added_p50_ms": added(sd, se)},
        "requests": requests,
    }  # fmt: skip


async def durable_ttfb(requests: int, *flags: str) -> list[float]:
    """(1) with the default durable store: the coordinator's own share again, on SQLite (its plan is recorded,
    one group commit with its fsync, before the worker is sent it: docs/SEMANTICS.md); with ``--openai-durable
    off`` in ``flags``, the door's plans are not recorded and nothing waits for a commit."""
    async with h.fleet("sqlite") as f:
        await f.start_coordinator(*flags)
        fast = await h.spawn("fast-workers", sys.executable, __file__, "--fast-worker", f.url, "--fast-count", "1",
                             "--fast-model", FAST_MODEL)  # fmt: skip
        f.others.append(fast)
        await fast.wait_for_line(r"fast worker \d+ registered")
        await raw_ttfb(f.port, 20, FAST_MODEL)
        return await raw_ttfb(f.port, requests, FAST_MODEL)


async def load(ns: argparse.Namespace, seconds: float) -> dict[str, Any]:
    """2. Streamed requests/s through the coordinator alone (fast workers), on a core of its own where possible."""
    async with h.fleet("memory") as f:
        await f.start_coordinator("--openai-queue-timeout", "60", *shlex.split(ns.coordinator_args))
        workers = await h.spawn("fast-workers", sys.executable, __file__, "--fast-worker", f.url,
                                "--fast-count", str(ns.fast_workers))  # fmt: skip
        f.others.append(workers)
        for _ in range(ns.fast_workers):
            await workers.wait_for_line(r"fast worker \d+ registered")
        assert f.coordinator is not None
        pid = f.coordinator.pid
        use_wrk = ns.generator == "wrk" or (ns.generator == "auto" and shutil.which("wrk") is not None)
        pinned = (os.cpu_count() or 1) >= 2 and pin(pid, "0") and pin(workers.pid, "1")
        generator_cpus = "1" if pinned else None
        if use_wrk:
            await asyncio.to_thread(wrk_load, f.port, 4, 1.0, MODEL, generator_cpus)  # warm-up
        else:
            await raw_load(f.port, 4, 1.0)
        profiler = h.Profiler(ns.profile)
        profiler.attach("coordinator", pid, round(seconds) + 5)
        cpu0, workers0, started = h.cpu_seconds(pid), h.cpu_seconds(workers.pid), time.perf_counter()
        if use_wrk:
            result = await asyncio.to_thread(wrk_load, f.port, ns.connections, seconds, MODEL, generator_cpus)
        else:
            own = time.process_time()
            result = await raw_load(f.port, ns.connections, seconds)
            result.update(generator="python (this process)", generator_cpu_s=round(time.process_time() - own, 3))
        wall = time.perf_counter() - started
        profiler.finish()
        cpu, workers_cpu = h.cpu_seconds(pid) - cpu0, h.cpu_seconds(workers.pid) - workers0
        result.update(connections=ns.connections, pinned=pinned, coordinator_core_busy=round(cpu / wall, 3),
                      workers_cpu_s=round(workers_cpu, 3), **cpu_figures(result, cpu, workers_cpu))  # fmt: skip
        if "clients" not in ns.only:
            return {"raw_load": result}
        base = f"http://{h.HOST}:{f.port}/v1"
        if pinned:
            pin(os.getpid(), "1")  # the openai clients run here: beside the generator, not on the coordinator's core
        oa = {**await openai_load(base, ns.openai_concurrency, seconds), "concurrency": ns.openai_concurrency}
        sync = await asyncio.to_thread(sync_openai_load, base, ns.openai_concurrency, seconds)
        if pinned:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, range(os.cpu_count() or 1))
    return {"raw_load": result, "openai_load": oa, "openai_sync_load": sync}


async def memory(ns: argparse.Namespace, streams: int) -> dict[str, Any]:
    """3. The coordinator's RSS per open stream (the fast workers hold every plan)."""
    async with h.fleet("memory") as f:
        await f.start_coordinator("--openai-queue-timeout", "60")
        workers = await h.spawn("fast-workers", sys.executable, __file__, "--fast-worker", f.url,
                                "--fast-count", str(ns.fast_workers), "--hold")  # fmt: skip
        f.others.append(workers)
        for _ in range(ns.fast_workers):
            await workers.wait_for_line(r"fast worker \d+ registered")
        assert f.coordinator is not None
        pid = f.coordinator.pid
        await open_streams(f.port, 20)  # warm-up: a first allocation of everything a stream uses
        before = h.rss_bytes(pid)
        held = await open_streams(f.port, streams)
        await asyncio.sleep(0.5)
        after = h.rss_bytes(pid)
        for writer in held:
            writer.close()
    return {"streams": streams, "rss_before_mib": round(before / 2**20, 1), "rss_after_mib": round(after / 2**20, 1),
            "kib_per_open_stream": round((after - before) / streams / 1024, 1)}  # fmt: skip


async def measure(ns: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"machine": h.machine()}
    only = ns.only
    if "ttfb" in only:
        result["ttfb"] = await ttfb(ns, ns.requests)
    if "load" in only:
        result.update(await load(ns, ns.seconds))
    if "memory" in only:
        result["memory"] = await memory(ns, ns.streams)
    if "prefix" in only:
        conversations = ns.conversations  # not a multiple of the workers: round robin's turns do not line up
        result["prefix"] = [prefix_hit_rate(policy, 8, conversations) for policy in ("kv_aware", "round_robin")]
    if "steps" in only:
        result["steps"] = door_steps(ns.step_requests, 3 if ns.quick else 7)
    if "timeline" in only:
        result["timeline"] = await timeline(ns.requests, ns.token_delay)
    if "callgrind" in only:
        result["callgrind"] = await callgrind(ns)
    return result


def lines(r: dict[str, Any]) -> list[str]:
    def pair(figures: dict[str, float]) -> str:
        return f"{figures['p50_ms']} / {figures['p99_ms']}"

    out = [f"OpenAI front door — {r['machine'].get('cpus')} CPUs, {r['machine'].get('cpu', '?')}"]
    if "ttfb" in r:
        t = r["ttfb"]
        out += [
            f"time to first text chunk, {t['requests']} sequential streamed requests (p50 / p99 ms):",
            f"  raw HTTP   door {pair(t['raw']['door'])}   engine directly {pair(t['raw']['engine'])}   "
            f"added p50 {t['raw']['added_p50_ms']} ms (goal <= 1 ms)",
            "  CPU per request through the door (µs; /proc ticks, so +-{tick}): ".format(
                tick=round(1e4 / t["requests"]))
            + ", ".join(f"{name} {us}" for name, us in t["raw"]["cpu_us_per_request"].items()),
            f"  of which the coordinator's (a raw websocket worker, no agent, no engine): door "
            f"{pair(t['coordinator_only']['door'])}, added p50 {t['coordinator_only']['added_p50_ms']} ms; with the "
            f"default durable store (SQLite: the plan is committed before it is placed) "
            f"{pair(t['coordinator_only']['sqlite'])}, added p50 {t['coordinator_only']['sqlite_added_p50_ms']} ms; "
            f"SQLite with --openai-durable off {pair(t['coordinator_only']['sqlite_nondurable'])}, added p50 "
            f"{t['coordinator_only']['sqlite_nondurable_added_p50_ms']} ms",
            f"  the fleet without the door (SDK submit of the same generate plan) {pair(t['sdk']['fleet'])}: the "
            f"door's own share of the p50 {t['sdk']['door_over_sdk_p50_ms']} ms",
            f"  openai pkg door {pair(t['openai']['door'])}   engine directly {pair(t['openai']['engine'])}   "
            f"added p50 {t['openai']['added_p50_ms']} ms",
            f"  openai sync door {pair(t['openai_sync']['door'])}   engine directly "
            f"{pair(t['openai_sync']['engine'])}   added p50 {t['openai_sync']['added_p50_ms']} ms",
        ]
    if "raw_load" in r:
        raw = r["raw_load"]
        pinned = "coordinator pinned to CPU 0, generator and workers to CPU 1" if raw["pinned"] else "not pinned"
        out += [
            f"streamed requests/s through one coordinator (tiny answers, fast workers; {raw['generator']}, "
            f"x{raw['connections']} connections; {pinned}): {raw['requests_per_s']}/s (goal >= 5,000), errors "
            f"{raw['errors']}",
            f"  CPU per request (µs): coordinator {raw['coordinator_us_per_request']} (its core busy "
            f"{raw['coordinator_core_busy']:.0%}), generator {raw['generator_us_per_request']}, fast workers "
            f"{raw['workers_us_per_request']}: {raw['requests_per_s_per_coordinator_core']}/s per coordinator "
            f"core, {raw['two_core_requests_per_s']}/s on 2 cores with the generator beside it (goal >= 5,000)",
        ]
    if "openai_load" in r:
        oa, sync = r["openai_load"], r["openai_sync_load"]
        out.append(f"  openai pkg x{oa['concurrency']} {oa['requests_per_s']}/s; openai sync x{sync['threads']} "
                   f"threads {sync['requests_per_s']}/s (client-bound)")
    if "memory" in r:
        mem = r["memory"]
        out.append(f"memory: {mem['streams']} open streams {mem['rss_before_mib']} -> {mem['rss_after_mib']} MiB = "
                   f"{mem['kib_per_open_stream']} KiB per open stream")
    if "prefix" in r:
        out.append("prefix hit rate of four-turn chats (turns placed where their previous turn went): "
                   + ", ".join(f"{p['policy']} {p['hit_rate']:.0%} ({p['hits']}/{p['turns_after_the_first']})"
                               for p in r["prefix"]))
    if "steps" in r:
        s = r["steps"]
        under_load = f" of the {r['raw_load']['coordinator_us_per_request']}" if "raw_load" in r else ""
        out += [
            f"the coordinator's CPU per tiny streamed request, in process (µs, best of {s['rounds']} x "
            f"{s['requests']}): door {s['door_us']} (head and body {s['intake_us']}, checks and hints "
            f"{s['checks_us']}, answer {s['reply_us']}), core {s['core_us']} (session, submit, placement, accept, "
            f"token, done); the rest{under_load} under load is I/O (sockets, websocket frames, the loop, the "
            "driver's commit and delivery)",
            f"  a real chat's checks and hints ({s['long_chat_tokens']} prompt tokens: its prefix hashes): "
            f"{s['long_chat_checks_us']} µs per request; {s['long_chat_remembered_checks_us']} µs with its blocks in "
            "the door's memo (a chat's next turn: only the new turn's blocks are hashed)",
        ]
    if "timeline" in r:
        out += timeline_lines(r["timeline"])
    if "callgrind" in r:
        cg = r["callgrind"]
        out.append(f"callgrind: the coordinator's instructions per tiny streamed request ({cg['requests'][0]} and "
                   f"{cg['requests'][1]} requests over {cg['connections']} connections, the difference): "
                   f"{cg['instructions_per_request']:,}")
    return out


def timeline_lines(t: dict[str, Any]) -> list[str]:
    return [f"where the first byte's time goes (one process and loop; {t['requests']} sequential requests, first "
            f"text p50 {t['first_text_p50_ms']} ms; median µs since the step before):",
            *(f"  {t['steps_us'][step]:8.1f}  {step}" for step in _ORDER if step in t["steps_us"])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a short run: the sizes in brackets below")
    parser.add_argument("--requests", type=int, help="sequential requests per TTFB sample (300 [40])")
    parser.add_argument("--connections", type=int, default=64, help="raw HTTP connections of the load")
    parser.add_argument("--openai-concurrency", type=int, default=16, help="concurrent openai-package streams")
    parser.add_argument("--seconds", type=float, help="length of each load (10 [3])")
    parser.add_argument("--streams", type=int, help="open streams for the memory figure (2000 [200])")
    parser.add_argument("--conversations", type=int, help="four-turn chats of the prefix figure (201 [41])")
    parser.add_argument("--token-delay", type=float, default=0.0, metavar="S",
                        help="the fake engine's pause before each token (1 and 6; default 0: all at once). With one, "
                             "the first token travels alone, as from a real engine, not in a frame with the rest")
    parser.add_argument("--timeline", action="store_true",
                        help="also 6: where the first byte's time goes, in one process (see timeline())")
    parser.add_argument("--timeline-only", action="store_true", help="only 6")
    parser.add_argument("--only", metavar="SECTIONS", type=lambda text: set(text.split(",")) - {""},
                        help=f"only these, comma-separated, of: {', '.join(SECTIONS)} (clients: the openai "
                             "package's load, after load's)")
    parser.add_argument("--step-requests", type=int, help="requests per round of the in-process steps (3000 [500])")
    parser.add_argument("--fast-workers", type=int, default=2, help="raw websocket workers of the load")
    parser.add_argument("--generator", choices=("auto", "wrk", "python"), default="auto",
                        help="the load's generator: wrk (C, when installed: auto) or this process's asyncio")
    parser.add_argument("--cg-requests", type=int, default=1000, help="requests of callgrind's larger run (1000)")
    parser.add_argument("--cg-connections", type=int, default=8, help="connections of callgrind's runs (8)")
    parser.add_argument("--coordinator-args", default="", metavar="ARGS",
                        help="more flags for the coordinator of (2)'s load, e.g. '--openai-durable off' (one string)")
    parser.add_argument("--profile", metavar="DIR", help="record a py-spy profile of the coordinator during the load "
                                                         "into DIR/coordinator.txt (bench/profile_top.py lists it)")
    parser.add_argument("--fast-worker", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--fast-count", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--fast-model", default=MODEL, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    from fleetwire.cli.logs import configure_logging

    # The timeline's in-process coordinator and agents log; on stderr, so --json prints one JSON object alone.
    configure_logging("console", "warning")
    for name, full, quick in (("requests", 300, 40), ("seconds", 10.0, 3.0), ("streams", 2000, 200),
                              ("conversations", 201, 41), ("step_requests", 3000, 500)):  # fmt: skip
        if getattr(ns, name) is None:
            setattr(ns, name, quick if ns.quick else full)
    if ns.only is None:
        ns.only = set(SECTIONS) - {"timeline", "callgrind"} | ({"timeline"} if ns.timeline else set())
    elif ns.only - set(SECTIONS):
        parser.error(f"--only: unknown sections {sorted(ns.only - set(SECTIONS))}; they are {', '.join(SECTIONS)}")
    if ns.fast_worker:
        h.run_loop(fast_workers(ns.fast_worker, ns.fast_count, ns.hold, ns.fast_model))
        return 0
    if ns.timeline_only:
        result = {"timeline": h.run_loop(timeline(ns.requests, ns.token_delay))}
        h.emit(result, ns.json, timeline_lines(result["timeline"]))
        return 0
    result = h.run_loop(measure(ns))
    h.emit(result, ns.json, lines(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
