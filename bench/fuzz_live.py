"""Fuzz a live coordinator over real sockets: hostile frames in, crashes and state violations counted.

    python bench/fuzz_live.py --inputs 100000 [--json] [--seed 1] [--connections 8]

A coordinator (the real ``CoordinatorServer``, token auth on) listens on a loopback port in
this process; ``--connections`` worker and client sessions (msgpack and JSON) send it
frames made by a seeded generator: random bytes, valid frames with bits flipped, cut or
spliced, well-typed messages with wrong, missing or extra fields, messages of the other
role, other workers' leases, nesting past the decoder's depth, integers msgpack cannot
carry, and the odd oversize frame. A session the coordinator closes (4400, 4403, 1009,
...) is replaced by a new one. Every input is one frame.

Counted as a **crash**: an exception that reached the coordinator's own safety nets (an
``internal`` error answered, a writer that could not encode, a failed reaper tick), an
unhandled exception in any task, a websockets handler failure, or the coordinator not
answering a probe within 5 s. Counted as a **state violation**: a rule of
``coordinator.audit.violations`` broken, checked every 500 inputs and at the end.

Prints ``inputs tried / crashes / state violations`` and the close codes seen. This is a
benchmark, not a test (docs/OPERATIONS.md §Test matrix row 18 asks for 10^5 inputs and 0 crashes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from coordinator.audit import violations
from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from coordinator.limits import Limits
from protocol.messages import ALL_MESSAGE_TYPES, FromClient, FromWorker, type_name, type_names

WORKER_TOKEN, CLIENT_TOKEN = "fuzz-worker-token", "fuzz-client-token"
TYPES = [type_name(cls) for cls in ALL_MESSAGE_TYPES]
SENT_BY = {"worker": sorted(type_names(FromWorker)), "client": sorted(type_names(FromClient))}
PLAN_IDS = ["p1", "p2", "p3", "job", "", "x" * 300]
WORKER_IDS = ["w1", "w2", "w3", ""]
CRASH_EVENTS = ("core failed on a message", "cannot send to a session; closing it", "reaper tick failed")


class Generator:
    """Seeded hostile frames: each call returns (kind, frame) for a session of ``role`` and ``encoding``."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.valid: list[bytes] = []  # frames that decoded once: material to mutate

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        pick = rng.randrange(10 if depth < 3 else 6)
        if pick == 0:
            return None
        if pick == 1:
            return rng.choice([True, False])
        if pick == 2:
            return rng.choice([0, -1, 1, 2**31, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
        if pick == 3:
            return rng.choice([0.5, float("nan"), float("inf"), -0.0, 1e308])
        if pick == 4:
            return rng.choice(["", "a", "é", "\u0000", "running", "x" * rng.randrange(64)])
        if pick == 5:
            return rng.randbytes(rng.randrange(16))
        if pick in (6, 7):
            return [self.value(depth + 1) for _ in range(rng.randrange(4))]
        keys: list[Any] = ["a", "type", "plan_id", 1, -5, 2.5]
        return {rng.choice(keys): self.value(depth + 1) for _ in range(rng.randrange(4))}

    def message(self, role: str) -> dict[str, Any]:
        rng = self.rng
        # Mostly the role's own types, so sessions live long enough to reach deep states; a message
        # of the other role closes the session (4403) and a new one takes its place.
        own = SENT_BY[role] if rng.random() < 0.995 else [*TYPES, "", "HELLO", "nope"]
        mtype = rng.choice(own)
        if mtype == "goodbye" and rng.random() < 0.98:  # it ends the session (1000): keep it rare
            mtype = "heartbeat"
        msg: dict[str, Any] = {"type": mtype}
        fields = {
            "req_id": lambda: rng.choice([0, 1, 2, -1, 2**40]),
            "plan_id": lambda: rng.choice(PLAN_IDS),
            "attempt": lambda: rng.randrange(-1, 4),
            "worker_id": lambda: rng.choice(WORKER_IDS),
            "op": lambda: rng.choice(["echo", "echo", "echo", "", "sleep"]),
            "kind": lambda: rng.choice(["log", "running", "succeeded", "tok"]),
            "outcome": lambda: rng.choice(["succeeded", "failed", "cancelled", "boom"]),
            "capabilities": lambda: {"ops": rng.sample(["echo", "sleep"], rng.randrange(3)),
                                     "max_concurrency": rng.randrange(-1, 4)},
            "running": lambda: [{"plan_id": rng.choice(PLAN_IDS), "attempt": rng.randrange(3)}],
            "plan_ids": lambda: rng.sample(PLAN_IDS, rng.randrange(3)),
            "all": lambda: rng.choice([True, False]),
            "from_seq": lambda: rng.randrange(-1, 8),
            "max_attempts": lambda: rng.choice([1, 2, 3, 3, 0, -1]),
            "timeout_s": lambda: rng.choice([None, None, None, 1.0, 0.0, -1.0, float("nan")]),
            "priority": lambda: rng.randrange(-2, 3),
            "subscribe": lambda: rng.choice([True, False]),
            "ephemeral": lambda: rng.choice([True, False]),
        }
        wanted = [name for name in sorted(fields) if rng.random() < 0.6]
        for name in wanted:
            msg[name] = fields[name]() if rng.random() < 0.9 else self.value()
        for name in ("args", "data", "result"):
            if rng.random() < 0.3:
                msg[name] = self.value()
        return msg

    def frame(self, role: str, encoding: str) -> tuple[str, bytes | str]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.10:
            return "random-bytes", rng.randbytes(rng.randrange(1, 200))
        if roll < 0.13:
            return "random-text", "".join(chr(rng.randrange(1, 0x2FF)) for _ in range(rng.randrange(1, 80)))
        if roll < 0.30 and self.valid:
            return "mutated", self.mutate(rng.choice(self.valid))
        if roll < 0.31:
            return "deep", b"\x91" * rng.randrange(900, 5000) + b"\xc0"
        if roll < 0.311:
            return "oversize", b"\x00" * ((1 << 20) + 1)
        if roll < 0.33 and encoding == "json":
            return "big-int", json.dumps({"type": "submit", "req_id": 1, "op": "echo", "args": 10**30})
        msgs = [self.message(role) for _ in range(rng.choice([1, 1, 1, 2, 5]))]
        payload: Any = msgs[0] if len(msgs) == 1 else msgs
        try:
            if encoding == "json":
                frame: bytes | str = msgspec.json.encode(payload).decode()
            else:
                frame = msgspec.msgpack.encode(payload)
        except (TypeError, OverflowError):
            return "random-bytes", rng.randbytes(8)
        if len(self.valid) < 500 and isinstance(frame, bytes):
            self.valid.append(frame)
        return "structured", frame

    def mutate(self, frame: bytes) -> bytes:
        rng = self.rng
        data = bytearray(frame)
        for _ in range(rng.randrange(1, 4)):
            op = rng.randrange(3)
            if op == 0 and data:
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            elif op == 1 and data:
                del data[rng.randrange(len(data)):]
            else:
                data[rng.randrange(len(data) + 1):0] = rng.randbytes(rng.randrange(1, 8))
        return bytes(data) or b"\xc1"


class Crashes:
    """Counts every sign that an exception escaped a handler (structlog, stdlib logging, the loop)."""

    def __init__(self) -> None:
        self.count = 0
        self.samples: list[str] = []

    def add(self, what: str) -> None:
        self.count += 1
        if len(self.samples) < 5:
            self.samples.append(what[:500])

    def structlog_processor(self, logger: Any, method: str, event: dict[str, Any]) -> Any:
        if event.get("event") in CRASH_EVENTS or method in ("error", "critical", "exception"):
            self.add(f"{event.get('event')}: {event.get('exc_info') or event}")
        raise structlog.DropEvent  # the fuzzer's own output stays readable


class _Handler(logging.Handler):
    def __init__(self, crashes: Crashes) -> None:
        super().__init__(logging.ERROR)
        self.crashes = crashes

    def emit(self, record: logging.LogRecord) -> None:
        self.crashes.add(f"{record.name}: {record.getMessage()} {record.exc_info!r}")


async def _session(url: str, role: str, encoding: str) -> ClientConnection:
    token = WORKER_TOKEN if role == "worker" else CLIENT_TOKEN
    ws = await connect(f"{url}/v1/{role}", additional_headers={"Authorization": f"Bearer {token}"},
                       subprotocols=[f"fleetwire.v1.{encoding}"], compression=None,  # type: ignore[list-item]
                       max_size=None, open_timeout=5)
    if role == "worker":  # a registered worker meets the assign/lease paths
        hello = {"type": "hello", "worker_id": f"w{random.randrange(1, 4)}",
                 "capabilities": {"ops": ["echo"], "max_concurrency": 2}}
        await ws.send(msgspec.msgpack.encode(hello) if encoding == "msgpack" else msgspec.json.encode(hello).decode())
    return ws


async def _drain(ws: ClientConnection) -> None:
    with contextlib.suppress(ConnectionClosed):
        async for _ in ws:
            pass


async def _fuzz_connection(url: str, role: str, encoding: str, gen: Generator, left: Any,
                           stats: Counter[str]) -> None:
    """Send frames on one session after another until the coordinator has read enough of them."""
    while left() > 0:
        try:
            ws = await _session(url, role, encoding)
        except (OSError, InvalidStatus, TimeoutError) as exc:
            stats[f"connect failed: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)
            continue
        reader = asyncio.create_task(_drain(ws))
        try:
            sent = 0
            while left() > 0:
                kind, frame = gen.frame(role, encoding)
                stats[f"input:{kind}"] += 1
                await ws.send(frame)
                sent += 1
                if sent % 16 == 0:
                    # A ping answered means everything before it was read: at most 16 frames are in
                    # flight, so few inputs land in a session the coordinator is already closing.
                    await asyncio.wait_for(await ws.ping(), 10)
        except (ConnectionClosed, TimeoutError):
            pass
        except AttributeError:  # websockets' client aborting a transport the server already closed
            stats["client-side abort after close"] += 1
        with contextlib.suppress(AttributeError):
            await ws.close()
        await reader
        stats[f"close:{ws.close_code}"] += 1


async def _probe(url: str) -> bool:
    """Whether the coordinator answers a list_workers within 5 s."""
    try:
        async with asyncio.timeout(5):
            ws = await _session(url, "client", "msgpack")
            await ws.send(msgspec.msgpack.encode({"type": "list_workers", "req_id": 99}))
            while True:
                reply = msgspec.msgpack.decode(await ws.recv())
                if isinstance(reply, dict) and reply.get("req_id") == 99:
                    await ws.close()
                    return True
    except (TimeoutError, OSError, ConnectionClosed, InvalidStatus):
        return False


async def run(inputs: int, seed: int, connections: int) -> dict[str, Any]:
    crashes = Crashes()
    structlog.configure(processors=[crashes.structlog_processor], cache_logger_on_first_use=False)
    ws_logger = logging.getLogger("websockets")
    ws_logger.setLevel(logging.ERROR)
    ws_logger.addHandler(_Handler(crashes))
    ws_logger.propagate = False
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: crashes.add(f"loop: {context.get('message')} "
                                                             f"{context.get('exception')!r}"))
    server = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,), store="memory",
        core=CoreConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0, max_plans_per_client=2_000),
        # Rate limits off: the fuzzer is one very fast peer per connection, not a flood test. The
        # penalty box off: every replacement session must reach the core (and the probe, which
        # holds the same client token, must never be refused 429).
        limits=Limits(worker_rate=0, client_rate=0, penalty_base_s=0),
    ))
    await server.start()
    handled: Counter[str] = Counter()
    core_receive = server.core.receive

    def receive(conn_id: int, msg: Any, now: float) -> None:
        # Count what reached an open session of the core: the inputs that exercised its logic.
        session = server.core.sessions.get(conn_id)
        handled["open" if session is not None and not session.closing else "closing"] += 1
        core_receive(conn_id, msg, now)

    server.core.receive = receive  # type: ignore[method-assign]
    gen = Generator(seed)
    counters = server.frames.by_role

    def received() -> int:
        """Frames the coordinator has read: the inputs that count (one sent into a closing session does not)."""
        return sum(c[0] for c in counters.values())

    stats: Counter[str] = Counter()
    violations_seen: list[str] = []
    unresponsive = 0
    started = time.perf_counter()
    kinds = [("worker", "msgpack"), ("client", "msgpack"), ("worker", "json"), ("client", "json")]
    probes = 0

    def left() -> int:
        return inputs + probes - received()

    tasks = [asyncio.create_task(_fuzz_connection(server.url, *kinds[i % len(kinds)], gen, left, stats))
             for i in range(connections)]
    next_check, next_probe = 500, 5000
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.01)
        if received() >= next_check:
            next_check += 500
            found = violations(server.core)
            if found and len(violations_seen) < 20:
                violations_seen.extend(found[:5])
        if received() >= next_probe:
            next_probe += 5000
            probes += 1  # the probe's own frame is not an input
            if not await _probe(server.url):
                unresponsive += 1
    for task in tasks:
        if task.exception() is not None:
            crashes.add(f"fuzzer task: {task.exception()!r}")
    elapsed = time.perf_counter() - started
    tried = received() - probes
    if not await _probe(server.url):
        unresponsive += 1
    violations_seen.extend(violations(server.core))
    await server.stop()
    return {
        "inputs": tried,
        "frames_sent": sum(v for k, v in stats.items() if k.startswith("input:")),
        "messages_on_open_sessions": handled["open"],
        "messages_on_closing_sessions": handled["closing"],
        "crashes": crashes.count + unresponsive,
        "state_violations": len(violations_seen),
        "unresponsive_probes": unresponsive,
        "elapsed_s": round(elapsed, 1),
        "inputs_per_s": round(tried / elapsed) if elapsed else None,
        "inputs_by_kind": {k.removeprefix("input:"): v for k, v in sorted(stats.items()) if k.startswith("input:")},
        "closes_by_code": {k.removeprefix("close:"): v for k, v in sorted(stats.items()) if k.startswith("close:")},
        "plans": len(server.core.plans),
        "workers": len(server.core.registry),
        "crash_samples": crashes.samples,
        "violation_samples": violations_seen[:5],
        "seed": seed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=100_000, help="frames to send (default 100000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--connections", type=int, default=8, help="concurrent fuzzing sessions (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args()
    result = asyncio.run(run(ns.inputs, ns.seed, ns.connections))
    if ns.json:
        print(json.dumps(result))
    else:
        print(f"inputs tried: {result['inputs']}  crashes: {result['crashes']}  "
              f"state violations: {result['state_violations']}")
        print(f"  {result['elapsed_s']} s, {result['inputs_per_s']} inputs/s; seed {result['seed']}; "
              f"{result['frames_sent']} frames sent, {result['inputs']} read by the coordinator")
        print(f"  messages the core handled on open sessions: {result['messages_on_open_sessions']}, "
              f"dropped on closing ones: {result['messages_on_closing_sessions']}; "
              f"end state: {result['plans']} plans, {result['workers']} workers")
        print(f"  inputs by kind: {result['inputs_by_kind']}")
        print(f"  sessions closed by code: {result['closes_by_code']}")
        for sample in result["crash_samples"] + result["violation_samples"]:
            print(f"  ! {sample}")
    return 0 if result["crashes"] == 0 and result["state_violations"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
