"""The wire between the SQLite store's writer process and its parent (coordinator/io/stores/writer_process.py,
coordinator/io/stores/writer_child.py): the requests and replies, a group's encoding and the blocking pipe helpers.

Both ways over the child's stdin/stdout pipes, little-endian:

=============  ==============================================================================
request        ``u32 length``, ``u8 kind`` (1: ``write``, 0: ``write`` without waiting for the
               database), then msgpack ``[codes, [record, ...]]``: ``codes`` a bytes string, one
               record type code a record (:data:`RECORD_TYPES`), each record as the store
               encodes it; kind :data:`KEYS`: the keys of a commit the parent made, no reply;
               kind :data:`CLOSE`, no body: the child closes the file and exits, no reply
reply          ``i64``, ``u32``, ``u32``: the generation committed (the next one), how many
               requests (the oldest unanswered) it commits and the length of its keys, then the
               keys; :data:`BUSY`, 1, 0 (another connection holds the database, nothing
               written); :data:`FAILED` and the length of the error's text, 0, then the text
               (the child then exits)
ready          the first reply, before any request: the child's generation after its open, 0, 0
=============  ==============================================================================
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import structlog

from coordinator.io.stores.rows import as_text
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record, UsageRows
from protocol.messages import Event

__all__ = [
    "BUSY", "CLOSE", "FAILED", "KEYS", "RECORD_TYPES", "REPLY_HEADER", "REQUEST_HEADER", "encode_group", "read_exact",
    "send_all", "send_request",
]  # fmt: skip

log = structlog.get_logger(__name__)

RECORD_TYPES: Final[tuple[type[Any], ...]] = (PlanCreated, PlanStatus, Event, PlanForgotten, UsageRows)
"""A record's type code on the wire is its index here."""
BUSY: Final = -1
FAILED: Final = -2
REQUEST_HEADER = struct.Struct("<IB")
KEYS: Final = 2  # a request's kind (its u8) that carries the keys of a commit made by the parent, not a group
CLOSE: Final = 3  # a request's kind (no body): the parent closes the child, which closes the file (not on EOF alone)
# A reply: a generation (or BUSY, FAILED), the groups it commits (FAILED: the text's length), its keys' length.
REPLY_HEADER = struct.Struct("<qII")
_CODES: Final = {kind: code for code, kind in enumerate(RECORD_TYPES)}


def encode_group(encoder: msgspec.msgpack.Encoder, records: Sequence[Record]) -> bytes:
    """A group as one msgpack ``[codes, records]``; a record msgpack cannot hold goes as the store stores it."""
    tags = bytes(map(_CODES.__getitem__, map(type, records)))  # in C: no Python step a record (the GIL held)
    try:
        return encoder.encode((tags, records))
    except (TypeError, ValueError, OverflowError):
        pass
    kept: list[Any] = []
    for record in records:
        try:
            encoder.encode(record)
        except (TypeError, ValueError, OverflowError) as exc:
            # What SQLiteStore._encode does in its own process: keep the record, its payload as text.
            log.error("record payload cannot be stored; storing it as text", plan_id=getattr(record, "plan_id", None),
                      error=str(exc))  # fmt: skip
            record = as_text(record)
        kept.append(record)
    return encoder.encode((tags, kept))


def send_request(fd: int, body: bytes, kind: int, before: bytes = b"") -> None:
    """``before`` and one request on ``fd``: a small one in one write, a large one's header and body in one ``writev``
    (no copy; one system call, so the writer thread gives the GIL up once, not twice, when the pipe has room)."""
    header = REQUEST_HEADER.pack(len(body), kind)
    if len(body) < 1 << 16:
        send_all(fd, before + header + body)
        return
    first = before + header
    sent = os.writev(fd, (first, body))
    if sent < len(first):
        send_all(fd, first[sent:])
        sent = len(first)
    if sent - len(first) < len(body):
        send_all(fd, memoryview(body)[sent - len(first) :])


def send_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_exact(fd: int, size: int) -> bytes | None:
    """``size`` bytes from ``fd``; None at its end."""
    data = os.read(fd, size)
    if len(data) == size:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        if not data:
            return None
        data = os.read(fd, size - got)
        parts.append(data)
        got += len(data)
    return b"".join(parts)
