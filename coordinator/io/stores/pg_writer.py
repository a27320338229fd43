"""The PostgreSQL store's group commits in a child process with its own connection: :class:`ProcessCommitter`.

Why. A PostgreSQL coordinator's loop spends ~10-15 µs a plan encoding each group's rows (msgpack, CRC-32,
tuples: PgStore._encode_rows) and ~5.5 µs in asyncpg (docs/PERFORMANCE.md §C29c). The child
(coordinator/io/stores/pg_writer_child.py) does both on a core of its own; the loop encodes each group once
(coordinator/io/stores/writer_wire.py ``encode_group``, as for the SQLite writer child), writes it to the pipe and
reads "committed" / "failed" back.

Theory of operation. The same contract as :class:`~coordinator.io.stores.pg_commit.PipelinedCommitter`
(``submit``, ``after``, ``drained``, ``close``): payloads are released in submit order once their batch and every
earlier one committed. Each batch is one request, written at once (what the pipe has no room for goes by
``add_writer``, in order); the child commits them in order through its own PipelinedCommitter (grouped, encoded
ahead, one statement a group) and answers each commit with how many batches it held; the loop reads the replies
(``add_reader``) and releases. Fencing is the database's, as before: each group's statement checks the fence's
epochs in its transaction. The fence the child uses is the store's (:attr:`PgStore.fence`, :attr:`PgStore.owner`),
sent to it when it changes, before the next batch (a cleared fence: every later group is refused). A refused group
fails the committer with :class:`~coordinator.io.cluster.leases.ShardFenced`, any other failure, a child that exits
or a garbled reply with :class:`~coordinator.io.stores.integrity.StoreError`: nothing after it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, Protocol, TypeVar

import msgspec
import structlog

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.backlog import Backlog
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.writer_wire import CLOSE, FAILED, REPLY_HEADER, REQUEST_HEADER, encode_group
from coordinator.records import Record
from coordinator.shards import ClusterConfig

__all__ = ["FENCE", "FENCED", "GROUP", "ProcessCommitter", "WriterSource"]

log = structlog.get_logger(__name__)

T = TypeVar("T")

GROUP: Final = 1  # a request's kind: a group of records (the first request: the setup)
FENCE: Final = 4  # a request's kind: the fence now, msgpack ``[owner, [[shard, epoch], ...]]``
FENCED: Final = 1  # a FAILED reply's count: the group was refused by the fence (ShardFenced), else 2

_F_SETPIPE_SZ = 1031
_PIPE_BYTES = 1 << 20
CLOSE_TIMEOUT_S: Final = 10.0
_ENV_KEPT: Final = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "HOME", "PYTHONPATH", "PYTHONHOME",
                    "PYTHONDONTWRITEBYTECODE", "PYTHONHASHSEED", "VIRTUAL_ENV", "COVERAGE_PROCESS_START",
                    "PGPASSFILE", "PGPASSWORD", "PGSSLMODE")  # fmt: skip


class WriterSource(Protocol):
    """What the committer reads of the coordinator's store (coordinator/io/stores/postgres.py ``PgStore``)."""

    description: str
    cluster: ClusterConfig
    fence: dict[int, int]
    owner: str

    @property
    def dsn(self) -> str: ...


class ProcessCommitter(Backlog[T]):
    """Commits record batches in the store's writer child, on the running loop; releases in order.

    Args:
        store: the coordinator's store (its DSN, cluster, fence and owner; its own connections stay the parent's).
        release: called on the loop with each payload once its batch (and every earlier one) committed.
        on_failure: called on the loop, once, when a commit fails or the child is lost.
        max_backlog_bytes: :attr:`over` past this many bytes waiting for a commit (0: no bound).
    """

    def __init__(self, store: WriterSource, release: Callable[[T], None], on_failure: Callable[[BaseException], None],
                 *, max_backlog_bytes: int = 0) -> None:  # fmt: skip
        super().__init__(release, on_failure, max_backlog_bytes)
        self.store = store
        self.transactions = 0  # replies read (commits answered)
        self.batches = 0
        self.process: subprocess.Popen[bytes] | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._sent: deque[tuple[int, Sequence[Record]]] = deque()  # (ticket, records) sent, not yet answered
        self._fence: tuple[str, dict[int, int]] | None = None  # the fence last sent to the child
        self._unsent = bytearray()
        self._buffer = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._out = self._in = -1
        self._ready = False  # the child's first reply (its store opened and loaded) was read
        self._idle: asyncio.Future[None] | None = None  # close() waits for every batch's reply
        # A shard's store rings the cluster's doorbell after each commit (coordinator/io/cluster/host.py ShardPgStore).
        self._ring: Callable[[Sequence[Record]], None] | None = getattr(store, "ring", None)

    def start(self) -> None:
        """Start the child and send it the store's DSN, cluster and fence (its ready reply is read like the others)."""
        if self.process is not None:
            return
        loop = self._loop = asyncio.get_running_loop()
        env = {k: v for k, v in os.environ.items() if k in _ENV_KEPT}
        root = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        args = [sys.executable, "-m", "coordinator.io.stores.pg_writer_child", str(os.getpid())]
        try:
            self.process = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                            close_fds=True)  # fmt: skip
        except OSError as exc:
            self.fail(StoreError(f"cannot start the store's writer process: {exc}"))
            return
        assert self.process.stdin is not None and self.process.stdout is not None
        self._out, self._in = self.process.stdin.fileno(), self.process.stdout.fileno()
        for fd in (self._out, self._in):
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)
        store, cluster = self.store, self.store.cluster
        setup = msgspec.msgpack.encode([store.dsn, cluster.name, cluster.shards, list(cluster.partitions),
                                        store.owner, sorted(store.fence.items())])  # fmt: skip
        self._fence = store.owner, store.fence
        os.set_blocking(self._out, False)
        os.set_blocking(self._in, False)
        self._write(REQUEST_HEADER.pack(len(setup), GROUP) + setup)
        loop.add_reader(self._in, self._readable)

    def submit(self, records: Sequence[Record], payload: T, size: int = 0) -> None:
        """Commit ``records``; release ``payload`` once they (and everything before) are durable."""
        if self.failed is not None:
            return
        self.batches += 1
        ticket = self.queued(payload, size)
        store = self.store
        fence = self._fence
        if fence is None or fence[1] is not store.fence or fence[0] != store.owner:
            self._fence = store.owner, store.fence
            body = msgspec.msgpack.encode([store.owner, sorted(store.fence.items())])
            self._write(REQUEST_HEADER.pack(len(body), FENCE) + body)
        body = encode_group(self._encoder, records)
        self._sent.append((ticket, records))
        self._write(REQUEST_HEADER.pack(len(body), GROUP) + body)

    def _write(self, data: bytes) -> None:
        if self._unsent:
            self._unsent += data
            return
        try:
            sent = os.write(self._out, data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._lost(f"its pipe: {exc}")
            return
        if sent < len(data):
            self._unsent += memoryview(data)[sent:]
            assert self._loop is not None
            self._loop.add_writer(self._out, self._writable)

    def _writable(self) -> None:
        try:
            sent = os.write(self._out, self._unsent)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(f"its pipe: {exc}")
            return
        del self._unsent[:sent]
        if not self._unsent and self._loop is not None:
            self._loop.remove_writer(self._out)

    def _readable(self) -> None:
        try:
            data = os.read(self._in, 1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lost(f"its pipe: {exc}")
            return
        if not data:
            self._lost("it exited")
            return
        buffer = self._buffer
        buffer += data
        at, head = 0, REPLY_HEADER.size
        while len(buffer) - at >= head:
            status, count, length = REPLY_HEADER.unpack_from(buffer, at)
            if len(buffer) - at - head < length:
                break
            text = bytes(buffer[at + head : at + head + length]).decode(errors="replace")
            at += head + length
            if status == FAILED:
                del buffer[:]
                self._stop_serving()
                self.fail(ShardFenced(text) if count == FENCED else StoreError(
                    f"cannot write the store {self.store.description}: {text}"))  # fmt: skip
                return
            if not self._ready:
                self._ready = True
                continue
            self._answered(count)
        del buffer[:at]

    def _answered(self, count: int) -> None:
        sent, ring = self._sent, self._ring
        if count > len(sent):
            self._stop_serving()
            self.fail(StoreError(f"the store's writer process for {self.store.description} answered {count} "
                                 f"commits, {len(sent)} were sent"))  # fmt: skip
            return
        ticket = 0
        for _ in range(count):
            ticket, records = sent.popleft()
            if ring is not None:
                ring(records)
        self.transactions += 1
        self.committed(ticket)
        if not sent and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def _lost(self, why: str) -> None:
        self._stop_serving()
        status = self.process.poll() if self.process is not None else None
        self.fail(StoreError(f"the store's writer process for {self.store.description} was lost ({why}; exit "
                             f"status {status})"))  # fmt: skip

    def _stop_serving(self) -> None:
        loop = self._loop
        if loop is not None:
            loop.remove_reader(self._in)
            if self._unsent:
                loop.remove_writer(self._out)
        if self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    def fail(self, exc: BaseException) -> None:
        self._sent.clear()
        super().fail(exc)

    async def close(self) -> None:
        """Wait for every batch's commit, then close the child (SIGKILL after :data:`CLOSE_TIMEOUT_S`)."""
        process = self.process
        if process is None:
            return
        self.process = None
        if self.failed is None and self._sent:
            self._idle = asyncio.get_running_loop().create_future()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle, CLOSE_TIMEOUT_S)
        if self.failed is None:
            self._write(REQUEST_HEADER.pack(0, CLOSE))
        self._stop_serving()
        try:
            await asyncio.wait_for(asyncio.to_thread(process.wait), CLOSE_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await asyncio.to_thread(process.wait)
        for pipe in (process.stdin, process.stdout):
            with contextlib.suppress(OSError):
                if pipe is not None:
                    pipe.close()

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def __repr__(self) -> str:
        return f"ProcessCommitter({self.store.description})"
