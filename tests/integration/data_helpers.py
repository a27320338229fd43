"""What the data-plane tests share: a worker's data endpoint on loopback, its keys, a random input file, and a
coordinator with one agent that has a data endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from coordinator.core import CoreConfig
from coordinator.io.frontdoor.server import CoordinatorServer, ServerSettings
from fleetwire.data import Grant
from protocol.messages import DataKey
from protocol.tickets import DIGEST_DEFAULT, FileClaim, TicketClaims, new_hasher_of, sign, worker_key
from worker_agent.agent import Agent
from worker_agent.dataplane import BODY_CHUNK, DataServer
from worker_agent.handlers import Handler
from worker_agent.spool import Spool

MASTER = b"f" * 32  # the coordinator's ticket key
WORKER = "w1"
SIZE = 2 * BODY_CHUNK + 12345  # two whole chunks and a remainder


def digest(data: bytes) -> str:
    """The digest the SDK declares for an input of ``data`` (and a worker reports for an output): blake3."""
    hasher = new_hasher_of(DIGEST_DEFAULT)
    hasher.update(data)
    return f"{DIGEST_DEFAULT}:{hasher.hexdigest()}"


def grant(url: str, name: str, size: int, digest: str, direction: str = "put", *, key: bytes = MASTER) -> Grant:
    """Where and how to move ``name`` of plan p1 attempt 1 on worker :data:`WORKER` (``size`` -1 and ``digest``
    "": not declared), signed with ``key``: its ticket for both directions' fields."""
    claims = TicketClaims("p1", 1, WORKER, direction, {name: FileClaim(size, digest)},  # type: ignore[arg-type]
                          time.time() + 60)
    ticket = sign(claims, "k1", worker_key(key, WORKER))
    return Grant("p1", 1, url, ticket, ticket)


@contextlib.asynccontextmanager
async def data_endpoint(tmp_path: Path, stall_timeout_s: float = 2.0) -> AsyncIterator[DataServer]:
    """A started data endpoint of worker :data:`WORKER` (spool under ``tmp_path``) that trusts :data:`MASTER`."""
    server = DataServer(Spool(tmp_path / "spool", memory_bytes=1024), worker_id=WORKER, stall_timeout_s=stall_timeout_s)
    server.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def random_input(tmp_path: Path, size: int = SIZE) -> tuple[Path, bytes]:
    """A file of ``size`` random bytes and its bytes."""
    data = os.urandom(size)
    path = tmp_path / "input.bin"
    path.write_bytes(data)
    return path, data


WORKER_TOKEN = "w-secret"
CLIENT_TOKEN = "c-secret"


@contextlib.asynccontextmanager
async def coordinator_and_data_worker(
    tmp_path: Path, handlers: Mapping[str, Handler], *, server_options: dict[str, Any] | None = None,
    **agent_options: Any,
) -> AsyncIterator[tuple[CoordinatorServer, Agent]]:
    """A coordinator on loopback (tokens :data:`WORKER_TOKEN`, :data:`CLIENT_TOKEN`; more ``ServerSettings`` in
    ``server_options``) and a registered agent ``w1``, its spool under ``tmp_path``, serving ``handlers``
    (op -> handler). ``agent_options`` go to the agent: by default it has a data endpoint and a 5 s input
    timeout; ``data_listen=None``: none (the relay carries its bytes)."""
    server = CoordinatorServer(ServerSettings(
        port=0, worker_tokens=(WORKER_TOKEN,), client_tokens=(CLIENT_TOKEN,),
        core=CoreConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0), reaper_interval_s=0.1,
        **(server_options or {}),
    ))  # fmt: skip
    await server.start()
    options = {"data_listen": "127.0.0.1:0", "input_timeout_s": 5.0, **agent_options}
    agent = Agent(server.url, WORKER_TOKEN, worker_id=WORKER, spool_dir=str(tmp_path / "spool"), **options)
    for op, handler in handlers.items():
        agent.add_handler(op, handler)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.registered.wait(), 10)
        yield server, agent
    finally:
        agent.stop()
        agent.stop()  # a second stop: no drain (what a test left running is not waited for)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await server.stop()


def python_reverse(suffix: str, *, inputs: Any, ctx: Any) -> dict[str, Any]:
    """A function for the ``python`` op (``tests.*`` allowed): its inputs come as ``inputs``, its output goes
    through ``ctx.output``; runs in a worker thread."""
    data = inputs["data"].path.read_bytes()
    ctx.output("reversed", data[::-1] + suffix.encode())
    return {"names": sorted(inputs), "size": inputs["data"].size, "digest": inputs["data"].digest}
