"""The PostgreSQL store's writer process: ``python -m coordinator.io.stores.pg_writer_child PARENT_PID``.

Its parent is coordinator/io/stores/pg_writer.py (:class:`~coordinator.io.stores.pg_writer.ProcessCommitter`).
The first request is the setup (msgpack ``[dsn, cluster name, shards, partitions, owner, [[shard, epoch], ...],
keys, shards of the keys, chained checksums, libpq environment]``): the child opens its own
:class:`~coordinator.io.stores.postgres.PgStore` (its own connections), fenced and keyed as the parent's, and
answers ready. Each group request (the wire of coordinator/io/stores/writer_wire.py: ``[codes, [record, ...]]``) is
decoded and submitted to the child's own :class:`~coordinator.io.stores.pg_commit.PipelinedCommitter` (encoded
ahead, pipelined, one statement a group, the fence in the statement's transaction); each commit is answered with how
many groups it committed, in order, and the keys its groups applied (pg_writer.py ``deltas_of``). A fence request
(``[owner, [[shard, epoch], ...]]``) replaces the fence at once; a keys request (an inline commit of the parent's)
is applied at once. A failed commit is answered ``FAILED`` (or ``FENCED``: the group was fenced) with its text, and
the child exits. At the end of its stdin (the parent died) it exits at once.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Sequence
from typing import Final

import msgspec

from coordinator.io.cluster.leases import ShardFenced
from coordinator.io.stores.pg_commit import PipelinedCommitter
from coordinator.io.stores.pg_writer import FENCE, FENCED, GROUP, apply_deltas, deltas_of
from coordinator.io.stores.postgres import PgStore, new_loop
from coordinator.io.stores.writer_child import die_with_parent
from coordinator.io.stores.writer_wire import (
    CLOSE,
    FAILED,
    KEYS,
    RECORD_TYPES,
    REPLY_HEADER,
    REQUEST_HEADER,
    read_exact,
    send_all,
)
from coordinator.records import Record
from coordinator.shards import ClusterConfig

__all__ = ["child_main"]

_GC_THRESHOLDS: Final = (50_000, 20, 100)  # fleetwire/cli/serve.py DAEMON_GC_THRESHOLDS


def _failure(value: int, text: str) -> bytes:
    """A failed reply: FAILED with the text's length as its count (writer_pipes.py's rule), or FENCED and its size."""
    data = text.encode()
    return REPLY_HEADER.pack(value, len(data), 0) + data if value == FAILED else REPLY_HEADER.pack(
        value, 0, len(data)) + data  # fmt: skip


def child_main(argv: Sequence[str]) -> int:
    die_with_parent(int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the coordinator's group: the parent closes us
    into, out = 0, os.dup(1)
    os.dup2(2, 1)  # a stray print (a log line) goes to stderr, never into the replies
    header = read_exact(into, REQUEST_HEADER.size)
    if header is None:
        return 1
    body = read_exact(into, REQUEST_HEADER.unpack(header)[0])
    if body is None:
        return 1
    dsn, name, shards, partitions, owner, fence, keys, shards_of, chained, pg_env = msgspec.msgpack.decode(body)
    os.environ.update(pg_env)
    try:
        store = PgStore(dsn, ClusterConfig(name=name, shards=shards, partitions=tuple(map(tuple, partitions))))
    except Exception as exc:
        send_all(out, _failure(FAILED, f"{type(exc).__name__}: {exc}"))
        return 1
    store.owner, store.fence = owner, {s: e for s, e in fence}
    store.write_keys = keys, shards_of, chained  # the parent's, as it loaded them
    store.applied = []  # each commit's keys, for the parent (postgres.py PgStore.apply_committed)
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            return runner.run(_serve(store, into, out))
    finally:
        store.close()


async def _serve(store: PgStore, into: int, out: int) -> int:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    answered = [0]  # groups committed, not yet answered
    due = [False]
    encode = msgspec.msgpack.Encoder().encode

    def answer() -> None:
        due[0] = False
        n, answered[0] = answered[0], 0
        if n:
            applied, store.applied = store.applied, []
            body = encode(deltas_of(applied)) if applied else b""
            send_all(out, REPLY_HEADER.pack(0, n, len(body)) + body)

    def release(_: int) -> None:
        answered[0] += 1
        if not due[0]:
            due[0] = True
            loop.call_soon(answer)

    def failed(exc: BaseException) -> None:
        answer()
        send_all(out, _failure(FENCED if isinstance(exc, ShardFenced) else FAILED, f"{exc}"))
        if not done.done():
            done.set_result(1)

    committer: PipelinedCommitter[int] = PipelinedCommitter(store, release, failed)
    committer.start()
    decoders = [msgspec.msgpack.Decoder(kind) for kind in RECORD_TYPES]
    decode_group = msgspec.msgpack.Decoder(tuple[bytes, list[msgspec.Raw]]).decode
    send_all(out, REPLY_HEADER.pack(0, 0, 0))  # ready
    os.set_blocking(into, False)
    buffer = bytearray()
    closing: list[asyncio.Task[None]] = []
    size_of = REQUEST_HEADER.unpack_from
    head = REQUEST_HEADER.size

    def readable() -> None:
        try:
            data = os.read(into, 1 << 20)
        except BlockingIOError:
            return
        if not data:  # the parent died
            os._exit(1)
        buffer.extend(data)
        at = 0
        while len(buffer) - at >= head:
            size, kind = size_of(buffer, at)
            if len(buffer) - at - head < size:
                break
            body = bytes(buffer[at + head : at + head + size])
            at += head + size
            if kind == GROUP:
                codes, raws = decode_group(body)
                records: list[Record] = [decoders[c].decode(r) for c, r in zip(codes, raws, strict=True)]
                committer.submit(records, 1)
            elif kind == KEYS:  # the parent committed a group inline: its keys, before any later group
                apply_deltas(store, body)
            elif kind == FENCE:
                owner, fence = msgspec.msgpack.decode(body)
                store.owner, store.fence = owner, {s: e for s, e in fence}
            elif kind == CLOSE:
                loop.remove_reader(into)
                closing.append(loop.create_task(close()))
        del buffer[:at]

    async def close() -> None:
        await committer.close()
        answer()
        if not done.done():
            done.set_result(0)

    loop.add_reader(into, readable)
    return await done


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
