"""What the data-endpoint tests share: a worker's data endpoint on loopback, its keys, a random input file."""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from protocol.messages import DataKey
from protocol.tickets import worker_key
from worker_agent.dataplane import BODY_CHUNK, DataServer
from worker_agent.spool import Spool

MASTER = b"f" * 32  # the coordinator's ticket key
WORKER = "w1"
SIZE = 2 * BODY_CHUNK + 12345  # two whole chunks and a remainder


def digest(data: bytes) -> str:
    """The digest an input of ``data`` is declared with."""
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


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
