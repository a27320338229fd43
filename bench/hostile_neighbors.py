"""A legitimate client's latency while hostile peers hit the coordinator (docs/OPERATIONS.md §Test matrix 16, 19-21).

    python bench/hostile_neighbors.py [--requests 2000] [--rounds 3] [--phases flood,oversize,...] [--json]
    python bench/hostile_neighbors.py --phases f1-list --rounds 2 --profile /tmp/prof   # py-spy the coordinator
    python bench/profile_top.py /tmp/prof/f1-list-hostile0.txt                           # ... and read it

A coordinator process (`fleetwire coordinator`, default limits except a 2 s handshake timeout
and ``--flood-grace``, 1 s here so a flood reaches 4429 within the bench) on loopback, with a
token file: the legitimate client and the hostile neighbour hold different client tokens, as
two users would. A legitimate client in this process submits ``echo`` plans one at a time and
records each one's submit→result time (from its ``submit`` to its ``succeeded`` event); a
legitimate worker in this process (``bench-echo``) answers each ``assign`` with ``accept`` and
``done`` at once.

The flooding and oversize neighbours are child processes. Each phase interleaves chunks of
``--requests`` round trips with the neighbour stopped (SIGSTOP: *baseline*) and running
(SIGCONT: *hostile*), ``B H B H ... B``, so drift on a shared machine shows up in the baseline
chunks instead of in the result. Each hostile chunk is compared with the mean of the baseline
chunks on either side; the row prints the median Δp99 over rounds and its spread (min..max),
the baselines' own spread, the neighbour's attempts (connections it opened; refused ones
counted apart), its own CPU and the coordinator's CPU during the hostile chunks:

* ``flood``: a client sending single-message frames as fast as it can (throttled, then 4429,
  then reconnecting);
* ``oversize``: a client sending 10 MiB frames in a loop (each closed 1009, reconnecting);
* ``oversize elsewhere`` (``--control``; every phase gets its ``<phase> elsewhere`` row): the
  same neighbour aimed at a second, identical
  coordinator on the same machine. What it costs the legitimate client is what sharing two
  cores with the neighbour costs (its CPU, the kernel's copies, the other coordinator's
  work), not what fleetwire's coordinator pays; the difference to ``oversize`` is fleetwire's.
* ``slowloris``: 500 connections that never finish their handshake (dropped at the handshake
  timeout, 2 s here), plus how long a fresh legitimate connect takes meanwhile;
* issue 17's cost-model findings, one neighbour each, measured like ``flood`` (``B H B H ... B``)
  with the coordinator's RSS growth during the run: ``f1-list`` (200 ``list_plans(limit=10000)``
  per frame over its 2,000 plans), ``f1-subscribe`` (300 ``subscribe(all, from_seq=0)`` per frame),
  ``f2-never-reads`` (``list_plans`` frames, never reading), ``f3-bytes`` (plans with 512 KiB args
  until refused), ``f4-connections`` (one token opening 3,000 sessions), ``f5-tags`` (1,000 plans
  with 64 tags of 128 bytes while a worker connects and disconnects in a loop), ``f5-distinct`` (the
  same with a tag list of its own per plan, under the churning worker's op, so every connect and
  disconnect changes every plan's waiting reason; in both the churning worker id is refused past
  its reconnect budget, ``too_many_reconnects`` and 4429, then the penalty box's 429s for that id: it
  names its id in the upgrade, as fleetwire's agent does, so later phases' workers on the same
  token and address are not held), ``f6-idle-sockets``
  (2,000 token-less TCP connections that never send a byte, reopened when dropped; after each
  hostile chunk, 20 fresh legitimate connects are timed while it goes on: ``legit_connect_ms``),
  ``f9-metrics``
  (500 idle workers, then 6 loops scraping the unauthenticated ``/metrics``), ``f10-401-flood``
  (8 loops of upgrades with a wrong token) and ``f11-dashboard``
  (100 plans with 0.9 MB results listed every 100 ms); the targets are legit p99 within +25 % and
  RSS growth ≤ 256 MiB, the neighbour refused or throttled with a clear code;
* ``slow consumer``: a subscriber that stops reading while a worker streams 32 KiB events
  (closed 4503); the coordinator's RSS growth is printed, next to the same stream with a
  subscriber that reads (the plan's own event history is held either way).

* issue 24's data-plane neighbours (bench/_hostile_data.py), after the others, each measured with a
  legitimate client's latency next to its baseline: ``relay-hog`` (a client keeping 4 relayed
  input streams open and never sending; legit: 1 MiB relayed uploads, submit to result,
  ``--uploads`` per chunk), ``data-idle-sockets`` (``--idle-sockets`` token-less idle TCP
  connections at a worker's data endpoint; legit: 1 MiB direct uploads to that worker),
  ``metrics-idle-sockets`` (the same at the coordinator's ``--metrics-listen``; legit: round trips
  on the main port) and ``data-cancelled-flood`` (``--flood-uploads`` 1 MiB ``PUT`` s with tickets
  of cancelled plans at the worker's data endpoint, 32 at a time, over and over; legit: direct
  uploads; the worker's RSS growth is printed, target ≤ +256 MiB). The relay hog and the idle
  sockets hurt by what they hold, so their baseline chunks run with the neighbour's process ended
  (its streams and sockets gone), not paused; the flood is paused. The data phases run against two
  ``fleetwire worker`` processes (a relay-only one, one with ``--data-listen``) started for them.

A hostile neighbour reconnects as soon as it is closed; when the coordinator's penalty box
refuses it (HTTP 429), it retries at once (``--neighbour-retry now``, the worst case) or after
the ``Retry-After`` it was told (``retry-after``, what fleetwire's own clients do).
``--neighbour-nice`` / ``--neighbour-cpu`` de-prioritise or pin the neighbour processes;
``--pin`` puts the coordinator and the measuring client on CPU 0 and the neighbours on CPU 1,
as if the neighbour ran on a host of its own (on loopback the sender's CPU does most of the
kernel's work of moving its bytes). ``its_closes``/``its_refusals`` count the neighbour's
whole run; ``its_attempts`` and the CPU figures only its hostile chunks.

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _hostile_data as data_phases
import msgspec
import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidMessage, InvalidStatus

TOKENS = {"legit": ("client", "bench-legit-token"), "hostile": ("client", "bench-hostile-token"),
          "worker": ("worker", "bench-worker-token")}
ROOT = Path(__file__).resolve().parent.parent
NEIGHBOURS = ("flood", "oversize")
# Issue 17's cost-model findings, each a neighbour child process (see _cost_neighbour).
COST_NEIGHBOURS = ("f1-list", "f1-subscribe", "f2-never-reads", "f3-bytes", "f4-connections", "f5-tags",
                   "f5-distinct", "f6-idle-sockets", "f9-metrics", "f10-401-flood", "f11-dashboard")
PHASES = ("flood", "oversize", "slowloris", "slow", *COST_NEIGHBOURS, *data_phases.PHASES)
RESTART_SETTLE_S = 0.5  # after a restarted data neighbour exits, before the next baseline chunk


async def _open(url: str, role: str = "client", who: str = "legit", worker_id: str = "", **kw: Any) -> ClientConnection:
    """A session; a worker names its id in the upgrade (``?worker_id=``) as fleetwire's agent does."""
    token = TOKENS["worker" if role == "worker" else who][1]
    query = f"?worker_id={worker_id}" if worker_id else ""
    return await connect(f"{url}/v1/{role}{query}", additional_headers={"Authorization": f"Bearer {token}"},
                         subprotocols=["fleetwire.v1.msgpack"], compression=None, max_size=None,  # type: ignore[list-item]
                         **kw)


async def _open_patiently(url: str, who: str, limit_s: float = 120.0) -> ClientConnection:
    """``_open``, waiting out a 429 from the penalty box (an earlier phase's neighbour holds the same token)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            return await _open(url, who=who)
        except InvalidStatus as exc:
            if exc.response.status_code != 429 or time.monotonic() > deadline:
                raise
            await asyncio.sleep(float(exc.response.headers.get("Retry-After", "1") or 1))


TERMINAL = ("succeeded", "failed", "cancelled")


async def _latencies(ws: ClientConnection, n: int) -> list[float]:
    """``n`` plans one at a time, each timed from its ``submit`` to its result (the ``succeeded`` event)."""
    out = []
    clock = time.perf_counter
    for i in range(n):
        request = msgspec.msgpack.encode({"type": "submit", "req_id": i + 1, "op": "echo", "args": i})
        start = clock()
        await ws.send(request)
        done = False
        while not done:
            for msg in _msgs(await ws.recv(decode=False)):
                if msg.get("type") == "event" and msg.get("kind") in TERMINAL:
                    done = True
                elif msg.get("type") == "error":
                    raise RuntimeError(f"the legitimate submit was refused: {msg}")
        out.append(clock() - start)
    return out


async def _echo_worker(url: str) -> None:
    """The legitimate worker (in the measuring process): answers each ``assign`` with accept and done at once."""
    ws = await _open(url, "worker", worker_id="bench-echo")
    await ws.send(msgspec.msgpack.encode({"type": "hello", "worker_id": "bench-echo",
                                          "capabilities": {"ops": ["echo"], "max_concurrency": 64}}))
    beat = msgspec.msgpack.encode({"type": "heartbeat"})

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(5)
            await ws.send(beat)

    beating = asyncio.create_task(heartbeats())
    try:
        with contextlib.suppress(ConnectionClosed):
            while True:
                replies = []
                for msg in _msgs(await ws.recv(decode=False)):
                    if msg.get("type") == "assign":
                        plan_id, attempt = msg["plan_id"], msg["attempt"]
                        replies += [{"type": "accept", "plan_id": plan_id, "attempt": attempt},
                                    {"type": "done", "plan_id": plan_id, "attempt": attempt,
                                     "outcome": "succeeded", "result": msg.get("args")}]
                if replies:
                    await ws.send(msgspec.msgpack.encode(replies))
    finally:
        beating.cancel()


def _p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[max(0, int(len(ordered) * 0.99) - 1)] * 1e3


def _summary(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": round(statistics.median(samples) * 1e3, 3), "p99_ms": round(_p99(samples), 3)}


async def _drain(ws: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


# ---------------------------------------------------------------------------- neighbours (child processes)


class _Tally:
    """What a neighbour did, printed as one JSON line after each connection attempt."""

    def __init__(self) -> None:
        self.attempts = 0
        self.closes: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    def closed(self, ws: ClientConnection) -> None:
        self.attempts += 1
        key = str(int(ws.close_code)) if ws.close_code is not None else "none"
        self.closes[key] = self.closes.get(key, 0) + 1
        self._print()

    async def refusal(self, exc: InvalidStatus, retry: str) -> None:
        self.attempts += 1
        key = str(exc.response.status_code)
        self.refused[key] = self.refused.get(key, 0) + 1
        self._print()
        if retry == "retry-after":
            await asyncio.sleep(float(exc.response.headers.get("Retry-After", "1")))

    def _print(self) -> None:
        print(json.dumps({"attempts": self.attempts, "closes": self.closes, "refused": self.refused}), flush=True)


async def _flood(url: str, retry: str) -> None:
    """Single-message frames as fast as possible, reconnecting after each close."""
    frame = msgspec.msgpack.encode({"type": "list_workers", "req_id": 2})
    tally = _Tally()
    while True:
        try:
            ws = await _open(url, who="hostile")
        except InvalidStatus as exc:
            await tally.refusal(exc, retry)
            continue
        reader = asyncio.create_task(_drain(ws))
        with contextlib.suppress(ConnectionClosed, AttributeError):
            while True:
                await ws.send(frame)
        with contextlib.suppress(AttributeError):
            await ws.close()
        await reader
        tally.closed(ws)


async def _oversize(url: str, retry: str) -> None:
    """10 MiB frames, one per connection, reconnecting after each 1009."""
    blob = bytes(10 << 20)
    tally = _Tally()
    while True:
        try:
            ws = await _open(url, who="hostile")
        except InvalidStatus as exc:
            await tally.refusal(exc, retry)
            continue
        with contextlib.suppress(ConnectionClosed, AttributeError, OSError):
            await ws.send(blob)
            await ws.recv()
        with contextlib.suppress(Exception):
            await ws.close()
        tally.closed(ws)


def _msgs(frame: bytes) -> list[dict[str, Any]]:
    """A frame's messages (a frame holds one message or a list of them)."""
    decoded = msgspec.msgpack.decode(frame)
    return decoded if isinstance(decoded, list) else [decoded]


async def _fill(ws: ClientConnection, n: int, tally: _Tally | None = None, **submit: Any) -> None:
    """Submit ``n`` plans nobody runs (op ``nobody``), in frames under the 1 MiB limit; read their replies.

    With ``tally``, refused submits are counted by their error code (``its_refusals``: ``too_many_plans``).
    """
    step = max(1, min(200, (900 << 10) // max(1, len(msgspec.msgpack.encode(submit)) + 64)))
    for first in range(0, n, step):
        await ws.send(msgspec.msgpack.encode([{"type": "submit", "req_id": i + 1, "op": "nobody", **submit}
                                              for i in range(first, min(n, first + step))]))
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(30):
            answered = 0
            while answered < n:
                for msg in _msgs(await ws.recv(decode=False)):
                    answered += msg.get("type") in ("accepted", "error")
                    if tally is not None and msg.get("type") == "error":
                        code = str(msg.get("code"))
                        tally.refused[code] = tally.refused.get(code, 0) + 1
            if tally is not None:
                tally._print()


async def _cost_neighbour(kind: str, url: str) -> None:
    """Issue 17's hostile or careless peers, one per finding, each in a reconnect loop."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tally = _Tally()
    if kind == "f6-idle-sockets":
        return await _idle_sockets(url, tally)
    if kind == "f9-metrics":
        return await _scrapes(url, tally)
    if kind == "f10-401-flood":
        return await _bad_tokens(url, tally)
    if kind in ("f1-list", "f1-subscribe", "f2-never-reads"):
        ws = await _open_patiently(url, who="hostile")
        await _fill(ws, 2_000)  # its own plans to list and replay
        await ws.close()
    while True:
        try:
            if kind == "f4-connections":  # one token opens as many sessions as it can and holds them
                held: list[ClientConnection] = []
                while True:
                    try:
                        held.append(await _open(url, who="hostile"))
                    except InvalidStatus as exc:
                        await tally.refusal(exc, "now")
                        await asyncio.sleep(0.05)
                    if len(held) >= 3_000:
                        await asyncio.sleep(1)
            ws = await _open(url, who="hostile", max_queue=1 if kind == "f2-never-reads" else 16)
        except InvalidStatus as exc:
            await tally.refusal(exc, "now")
            continue
        with contextlib.suppress(ConnectionClosed, OSError):
            if kind == "f1-list":  # 200 list_plans(limit=10000) in one frame, replies read
                frame = msgspec.msgpack.encode([{"type": "list_plans", "req_id": i, "limit": 10_000}
                                                for i in range(200)])
                while True:
                    await ws.send(frame)
                    answered = 0
                    while answered < 200:  # replies come coalesced: count messages, not frames
                        answered += len(_msgs(await ws.recv(decode=False)))
            elif kind == "f1-subscribe":  # 300 subscribe(all, from_seq=0) in one frame
                frame = msgspec.msgpack.encode([{"type": "subscribe", "req_id": i, "all": True, "from_seq": 0}
                                                for i in range(300)])
                await ws.send(frame)
                await _drain(ws)
            elif kind == "f2-never-reads":  # list_plans without ever reading
                ws.transport.pause_reading()
                frame = msgspec.msgpack.encode([{"type": "list_plans", "req_id": i, "limit": 10_000}
                                                for i in range(50)])
                while True:
                    await ws.send(frame)
            elif kind == "f3-bytes":  # plans of 512 KiB args until refused, then again
                args = "x" * (512 << 10)
                while True:
                    await _fill(ws, 50, tally, args=args)
            elif kind in ("f5-tags", "f5-distinct"):  # plans with the most tags the caps allow; a worker churns
                op = "nobody"
                if kind == "f5-tags":  # one tag list for all: one group, under an op the worker does not serve
                    tags = [f"{i:03d}" + "t" * 125 for i in range(64)]
                    await _fill(ws, 1_000, requirements={"tags": tags})
                else:  # a tag list of its own per plan, under the worker's op: each (dis)connect changes every reason
                    op = "tagged"
                    for first in range(0, 1_000, 100):
                        await ws.send(msgspec.msgpack.encode([
                            {"type": "submit", "req_id": i + 1, "op": op,
                             "requirements": {"tags": [f"{i:04d}-{k:02d}" + "t" * 120 for k in range(64)]}}
                            for i in range(first, first + 100)]))
                    answered = 0
                    while answered < 1_000:
                        replies = _msgs(await ws.recv(decode=False))
                        answered += sum(m.get("type") in ("accepted", "error") for m in replies)
                hello = msgspec.msgpack.encode({"type": "hello", "worker_id": "churn",
                                                "capabilities": {"ops": ["other" if op == "nobody" else op]}})
                while True:
                    try:
                        worker = await _open(url, "worker", worker_id="churn")
                    except InvalidStatus as exc:  # the penalty box (429) after a refused hello: at once again
                        await tally.refusal(exc, "now")
                        continue
                    except (InvalidMessage, OSError) as exc:  # closed in its handshake: count, go on
                        key = type(exc).__name__
                        tally.refused[key] = tally.refused.get(key, 0) + 1
                        tally._print()
                        continue
                    with contextlib.suppress(ConnectionClosed):  # welcome, or too_many_reconnects and 4429
                        await worker.send(hello)
                        await worker.recv()
                    await worker.close()
                    tally.closed(worker)
            elif kind == "f11-dashboard":  # finished plans with 1 MB results, listed every 100 ms
                worker = await _open(url, "worker", worker_id="big-results")
                await worker.send(msgspec.msgpack.encode({"type": "hello", "worker_id": "big-results",
                                                          "capabilities": {"ops": ["big"], "max_concurrency": 8}}))
                await worker.recv()
                await ws.send(msgspec.msgpack.encode([{"type": "submit", "req_id": i, "op": "big"}
                                                      for i in range(100)]))
                done = 0
                result = "r" * 900_000
                while done < 100:
                    for msg in _msgs(await worker.recv(decode=False)):
                        if msg.get("type") == "assign":
                            await worker.send(msgspec.msgpack.encode({
                                "type": "done", "plan_id": msg["plan_id"], "attempt": msg["attempt"],
                                "outcome": "succeeded", "result": result}))
                            done += 1
                while True:
                    await ws.send(msgspec.msgpack.encode({"type": "list_plans", "req_id": 1, "limit": 200}))
                    await ws.recv()
                    await asyncio.sleep(0.1)
        with contextlib.suppress(Exception):
            await ws.close()
        tally.closed(ws)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


async def _idle_sockets(url: str, tally: _Tally, n: int = 2_000) -> None:
    """Finding 6: ``n`` token-less TCP connections that never send a byte, each reopened when dropped."""
    host, port = _host_port(url)

    async def hold() -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError as exc:
                tally.refused[type(exc).__name__] = tally.refused.get(type(exc).__name__, 0) + 1
                tally.attempts += 1
                tally._print()
                await asyncio.sleep(0.05)
                continue
            with contextlib.suppress(OSError):
                await reader.read()  # the coordinator drops it (handshake timeout or the pending budget)
            writer.close()
            tally.attempts += 1
            tally.closes["dropped"] = tally.closes.get("dropped", 0) + 1
            tally._print()

    await asyncio.gather(*(hold() for _ in range(n)))


async def _scrapes(url: str, tally: _Tally, loops: int = 6, workers: int = 500) -> None:
    """Finding 9: ``workers`` idle worker sessions, then ``loops`` unauthenticated /metrics scrape loops."""
    held = []
    for i in range(workers):
        ws = await _open(url, "worker", worker_id=f"idle-{i}")
        await ws.send(msgspec.msgpack.encode({"type": "hello", "worker_id": f"idle-{i}",
                                              "capabilities": {"ops": ["idle"]}}))
        await ws.recv()
        held.append(ws)
    beat = msgspec.msgpack.encode({"type": "heartbeat"})

    async def heartbeats() -> None:
        while True:
            await asyncio.sleep(5)
            for ws in held:
                with contextlib.suppress(ConnectionClosed):
                    await ws.send(beat)

    host, port = _host_port(url)
    request = f"GET /metrics HTTP/1.1\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()

    async def scrape() -> None:
        while True:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(request)
            body = await reader.read()
            writer.close()
            status = body[9:12].decode(errors="replace") or "none"
            tally.attempts += 1
            if status == "200":
                tally.closes[status] = tally.closes.get(status, 0) + 1
            else:
                tally.refused[status] = tally.refused.get(status, 0) + 1
            tally._print()

    await asyncio.gather(heartbeats(), *(scrape() for _ in range(loops)))


async def _bad_tokens(url: str, tally: _Tally, loops: int = 8) -> None:
    """Finding 10: upgrades with a wrong token as fast as they are answered (401 each)."""

    async def attempt() -> None:
        while True:
            try:
                ws = await connect(f"{url}/v1/client", additional_headers={"Authorization": "Bearer wrong-token"},
                                   subprotocols=["fleetwire.v1.msgpack"], compression=None)  # type: ignore[list-item]
            except InvalidStatus as exc:
                await tally.refusal(exc, "now")
            except (InvalidMessage, OSError) as exc:  # closed in its handshake (e.g. a held answer cut): count, go on
                key = type(exc).__name__
                tally.refused[key] = tally.refused.get(key, 0) + 1
                tally.attempts += 1
            else:
                await ws.close()
                tally.closed(ws)

    await asyncio.gather(*(attempt() for _ in range(loops)))


# ---------------------------------------------------------------------------- the measuring side


class _Coordinator:
    """A ``fleetwire coordinator`` child process and its CPU clock."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc, self.url = proc, url
        self.ps = psutil.Process(proc.pid)

    @classmethod
    async def start(cls, token_file: str, extra: list[str], cpu: int | None) -> _Coordinator:
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        proc = await asyncio.create_subprocess_exec(
            # The default durable store, in the token file's temporary directory: a memory store
            # would itself hold every durable event and hide what the slow-consumer rows measure.
            *pin, sys.executable, "-m", "fleetwire", "coordinator", "--port", "0",
            "--store", f"sqlite:{Path(tempfile.mkdtemp(dir=Path(token_file).parent)) / 'coordinator.sqlite3'}",
            "--token-file", token_file, "--handshake-timeout", "2", "--log-level", "error", *extra,
            cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        line = (await proc.stdout.readline()).decode()
        return cls(proc, line.split("listening on ", 1)[1].split()[0])

    def cpu_s(self) -> float:
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    async def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        await self.proc.wait()


class _Neighbour:
    """A hostile child process that can be paused (SIGSTOP) between measurements."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.ps = psutil.Process(proc.pid)
        self.last: dict[str, Any] = {"attempts": 0, "closes": {}, "refused": {}}
        self.started = time.perf_counter()
        self.first_close = asyncio.get_running_loop().create_future()  # seconds to its first close, and the code
        self.ready = asyncio.Event()  # a data neighbour's load is in place ("ready": true)
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, kind: str, url: str, ns: argparse.Namespace) -> _Neighbour:
        cmd = [sys.executable, __file__, "--neighbour", kind, "--url", url, "--neighbour-retry", ns.neighbour_retry,
               "--idle-sockets", str(ns.idle_sockets), "--flood-uploads", str(ns.flood_uploads),
               "--hog-streams", str(ns.hog_streams), "--upload-bytes", str(ns.upload_bytes)]
        if ns.neighbour_cpu is not None:
            cmd = ["taskset", "-c", str(ns.neighbour_cpu), *cmd]
        if ns.neighbour_nice:
            cmd = ["nice", "-n", str(ns.neighbour_nice), *cmd]
        return cls(await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE))

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            with contextlib.suppress(ValueError, KeyError):
                self.last = json.loads(line)
                if self.last.get("ready"):
                    self.ready.set()
                if (self.last["closes"] or self.last["refused"]) and not self.first_close.done():
                    code = next(iter(self.last["closes"] or self.last["refused"]))
                    self.first_close.set_result((round(time.perf_counter() - self.started, 2), code))

    def cpu_s(self) -> float:
        # taskset/nice exec the python process, so the pid stays the neighbour's.
        times = self.ps.cpu_times()
        return float(times.user + times.system)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    async def stop(self) -> None:
        self.resume()
        self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        await self._reader


class _Spy:
    """``--profile DIR``: py-spy on the coordinator while one chunk is measured (``DIR/<phase>-<chunk>.txt``)."""

    def __init__(self, directory: str | None, pid: int, name: str) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.proc = subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--output", str(Path(directory) / f"{name}.txt"),
                 "--rate", "500", "--format", "raw", "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            await asyncio.to_thread(self.proc.wait, 30)


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}..{max(values):.3f}"


async def _interleaved(legit: ClientConnection, coordinator: _Coordinator, target: str, kind: str,
                       ns: argparse.Namespace, label: str) -> dict[str, Any]:
    """``B H B H ... B`` chunks with the neighbour paused (B) and running (H) against ``target``."""
    rss_before = peak_rss = coordinator.ps.memory_info().rss
    neighbour = await _Neighbour.start(kind, target, ns)
    # It gets going: measured from its first close on (a flood's 4429 comes after its burst
    # and the grace), so every hostile chunk sees its steady reconnect loop. The cost-model
    # neighbours may never be closed: they get a few seconds instead.
    first_close: tuple[float, str] | None = None
    with contextlib.suppress(TimeoutError):
        first_close = await asyncio.wait_for(asyncio.shield(neighbour.first_close),
                                             30 if kind in NEIGHBOURS else ns.warmup)
    neighbour.pause()
    base: list[list[float]] = []
    hostile: list[list[float]] = []
    coord_cpu = neigh_cpu = wall = base_cpu = base_wall = 0.0
    attempts = 0  # while a hostile chunk is measured
    connects: list[float] = []  # f6: fresh legitimate connects while the neighbour runs (seconds)
    connect_failures: dict[str, int] = {}
    for r in range(ns.rounds):
        spy = _Spy(ns.profile if r == 0 else None, coordinator.proc.pid, f"{label}-baseline")
        t0, c0 = time.perf_counter(), coordinator.cpu_s()
        base.append(await _latencies(legit, ns.requests))
        await spy.stop()
        base_wall += time.perf_counter() - t0
        base_cpu += coordinator.cpu_s() - c0
        neighbour.resume()
        await asyncio.sleep(0.3)  # past its reconnect: measure it in its steady state
        spy = _Spy(ns.profile, coordinator.proc.pid, f"{label}-hostile{r}")
        t0, c0, n0, a0 = time.perf_counter(), coordinator.cpu_s(), neighbour.cpu_s(), neighbour.last["attempts"]
        hostile.append(await _latencies(legit, ns.requests))
        await spy.stop()
        wall += time.perf_counter() - t0
        coord_cpu += coordinator.cpu_s() - c0
        neigh_cpu += neighbour.cpu_s() - n0
        attempts += neighbour.last["attempts"] - a0
        peak_rss = max(peak_rss, coordinator.ps.memory_info().rss)
        if kind == "f6-idle-sockets":
            await _connects(coordinator.url, 20, connects, connect_failures)
        neighbour.pause()
    base.append(await _latencies(legit, ns.requests))
    last = dict(neighbour.last)
    await neighbour.stop()
    base_p99 = [_p99(b) for b in base]
    hostile_p99 = [_p99(h) for h in hostile]
    deltas = [(h / ((base_p99[i] + base_p99[i + 1]) / 2) - 1) * 100 for i, h in enumerate(hostile_p99)]
    pooled_base = [x for b in base for x in b]
    pooled_hostile = [x for h in hostile for x in h]
    return {
        "neighbour": label,
        **_summary(pooled_hostile),
        "baseline_p99_ms": round(_p99(pooled_base), 3),
        "delta_p99_pct": round(statistics.median(deltas), 1),
        "delta_p99_pct_range": [round(min(deltas), 1), round(max(deltas), 1)],
        "baseline_p99_ms_range": [round(min(base_p99), 3), round(max(base_p99), 3)],
        "hostile_p99_ms_range": [round(min(hostile_p99), 3), round(max(hostile_p99), 3)],
        "coordinator_cpu_pct": round(coord_cpu / wall * 100, 1),
        "coordinator_cpu_pct_baseline": round(base_cpu / base_wall * 100, 1),
        "neighbour_cpu_pct": round(neigh_cpu / wall * 100, 1),
        "its_attempts": attempts,
        "its_attempts_per_s": round(attempts / wall, 1),
        # What one of its attempts costs the coordinator beyond serving the legitimate client.
        # Hostile and measured baseline chunks serve the same legitimate requests, so the
        # difference in coordinator CPU is what the neighbour's attempts cost it.
        # (None with too few attempts to say: the CPU clock ticks in 10 ms.)
        "coordinator_cpu_us_per_attempt": round((coord_cpu - base_cpu) / attempts * 1e6) if attempts >= 20 else None,
        "its_first_close": None if first_close is None else {"after_s": first_close[0], "code": first_close[1]},
        "its_closes": last["closes"],
        "its_refusals": last["refused"],
        "coordinator_rss_growth_mb": round((peak_rss - rss_before) / 2**20, 1),
        **({"legit_connect_ms": {"p50": round(statistics.median(connects) * 1e3, 2),
                                 "max": round(max(connects) * 1e3, 2), "n": len(connects),
                                 "failed": connect_failures}} if connects else
           {"legit_connect_ms": {"failed": connect_failures}} if connect_failures else {}),
    }


async def _data_interleaved(kind: str, target: str, ns: argparse.Namespace, measure: Any,
                            watched: dict[str, psutil.Process]) -> dict[str, Any]:
    """Issue 24's data-plane neighbours: ``B H B H ... B`` chunks of ``measure()`` (a list of seconds) with the
    neighbour absent and present. A neighbour in ``data_phases.RESTARTED`` is started for each hostile chunk
    and ended after it (what it holds goes with it); the others are paused between chunks. The RSS of each
    ``watched`` process is sampled every 0.1 s during the hostile chunks."""
    restart = kind in data_phases.RESTARTED
    rss_before = {name: ps.memory_info().rss for name, ps in watched.items()}
    peak = dict(rss_before)
    cpu = {name: {"baseline": 0.0, "hostile": 0.0} for name in watched}
    wall = {"baseline": 0.0, "hostile": 0.0}
    neighbour_cpu = 0.0

    def cpu_s(ps: psutil.Process) -> float:
        with contextlib.suppress(psutil.Error):
            times = ps.cpu_times()
            return float(times.user + times.system)
        return 0.0

    async def timed(phase: str) -> list[float]:
        """One chunk of ``measure()``, its wall time and the watched processes' CPU counted under ``phase``."""
        t0, c0 = time.perf_counter(), {name: cpu_s(ps) for name, ps in watched.items()}
        samples: list[float] = await measure()
        wall[phase] += time.perf_counter() - t0
        for name, ps in watched.items():
            cpu[name][phase] += cpu_s(ps) - c0[name]
        return samples
    base: list[list[float]] = []
    hostile: list[list[float]] = []
    ready_s: list[float] = []
    last: dict[str, Any] = {}
    neighbour: _Neighbour | None = None

    async def present() -> _Neighbour:
        started = time.perf_counter()
        one = await _Neighbour.start(kind, target, ns)
        try:
            await asyncio.wait_for(one.ready.wait(), ns.ready_timeout)
        except TimeoutError:  # measured anyway, with what it got in place: its tally says how far it came
            pass
        ready_s.append(round(time.perf_counter() - started, 2))
        return one

    async def sample() -> None:
        while True:
            for name, ps in watched.items():
                with contextlib.suppress(psutil.Error):
                    peak[name] = max(peak[name], ps.memory_info().rss)
            await asyncio.sleep(0.1)

    if not restart:
        neighbour = await present()
        neighbour.pause()
    try:
        for _ in range(ns.rounds):
            base.append(await timed("baseline"))
            if restart:
                neighbour = await present()
            else:
                assert neighbour is not None
                neighbour.resume()
                await asyncio.sleep(0.3)
            sampler = asyncio.create_task(sample())
            assert neighbour is not None
            n0 = neighbour.cpu_s()
            try:
                hostile.append(await timed("hostile"))
            finally:
                sampler.cancel()
            neighbour_cpu += neighbour.cpu_s() - n0
            last = dict(neighbour.last)
            if restart:
                await neighbour.stop()
                neighbour = None
                # What it held goes at its exit, at once: 1,200 sockets the worker's kernel deferred are
                # completed by their FIN and accepted together, each read to its end and closed. That lump
                # is the neighbour's, not the baseline's: the next baseline chunk starts once it is over
                # (it made baseline p99 up to twice the hostile chunks' with --pin).
                await asyncio.sleep(RESTART_SETTLE_S)
            else:
                neighbour.pause()
        base.append(await timed("baseline"))
    finally:
        if neighbour is not None:
            await neighbour.stop()
    base_p99 = [_p99(b) for b in base]
    hostile_p99 = [_p99(h) for h in hostile]
    deltas = [(h / ((base_p99[i] + base_p99[i + 1]) / 2) - 1) * 100 for i, h in enumerate(hostile_p99)]
    return {
        "neighbour": kind,
        **_summary([x for h in hostile for x in h]),
        "baseline_p99_ms": round(_p99([x for b in base for x in b]), 3),
        "delta_p99_pct": round(statistics.median(deltas), 1),
        "delta_p99_pct_range": [round(min(deltas), 1), round(max(deltas), 1)],
        "baseline_p99_ms_range": [round(min(base_p99), 3), round(max(base_p99), 3)],
        "hostile_p99_ms_range": [round(min(hostile_p99), 3), round(max(hostile_p99), 3)],
        "legit_per_chunk": len(hostile[0]) if hostile else 0,
        "its_ready_s": ready_s,
        "its_last": last,
        "neighbour_cpu_pct": round(neighbour_cpu / wall["hostile"] * 100, 1) if wall["hostile"] else None,
        **{f"{name}_cpu_pct_{phase}": round(used[phase] / wall[phase] * 100, 1)
           for name, used in cpu.items() for phase in ("baseline", "hostile") if wall[phase]},
        **{f"{name}_rss_growth_mb": round((peak[name] - rss_before[name]) / 2**20, 1) for name in watched},
    }


async def _data_phases(legit: ClientConnection, coordinator: _Coordinator, ns: argparse.Namespace,
                       phases: list[str], metrics_target: str | None) -> list[dict[str, Any]]:
    """Issue 24's data-plane phases (bench/_hostile_data.py), the metrics listener's first (no data workers yet)."""
    from fleetwire import Client

    rows: list[dict[str, Any]] = []
    coordinator_only = {"coordinator": coordinator.ps}
    if "metrics-idle-sockets" in phases and metrics_target is not None:
        rows.append(await _data_interleaved("metrics-idle-sockets", metrics_target, ns,
                                            lambda: _latencies(legit, ns.requests), coordinator_only))
    wanted = [kind for kind in ("relay-hog", "data-idle-sockets", "data-cancelled-flood") if kind in phases]
    if not wanted:
        return rows
    async with Client(coordinator.url, token=TOKENS["legit"][1]) as client:
        fleet = await data_phases.DataFleet.start(coordinator.url, TOKENS["worker"][1], client,
                                                  0 if ns.pin else None)
        try:
            failed: dict[str, int] = {}  # legit uploads with no result within --upload-timeout, by cause

            def relayed() -> Any:
                return data_phases.uploads(client, ns.uploads, ns.upload_bytes, relay=True, failures=failed,
                                           timeout_s=ns.upload_timeout)

            def direct() -> Any:
                return data_phases.uploads(client, ns.uploads, ns.upload_bytes, relay=False, failures=failed,
                                           timeout_s=ns.upload_timeout)

            await relayed()  # warm-up: both paths, the workers' spools, the SDK's connections
            await direct()
            failed.clear()
            watched = {"coordinator": coordinator.ps, "worker": fleet.data_ps}
            for kind in wanted:
                try:
                    if kind == "relay-hog":
                        row = await _data_interleaved(kind, coordinator.url, ns, relayed, coordinator_only)
                    elif kind == "data-cancelled-flood":  # its tickets come through the coordinator, with the URL
                        row = await _data_interleaved(kind, coordinator.url, ns, direct, watched)
                    else:
                        row = await _data_interleaved(kind, fleet.data_url.split("://", 1)[1], ns, direct, watched)
                    rows.append({**row, "legit_failed": dict(failed)})
                    failed.clear()
                except ProcessLookupError:
                    rows.append({"neighbour": kind, "error": "the neighbour process exited (see its traceback)"})
        finally:
            await fleet.stop()
    return rows


async def _connects(url: str, n: int, out: list[float], failures: dict[str, int]) -> None:
    """``n`` fresh legitimate connects one after another, each timed from connect to the finished upgrade."""
    for _ in range(n):
        start = time.perf_counter()
        try:
            ws = await _open(url, open_timeout=10)
        except (InvalidStatus, InvalidMessage, OSError, TimeoutError) as exc:
            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            continue
        out.append(time.perf_counter() - start)
        await ws.close()


async def _slowloris(legit: ClientConnection, url: str, n: int) -> dict[str, Any]:
    base_before = await _latencies(legit, n)
    host, port = url.removeprefix("ws://").split(":")
    loris = [await asyncio.open_connection(host, int(port)) for _ in range(500)]
    for _, writer in loris:
        writer.write(b"GET /v1/client HTTP/1.1\r\nHost: x\r\n")
    start = time.perf_counter()
    ws = await _open(url)
    connect_s = time.perf_counter() - start
    await ws.close()
    during = await _latencies(legit, n)
    dropped = 0
    for reader, writer in loris:
        with contextlib.suppress(TimeoutError, ConnectionError):
            if await asyncio.wait_for(reader.read(), 10) == b"":
                dropped += 1
        writer.close()
    base_after = await _latencies(legit, n)
    base = (_p99(base_before) + _p99(base_after)) / 2
    return {"neighbour": "slowloris x500", **_summary(during), "baseline_p99_ms": round(base, 3),
            "delta_p99_pct": round((_p99(during) / base - 1) * 100, 1),
            "legit_connect_ms": round(connect_s * 1e3, 2), "dropped_at_timeout": dropped}


def _closes_4503(url: str) -> int:
    """How many sessions the coordinator closed 4503 (slow consumer), from its /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url.replace("ws://", "http://", 1) + "/metrics", timeout=10) as reply:
        body = reply.read().decode()
    return sum(int(s.value) for f in text_string_to_metric_families(body) for s in f.samples
               if f.name == "fleetwire_refusals" and s.labels.get("answer") == "4503")


async def _stream(url: str, coordinator: psutil.Process, plan_id: str, *, reads: bool) -> dict[str, Any]:
    """A worker streams 32 KiB events of one plan to a subscriber that reads, or that stops reading.

    The paused subscriber never reads the close frame, so the 4503 is read from the
    coordinator's /metrics (``fleetwire_refusals_total{answer="4503"}``).
    """
    closes_before = await asyncio.to_thread(_closes_4503, url)
    worker = await _open(url, "worker", worker_id=f"b-{plan_id}")
    await worker.send(msgspec.msgpack.encode({"type": "hello", "worker_id": f"b-{plan_id}",
                                              "capabilities": {"ops": ["stream"], "max_concurrency": 1}}))
    await worker.recv()
    sub = await _open(url, ping_interval=None)
    await sub.send(msgspec.msgpack.encode({"type": "submit", "req_id": 1, "op": "stream", "plan_id": plan_id}))
    assign = msgspec.msgpack.decode(await worker.recv(decode=False))
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
    closed_4503 = await asyncio.to_thread(_closes_4503, url) - closes_before
    # RSS growth includes the plan's own held events (durable, up to the per-plan cap): compare
    # the two rows; the slow consumer's share is the difference.
    return {"neighbour": "slow consumer" if not reads else "reading subscriber", "events_streamed": 20_000,
            "coordinator_rss_growth_mb": round((peak - before) / 2**20, 1),
            "coordinator_closed_4503": closed_4503}


def _token_file(directory: str) -> str:
    from coordinator.auth import hash_token

    path = Path(directory) / "tokens.toml"
    path.write_text("".join(f'[[token]]\nname = "{name}"\nrole = "{role}"\nhash = "{hash_token(token)}"\n\n'
                            for name, (role, token) in TOKENS.items()))
    return str(path)


async def run(ns: argparse.Namespace) -> list[dict[str, Any]]:
    extra = ["--flood-grace", str(ns.flood_grace)]
    if ns.penalty is not None:
        extra += ["--penalty-base", str(ns.penalty)]
    phases = ns.phases.split(",")
    metrics_target = None
    if "metrics-idle-sockets" in phases:
        metrics_target = f"127.0.0.1:{data_phases.free_port()}"
        extra += ["--metrics-listen", metrics_target]
    with tempfile.TemporaryDirectory() as tmp:
        tokens = _token_file(tmp)
        cpu = 0 if ns.pin else None
        coordinator = await _Coordinator.start(tokens, extra, cpu)
        # The control coordinator stands for another host: with --pin it shares the neighbour's CPU.
        other = await _Coordinator.start(tokens, extra, ns.neighbour_cpu) if ns.control else None
        rows: list[dict[str, Any]] = []
        echo = asyncio.create_task(_echo_worker(coordinator.url))
        try:
            legit = await _open(coordinator.url)
            await _latencies(legit, ns.requests)  # warm-up
            for kind in (*NEIGHBOURS, *COST_NEIGHBOURS):
                if kind in phases:
                    try:
                        rows.append(await _interleaved(legit, coordinator, coordinator.url, kind, ns, kind))
                    except ProcessLookupError:  # the neighbour died: say so, go on with the next phase
                        rows.append({"neighbour": kind, "error": "the neighbour process exited (see its traceback)"})
                        continue
                    if other is not None:
                        rows.append(await _interleaved(legit, coordinator, other.url, kind, ns, f"{kind} elsewhere"))
            if "slowloris" in phases:
                rows.append(await _slowloris(legit, coordinator.url, ns.requests))
            rows += await _data_phases(legit, coordinator, ns, phases, metrics_target)
            await legit.close()
            if "slow" in phases:
                rows.append(await _stream(coordinator.url, coordinator.ps, "reading", reads=True))
                rows.append(await _stream(coordinator.url, coordinator.ps, "slow", reads=False))
        finally:
            echo.cancel()
            await coordinator.stop()
            if other is not None:
                await other.stop()
    return rows


async def _data_neighbour(ns: argparse.Namespace) -> None:
    """Issue 24's data-plane neighbours (bench/_hostile_data.py), in this child process."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    tally = data_phases.Tally()
    token = TOKENS["hostile"][1]
    if ns.neighbour == "relay-hog":
        await data_phases.relay_hog(ns.url, token, tally, ns.hog_streams, ns.upload_bytes)
    elif ns.neighbour == "data-cancelled-flood":
        await data_phases.cancelled_flood(ns.url, token, tally, ns.flood_uploads, ns.upload_bytes)
    else:
        await data_phases.idle_sockets(ns.url, tally, ns.idle_sockets)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000, help="round trips per chunk (default 2000)")
    parser.add_argument("--rounds", type=int, default=3, help="hostile chunks per neighbour, each between "
                                                               "two baseline chunks (default 3)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--flood-grace", type=float, default=1.0, help="the coordinator's --flood-grace (default 1)")
    parser.add_argument("--penalty", type=float, default=None,
                        help="the coordinator's --penalty-base (0: no penalty box; default: its default)")
    parser.add_argument("--control", action="store_true",
                        help="also aim each neighbour at a second coordinator (what sharing the machine costs)")
    parser.add_argument("--neighbour-retry", choices=("now", "retry-after"), default="now",
                        help="after HTTP 429: reconnect at once (default) or honour Retry-After")
    parser.add_argument("--neighbour-nice", type=int, default=0, help="run the neighbours under nice -n N")
    parser.add_argument("--neighbour-cpu", type=int, default=None, help="pin the neighbours to this CPU (taskset)")
    parser.add_argument("--pin", action="store_true",
                        help="pin the coordinators and the measuring client to CPU 0 and the neighbours to CPU 1, "
                             "as if the neighbour ran on its own host")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the coordinator during each hostile chunk (and "
                        "the first baseline one) into DIR/<phase>-<chunk>.txt; read with bench/profile_top.py")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="seconds a cost-model neighbour (f1..f11) runs before it is measured (default 5)")
    parser.add_argument("--uploads", type=int, default=100,
                        help="legitimate 1 MiB uploads per chunk in the data phases (default 100)")
    parser.add_argument("--upload-bytes", type=int, default=1 << 20, help="their size (default 1048576)")
    parser.add_argument("--upload-timeout", type=float, default=30.0,
                        help="a legitimate upload with no result this long counts as failed, timed at that "
                             "(default 30)")
    parser.add_argument("--idle-sockets", type=int, default=1_200,
                        help="idle sockets of data-idle-sockets and metrics-idle-sockets (default 1200)")
    parser.add_argument("--flood-uploads", type=int, default=1_200,
                        help="cancelled plans whose tickets data-cancelled-flood uploads with (default 1200)")
    parser.add_argument("--hog-streams", type=int, default=4, help="relayed streams the relay hog holds (default 4)")
    parser.add_argument("--ready-timeout", type=float, default=120.0,
                        help="seconds a data neighbour gets to put its load in place before it is measured anyway "
                             "(default 120)")
    parser.add_argument("--neighbour", choices=(*NEIGHBOURS, *COST_NEIGHBOURS, *data_phases.PHASES),
                        help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if ns.neighbour is not None:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # its tally lines are already flushed
        if ns.neighbour in data_phases.PHASES:
            asyncio.run(_data_neighbour(ns))
        elif ns.neighbour in COST_NEIGHBOURS:
            asyncio.run(_cost_neighbour(ns.neighbour, ns.url))
        else:
            asyncio.run(_flood(ns.url, ns.neighbour_retry) if ns.neighbour == "flood"
                        else _oversize(ns.url, ns.neighbour_retry))
        return 0
    if ns.pin:
        os.sched_setaffinity(0, {0})
        if ns.neighbour_cpu is None:
            ns.neighbour_cpu = 1
    rows = asyncio.run(run(ns))
    if ns.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        if "delta_p99_pct" in row:
            timing = (f"p99 {row['p99_ms']} ms vs {row['baseline_p99_ms']} ms baseline: "
                      f"Δ {row['delta_p99_pct']:+.1f} %")
            if "delta_p99_pct_range" in row:
                lo, hi = row["delta_p99_pct_range"]
                timing += (f" (rounds {lo:+.1f}..{hi:+.1f} %; baseline p99 "
                           f"{_spread(row['baseline_p99_ms_range'])} ms)")
        else:
            timing = ""
        skip = {"neighbour", "p50_ms", "p99_ms", "baseline_p99_ms", "delta_p99_pct", "delta_p99_pct_range",
                "baseline_p99_ms_range"}
        extra = {k: v for k, v in row.items() if k not in skip}
        print(f"{row['neighbour']:<20} {timing}\n{'':<20} {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
