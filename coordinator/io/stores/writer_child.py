"""The SQLite store's writer process itself: ``python -m coordinator.io.stores.writer_child PATH MARKER_SYNC_S PARENT``.

The parent side, the wire and the failure rules are in coordinator/io/stores/writer_process.py
(:class:`~coordinator.io.stores.writer_process.WriterProcess` starts this module). It is a module of
its own so that the parent's side never imports the store it writes for (``SQLiteStore`` imports
``WriterProcess``; this module imports both).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import operator
import os
import select
import signal
import sqlite3
import sys
from collections.abc import Sequence
from itertools import compress
from pathlib import Path
from typing import Any, Final, NoReturn

import msgspec

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.sqlite_commit import BLOB
from coordinator.io.stores.writer_wire import (
    BUSY,
    CLOSE,
    FAILED,
    KEYS,
    RECORD_TYPES,
    REPLY_HEADER,
    REQUEST_HEADER,
    read_exact,
    send_all,
)
from coordinator.records import PlanForgotten, UsageRows

__all__ = ["child_main", "commit", "die_with_parent", "sqlite_for_one_thread"]

_MERGE_MOST = 256  # groups the child commits in one transaction at most
_PR_SET_PDEATHSIG = 1
_SQLITE_CONFIG_MULTITHREAD = 2  # sqlite3.h: SQLITE_CONFIG_MULTITHREAD, SQLITE_CONFIG_MEMSTATUS
_SQLITE_CONFIG_MEMSTATUS = 9
_GC_THRESHOLDS: Final = (50_000, 20, 100)  # fleetwire/cli/serve.py DAEMON_GC_THRESHOLDS (not imported: the SDK's)


def die_with_parent(parent: int) -> None:
    """SIGKILL when the parent dies (Linux), and exit now if it already did."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def child_main(argv: Sequence[str]) -> int:
    """The child: open the file, answer ready, then commit each request until the parent's close request."""
    path, marker_sync_s, parent = Path(argv[0]), float(argv[1]), int(argv[2])
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C to the coordinator's group: the parent closes us
    sqlite_for_one_thread()
    into, out = 0, os.dup(1)
    os.dup2(2, 1)  # a stray print goes to stderr, never into the replies
    try:
        # A creation or a status is stored as the parent encoded it: its bytes, read off the key struct (_raw_of).
        store = SQLiteStore.writer(path, marker_sync_s=marker_sync_s, encode_record=_raw_of)
    except Exception as exc:  # any failure to open is the parent's StoreError
        send_all(out, _failure(exc))
        return 1
    # The collector as the coordinator daemon tunes it (fleetwire/cli/serve.py): with CPython's default
    # thresholds the records of each group triggered collections of every young object: 13 of the
    # child's ~40 µs per plan (bench/store_writer.py --process).
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)
    send_all(out, REPLY_HEADER.pack(store.generation, 0, 0))
    waiting = select.poll()
    waiting.register(into, select.POLLIN)
    read: tuple[bytes, int] | None = None  # a request read while merging, not merged (the parent's keys)
    try:
        while True:
            request, read = read or _read_request(into), None
            if request is None:  # the parent died (its close request never came): the file as it left it
                _exit_at_once()
            if request[1] == CLOSE:
                return 0
            try:
                if request[1] == KEYS:  # the parent committed a group itself: its keys, before any later group
                    store.apply_keys(request[0])
                    continue
                bodies, wait = [request[0]], request[1] == 1
                # Group commit here: the groups that came while the last one was committed go in one transaction.
                while len(bodies) < _MERGE_MOST and waiting.poll(0):
                    more = _read_request(into)
                    if more is None:
                        break
                    if more[1] == KEYS or more[1] == CLOSE:
                        read = more  # after this transaction (keys: never sent while a group is in flight)
                        break
                    bodies.append(more[0])
                    wait = True
                written = commit(store, bodies, wait)
            except Exception as exc:  # a failed commit (or keys that do not apply) is the parent's StoreError
                send_all(out, _failure(exc))
                return 1
            if written:  # its keys, which the parent applies before it reports the commit
                keys = store.keys_message()
                send_all(out, REPLY_HEADER.pack(store.generation, len(bodies), len(keys)) + keys)
            else:
                send_all(out, REPLY_HEADER.pack(BUSY, 1, 0))
    finally:
        store.close()


def sqlite_for_one_thread() -> bool:
    """SQLite's library in this process set for connections each used by one thread, without its memory statistics:
    call before the first connection opens; False where it cannot be (left as it is).

    The child has one thread and one connection, and reads no memory statistics. By default (serialized, statistics
    on) each of SQLite's ~27 allocations and frees a plan took a global mutex and each call a connection's:
    155,811 -> 146,802 instructions a plan in the child (callgrind, bench/store_writer.py --child-callgrind).
    The library is the one Python's sqlite3 module loaded (a build with SQLite linked in: left as it is).
    """
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libsqlite3." in line), None)
        if path is None:
            return False
        lib = ctypes.CDLL(path)  # the handle already loaded
        if lib.sqlite3_shutdown() != 0:  # a connection is open: nothing may change
            return False
        lib.sqlite3_config(_SQLITE_CONFIG_MULTITHREAD)
        lib.sqlite3_config(_SQLITE_CONFIG_MEMSTATUS, ctypes.c_int(0))
        return bool(lib.sqlite3_initialize() == 0)
    except (OSError, AttributeError):
        return False


def _exit_at_once() -> NoReturn:
    """Exit now, the store not closed: the end of stdin with no close request before it is the parent's death.

    A close here (its connection the file's last) checkpoints the -wal into the file and deletes it. The parent
    killed -9 closes this pipe before Linux sends the parent-death SIGKILL, so a close begun in between changed
    the files a coordinator killed -9 leaves, now and then (test_store_damage's truncated -wal found no -wal),
    and held the lock file a restarted coordinator waits for. The parent's commits are in the -wal: the next
    open recovers them, as after any crash.
    """
    os._exit(0)


def commit(store: SQLiteStore, bodies: list[bytes], wait: bool) -> bool:
    """The requests' groups (the parent's encoding: ``writer_wire.encode_group``) committed as one transaction;
    False: ``wait`` off and the file busy (nothing written)."""
    codes, raws = _decode(bodies[0])
    for body in bodies[1:]:
        more_codes, more_raws = _decode(body)
        codes += more_codes
        raws += more_raws
    return store.write_grouped(*_grouped(codes, raws), len(raws), wait=wait)


def _read_request(into: int) -> tuple[bytes, int] | None:
    """The next request's body and its kind (1: ``write``, 0: ``try_write``, KEYS); None at the end of the pipe."""
    header = read_exact(into, REQUEST_HEADER.size)
    if header is None:
        return None
    size, kind = REQUEST_HEADER.unpack(header)
    body = read_exact(into, size)
    return None if body is None else (body, kind)


# A creation or a status as the parent encoded it: what the store reads of it (decoded), and its bytes (``raw``,
# set after the decode: a name no record's field has), stored as they are. The bytes are the record's msgpack
# encoding, the store's own (``SQLiteStore._encode_rows`` encodes a record with a default
# ``msgspec.msgpack.Encoder``, as the parent does): decoding the whole record here only to encode it again cost
# ~3 µs a plan. The store reads the bytes with ``_raw_of`` (an attribute read in C): a Python object made a
# record and an encoder's call back to Python for each to copy its bytes cost ~1.5 µs a plan.
_RAW = msgspec.field(default=None, name=" the bytes")


class _CreatedKey(msgspec.Struct, gc=False):
    plan_id: str
    owner: str
    order: int
    raw: Any = _RAW


class _StatusKey(msgspec.Struct, gc=False):
    plan_id: str
    state: str
    raw: Any = _RAW


class _EventRow(msgspec.Struct, gc=False):
    """An ``Event`` as the store keeps it: its ``data`` as the parent encoded it (stored as it is, in the run)."""

    plan_id: str
    kind: str
    data: msgspec.Raw = msgspec.Raw(b"\xc0")  # an Event's default: None (msgpack nil), left out by omit_defaults
    seq: int = 0
    attempt: int = 0
    ephemeral: bool = False


# A kept creation's or status's bytes are a bytearray (``BLOB + raw``: a copy, as sqlite3's adapter for a Raw made
# one): sqlite3 binds a bytearray as it is, but looks any other blob's type up in its adapter registry (a key tuple
# built and hashed, the adapter called), ~1,100 instructions a blob (docs/PERFORMANCE.md §W29d).
_raw_of = operator.attrgetter("raw")
# sqlite3 binds a buffer (a Raw) as a blob, but only after its adapter lookup missed (an AttributeError made and
# cleared for each): an adapter found in the registry (bytes: a copy, in C) skips that. Set wherever this module is
# imported (the child; a test or bench driving its functions): a Raw is stored as the same blob either way.
sqlite3.adapters.setdefault((msgspec.Raw, sqlite3.PrepareProtocol), bytes)


_CREATED, _STATUS, _EVENT, _FORGOTTEN, _USAGE = range(len(RECORD_TYPES))
_created_key = msgspec.msgpack.Decoder(_CreatedKey).decode
_status_key = msgspec.msgpack.Decoder(_StatusKey).decode
_event = msgspec.msgpack.Decoder(_EventRow).decode
_forgotten = msgspec.msgpack.Decoder(PlanForgotten).decode
_usage = msgspec.msgpack.Decoder(UsageRows).decode
_decode = msgspec.msgpack.Decoder(tuple[bytes, list[msgspec.Raw]]).decode  # a request: type codes, records
_FORGOTTEN_CODE, _USAGE_CODE = bytes([_FORGOTTEN]), bytes([_USAGE])  # found in a request's codes by bytes.__contains__
_KNOWN_CODES = bytes(range(len(RECORD_TYPES)))  # deleted from a request's codes: what is left is unknown
# A request's codes translated to 1 for one record type and 0 for the others: compress's selector, made in C.
_IS_EVENT, _IS_STATUS, _IS_CREATED, _IS_USAGE = (
    bytes(code == c for c in range(256)) for code in (_EVENT, _STATUS, _CREATED, _USAGE)
)


def _grouped(codes: bytes, raws: list[msgspec.Raw]) -> tuple[Any, Any, Any, set[str], list[UsageRows]]:
    """``group_records`` (coordinator/io/stores/rows.py) of a request, the same rules: creations and statuses
    as their key structs with their bytes, each plan's events as stored tuples, a ``PlanForgotten`` dropping what
    came before.

    Without a ``PlanForgotten`` (nearly every group) the order between records of different types changes nothing,
    so each type is taken apart in C (its selector ``bytes.translate`` of the codes, ``compress``) and grouped by a
    loop of its own, with no test of a record's code: 0.5 % of the child's instructions a plan (147.5k -> 146.75k,
    bench/store_writer.py --child-callgrind). A group with one (or an unknown code) goes through
    :func:`_grouped_in_order`. Taking the loops into C as well (``map`` of ``operator.attrgetter``, ``setattr``, a
    defaultdict's ``__getitem__``) cost more: 166k, for these calls take CPython 3.11's generic paths where the
    loops' attribute reads and stores are specialised.
    """
    if _FORGOTTEN_CODE in codes or codes.translate(None, _KNOWN_CODES):
        return _grouped_in_order(codes, raws)
    if len(codes) != len(raws):
        raise ValueError(f"a request of {len(codes)} type codes and {len(raws)} records")
    runs: dict[str, list[tuple[str, Any, int, int, bool]]] = {}
    runs_get = runs.get
    for e in map(_event, compress(raws, codes.translate(_IS_EVENT))):
        run = runs_get(e.plan_id)
        if run is None:
            runs[e.plan_id] = [(e.kind, e.data, e.seq, e.attempt, e.ephemeral)]
        else:
            run.append((e.kind, e.data, e.seq, e.attempt, e.ephemeral))
    latest: dict[str, _StatusKey] = {}
    status_key = _status_key
    for raw in compress(raws, codes.translate(_IS_STATUS)):
        status = status_key(raw)
        status.raw = raw
        latest[status.plan_id] = status
    for status in latest.values():  # the kept ones' bytes as a bytearray: see _raw_of
        status.raw = BLOB + status.raw
    created: dict[str, _CreatedKey] = {}
    created_key = _created_key
    for raw in compress(raws, codes.translate(_IS_CREATED)):
        key = created_key(raw)
        if key.plan_id not in created:
            key.raw = BLOB + raw
            created[key.plan_id] = key
    usage = list(map(_usage, compress(raws, codes.translate(_IS_USAGE)))) if _USAGE_CODE in codes else []
    return created, latest, runs, set(), usage


def _grouped_in_order(codes: bytes, raws: list[msgspec.Raw]) -> tuple[Any, Any, Any, set[str], list[UsageRows]]:
    """:func:`_grouped` record by record, in order: a group with a ``PlanForgotten``."""
    created: dict[str, _CreatedKey] = {}
    latest: dict[str, _StatusKey] = {}
    runs: dict[str, list[tuple[str, Any, int, int, bool]]] = {}
    forgotten: set[str] = set()
    usage: list[UsageRows] = []
    event, status_key, created_key, runs_get = _event, _status_key, _created_key, runs.get  # locals: ~12 a plan
    for code, raw in zip(codes, raws, strict=True):
        if code == _EVENT:
            e = event(raw)
            run = runs_get(e.plan_id)
            if run is None:
                runs[e.plan_id] = [(e.kind, e.data, e.seq, e.attempt, e.ephemeral)]
            else:
                run.append((e.kind, e.data, e.seq, e.attempt, e.ephemeral))
        elif code == _STATUS:
            status = status_key(raw)
            status.raw = raw
            latest[status.plan_id] = status
        elif code == _CREATED:
            key = created_key(raw)
            if key.plan_id not in created:
                key.raw = BLOB + raw
                created[key.plan_id] = key
        elif code == _FORGOTTEN:
            gone = _forgotten(raw).plan_id
            created.pop(gone, None)
            latest.pop(gone, None)
            runs.pop(gone, None)
            forgotten.add(gone)
        else:
            usage.append(_usage(raw))
    for status in latest.values():
        status.raw = BLOB + status.raw
    return created, latest, runs, forgotten, usage


def _failure(exc: BaseException) -> bytes:
    text = f"{type(exc).__name__}: {exc}".encode(errors="replace")[:65536]
    return REPLY_HEADER.pack(FAILED, len(text), 0) + text


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
