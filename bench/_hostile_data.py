"""The data-plane and relay neighbours of bench/hostile_neighbors.py (issue #24), and the workers they aim at.

Neighbours (each a child process, run with ``hostile_neighbors.py --neighbour KIND``):

* ``relay-hog`` (#24 part 4): a client that keeps ``--hog-streams`` (4) relayed input streams open
  and never sends a byte: it submits plans with a 1 MiB input for the relay-only worker, opens
  each input's stream when its ``data_ready`` comes, opens it again whenever it ends (the
  coordinator's ``--relay-idle``), and submits a new plan when one ends.
* ``data-idle-sockets`` / ``metrics-idle-sockets`` (#24 (a), (b)): ``--idle-sockets`` (1,200)
  token-less TCP connections that never send a byte, at a worker's data endpoint or at the
  coordinator's ``--metrics-listen``, each reopened when dropped.
* ``data-cancelled-flood`` (#24 (c)): ``--flood-uploads`` (1,200) plans with a 1 MiB input are
  submitted and cancelled as soon as their ``data_ready`` (the ticket) comes; then 1 MiB ``PUT`` s
  with those tickets go to the worker's data endpoint, 32 at a time, over and over.

Each prints a JSON line (attempts, closes, refused, ``ready``) a few times a second;
``ready`` turns true once its load is in place (every stream answered, every socket tried,
every ticket collected). :class:`DataFleet` starts the two ``fleetwire worker`` processes the
data phases use (``bench-relay``: tag ``relay``, no data endpoint; ``bench-data``: tag ``data``,
``--data-listen``), and :func:`uploads` times a legitimate client's 1 MiB uploads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("relay-hog", "data-idle-sockets", "metrics-idle-sockets", "data-cancelled-flood")
RESTARTED = frozenset({"relay-hog", "data-idle-sockets", "metrics-idle-sockets"})
"""Neighbours whose harm is what they hold (streams, sockets): a paused one would still hold it, so the
baseline chunks run with the process ended, not paused."""
FAKE_DIGEST = "blake3:" + "0" * 64  # the hog and the flood never send a whole input: no digest is checked
TERMINAL = ("succeeded", "failed", "cancelled")


class Tally:
    """What a neighbour did, printed as a JSON line at most every 0.2 s (and once ready)."""

    def __init__(self) -> None:
        self.attempts = 0
        self.closes: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.ready = False
        self.extra: dict[str, Any] = {}
        self._printed = 0.0

    def count(self, into: dict[str, int], key: str) -> None:
        into[key] = into.get(key, 0) + 1
        self.print()

    def print(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._printed >= 0.2:
            self._printed = now
            print(json.dumps({"attempts": self.attempts, "closes": self.closes, "refused": self.refused,
                              "ready": self.ready, **self.extra}), flush=True)

    async def keep_printing(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.print(force=True)


def free_port() -> int:
    """A TCP port free on loopback now (for ``--data-listen`` and ``--metrics-listen``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _msgs(frame: Any) -> list[dict[str, Any]]:
    decoded = msgspec.msgpack.decode(frame)
    return decoded if isinstance(decoded, list) else [decoded]


async def _client(url: str, token: str) -> ClientConnection:
    while True:
        try:
            return await connect(f"{url}/v1/client", additional_headers={"Authorization": f"Bearer {token}"},
                                 subprotocols=["fleetwire.v1.msgpack"], compression=None,  # type: ignore[list-item]
                                 max_size=None)
        except (InvalidStatus, OSError) as exc:  # the penalty box an earlier phase's neighbour left: wait it out
            print(json.dumps({"note": f"connect: {exc}"}), file=sys.stderr)
            await asyncio.sleep(1)


# ---------------------------------------------------------------------------- neighbours


async def relay_hog(url: str, token: str, tally: Tally, streams: int, size: int) -> None:
    """Keep ``streams`` relayed input streams open, never sending (see the module docstring)."""
    ws = await _client(url, token)
    printer = asyncio.create_task(tally.keep_printing())
    req, ids = itertools.count(1), itertools.count(1)
    spec = {"name": "data", "size": size, "digest": FAKE_DIGEST}
    tickets: dict[str, tuple[int, str]] = {}  # plan id -> (attempt, put ticket)
    open_ids: dict[str, int] = {}  # plan id -> its stream's id now
    answered: dict[str, str] = {}  # plan id -> "held" or "waiting"

    async def submit(n: int) -> None:
        await ws.send(msgspec.msgpack.encode([{"type": "submit", "req_id": next(req), "op": "echo",
                                               "requirements": {"tags": ["relay"]}, "inputs": [spec]}
                                              for _ in range(n)]))

    async def open_stream(plan_id: str) -> None:
        attempt, ticket = tickets[plan_id]
        open_ids[plan_id] = stream = next(ids)
        answered.pop(plan_id, None)
        tally.attempts += 1
        await ws.send(msgspec.msgpack.encode({"type": "data_open", "plan_id": plan_id, "attempt": attempt,
                                              "name": "data", "ticket": ticket, "stream": stream}))

    await submit(streams)
    try:
        while True:
            for msg in _msgs(await ws.recv()):
                kind, plan_id = msg.get("type"), msg.get("plan_id", "")
                if kind == "event" and msg.get("kind") == "data_ready":
                    tickets[plan_id] = (msg["data"]["attempt"], msg["data"]["ticket"])
                    await open_stream(plan_id)
                elif kind == "event" and msg.get("kind") in TERMINAL and plan_id in tickets:
                    del tickets[plan_id]
                    open_ids.pop(plan_id, None)
                    answered.pop(plan_id, None)
                    await submit(1)
                elif kind == "data_credit" and msg.get("stream") == open_ids.get(plan_id):
                    answered[plan_id] = "waiting" if msg.get("wait") else "held"
                elif kind == "data_end" and msg.get("stream") == open_ids.get(plan_id):
                    tally.count(tally.closes, str(msg.get("code") or "ok"))
                    if plan_id in tickets:
                        await open_stream(plan_id)  # at once: a hog does not back off
            states = list(answered.values())
            tally.extra = {"held": states.count("held"), "waiting": states.count("waiting")}
            if len(states) >= streams and not tally.ready:
                tally.ready = True
                tally.print(force=True)
    finally:
        printer.cancel()


async def idle_sockets(target: str, tally: Tally, n: int) -> None:
    """``n`` token-less TCP connections to ``target`` (host:port) that never send a byte, each reopened when
    dropped; ready once each was tried."""
    host, port = target.rsplit(":", 1)
    tried = 0
    live = 0
    printer = asyncio.create_task(tally.keep_printing())

    async def hold() -> None:
        nonlocal tried, live
        first = True
        while True:
            connected: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
            try:
                connected = await asyncio.open_connection(host, int(port))
            except OSError as exc:
                tally.attempts += 1
                tally.count(tally.refused, type(exc).__name__)
                await asyncio.sleep(0.05)
            if first:
                first = False
                tried += 1
                if tried == n:
                    tally.ready = True
            if connected is None:
                continue
            reader, writer = connected
            tally.attempts += 1
            live += 1
            tally.extra = {"live": live}
            with contextlib.suppress(OSError):
                await reader.read()  # until the server drops it
            live -= 1
            tally.extra = {"live": live}
            writer.close()
            tally.count(tally.closes, "dropped")

    try:
        await asyncio.gather(*(hold() for _ in range(n)))
    finally:
        printer.cancel()


async def cancelled_flood(url: str, token: str, tally: Tally, uploads: int, size: int, concurrency: int = 32) -> None:
    """1 MiB ``PUT`` s with the tickets of ``uploads`` cancelled plans, ``concurrency`` at a time, over and over."""
    ws = await _client(url, token)
    printer = asyncio.create_task(tally.keep_printing())
    spec = {"name": "data", "size": size, "digest": FAKE_DIGEST}
    for first in range(0, uploads, 200):
        await ws.send(msgspec.msgpack.encode([{"type": "submit", "req_id": i + 1, "op": "echo",
                                               "requirements": {"tags": ["data"]}, "inputs": [spec]}
                                              for i in range(first, min(uploads, first + 200))]))
    tickets: list[tuple[str, str, int, str]] = []  # (data url, plan id, attempt, ticket)
    with contextlib.suppress(TimeoutError):
        while len(tickets) < uploads:
            for msg in _msgs(await asyncio.wait_for(ws.recv(), 30)):
                if msg.get("type") == "event" and msg.get("kind") == "data_ready":
                    data = msg["data"]
                    tickets.append((data["url"], msg["plan_id"], data["attempt"], data["ticket"]))
                    await ws.send(msgspec.msgpack.encode({"type": "cancel", "plan_id": msg["plan_id"],
                                                          "req_id": len(tickets)}))
    tally.extra = {"tickets": len(tickets)}
    tally.ready = True
    tally.print(force=True)
    body = bytes(size)
    gate = asyncio.Semaphore(concurrency)

    async def put(data_url: str, plan_id: str, attempt: int, ticket: str) -> None:
        host, port = data_url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
        async with gate:
            tally.attempts += 1
            writer = None
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"PUT /v1/data/{plan_id}/{attempt}/inputs/data HTTP/1.1\r\nHost: {host}:{port}\r\n"
                             f"Authorization: Bearer {ticket}\r\nContent-Length: {size}\r\n\r\n".encode())
                with contextlib.suppress(OSError):  # refused from its head: the body may be cut off
                    writer.write(body)
                    await writer.drain()
                status = (await asyncio.wait_for(reader.readline(), 30)).split(b" ")
                tally.count(tally.closes, status[1].decode() if len(status) > 1 else "none")
            except (OSError, TimeoutError) as exc:
                tally.count(tally.refused, type(exc).__name__)
            finally:
                if writer is not None:
                    writer.close()

    try:
        while tickets:
            await asyncio.gather(*(put(*ticket) for ticket in tickets))
    finally:
        printer.cancel()


# ---------------------------------------------------------------------------- the measuring side


class DataFleet:
    """The two ``fleetwire worker`` processes of the data phases (see the module docstring)."""

    def __init__(self, procs: dict[str, asyncio.subprocess.Process], data_url: str) -> None:
        self.procs = procs
        self.data_url = data_url
        self.data_ps = psutil.Process(procs["bench-data"].pid)

    @classmethod
    async def start(cls, url: str, token: str, client: Any, cpu: int | None) -> DataFleet:
        port = free_port()
        pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
        common = [sys.executable, "-m", "fleetwire", "worker", "--url", url, "--max-concurrency", "64",
                  "--log-level", "error"]
        env = {**os.environ, "FLEETWIRE_WORKER_TOKEN": token}

        async def worker(*argv: str) -> asyncio.subprocess.Process:
            return await asyncio.create_subprocess_exec(*pin, *common, *argv, cwd=ROOT, env=env,
                                                        stdout=asyncio.subprocess.DEVNULL)

        procs = {
            "bench-relay": await worker("--id", "bench-relay", "--tags", "relay"),
            "bench-data": await worker("--id", "bench-data", "--tags", "data", "--data-listen", f"127.0.0.1:{port}"),
        }
        deadline = time.monotonic() + 60
        while True:
            listing = await client.workers()
            alive = {w.id for w in listing.workers if w.alive}
            if {"bench-relay", "bench-data"} <= alive:
                return cls(procs, f"http://127.0.0.1:{port}")
            if time.monotonic() > deadline or any(p.returncode is not None for p in procs.values()):
                raise RuntimeError(f"the bench's data workers did not register (alive: {sorted(alive)})")
            await asyncio.sleep(0.2)

    def rss(self) -> int:
        return int(self.data_ps.memory_info().rss)

    async def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in self.procs.values():
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def uploads(client: Any, n: int, size: int, *, relay: bool, failures: dict[str, int] | None = None,
                  timeout_s: float = 30.0) -> list[float]:
    """``n`` plans one at a time, each with a ``size``-byte input, timed from submit to result (the upload in it):
    relayed to ``bench-relay`` (``relay``) or direct to ``bench-data``. A plan that has no result within
    ``timeout_s`` (its upload refused or stuck) is cancelled, counted in ``failures`` by its error and timed as
    ``timeout_s``: a failed upload weighs in the p99 as the wait it cost."""
    data = os.urandom(size)
    out = []
    clock = time.perf_counter
    for i in range(n):
        start = clock()
        plan = await client.submit("echo", args=i, inputs={"data": data}, tags=["relay" if relay else "data"],
                                   relay=relay)
        try:
            await asyncio.wait_for(plan.result(), timeout_s)
            out.append(clock() - start)
        except Exception as exc:  # a bench counts what went wrong and goes on
            if failures is None:
                raise
            uploading = getattr(plan.uploads, "task", None)
            cause = uploading.exception() if uploading is not None and uploading.done() else None
            key = type(cause or exc).__name__ + (f": {cause}"[:120] if cause else "")
            failures[key] = failures.get(key, 0) + 1
            out.append(max(clock() - start, timeout_s))
            with contextlib.suppress(Exception):
                await client.cancel(plan.id)
    return out
