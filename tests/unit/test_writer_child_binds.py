"""What the SQLite writer child binds (coordinator/io/stores/writer_child.py, sqlite_commit.py): its blobs as
``bytearray``, which Python's sqlite3 binds with no adapter look-up (docs/PERFORMANCE.md §W29d), and the same stored
bytes and types as ever: each blob the record's msgpack encoding, a blob, with its checksum.
"""

from __future__ import annotations

import sqlite3
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.io.stores import writer_child
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.io.stores.writer_wire import encode_group
from coordinator.records import PlanCreated, PlanStatus, Record
from protocol.messages import Event, Submit

_encoder = msgspec.msgpack.Encoder()


def lifecycle(n: int) -> list[list[Record]]:
    """A plan's three groups as bench/store_writer.py makes them: creation and queue, lease, run and end."""
    plan_id, data = f"p{n}", {"worker_id": "w1", "attempt": 1}
    return [
        [PlanCreated(plan_id, "bench", n, Submit(req_id=n, op="echo", args={"n": n}, plan_id=plan_id)),
         Event(plan_id=plan_id, kind="queued", data={}, seq=1), Event(plan_id=plan_id, kind="waiting", seq=2),
         PlanStatus(plan_id, "queued", next_seq=3)],
        [Event(plan_id=plan_id, kind="leased", data=data, seq=3, attempt=1),
         PlanStatus(plan_id, "leased", 1, "w1", next_seq=4)],
        [Event(plan_id=plan_id, kind="running", data=data, seq=4, attempt=1),
         PlanStatus(plan_id, "running", 1, "w1", next_seq=5),
         Event(plan_id=plan_id, kind="succeeded", data={"result": n}, seq=5, attempt=1),
         PlanStatus(plan_id, "succeeded", 1, "w1", next_seq=6, result=n)],
    ]  # fmt: skip


def groups(plans: int) -> list[list[Record]]:
    """Plan ``n``'s first group is group ``n // 2``: each group creates, leases and ends plans (and one plan)."""
    out: list[list[Record]] = [[] for _ in range(plans // 2 + 3)]
    for n in range(plans):
        for offset, step in enumerate(lifecycle(n)):
            out[n // 2 + offset].extend(step)
    return [g for g in out if g]


@pytest.fixture
def adapted(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[type]]:
    """The types sqlite3 asked its adapter registry about (a blob or a NULL bound), while the test runs."""
    seen: list[type] = []
    for key, adapter in list(sqlite3.adapters.items()):

        def counting(value: Any, adapter: Callable[[Any], Any] = adapter, kind: type = key[0]) -> Any:
            seen.append(kind)
            return adapter(value)

        monkeypatch.setitem(sqlite3.adapters, key, counting)
    yield seen


def _child(path: Path) -> SQLiteStore:
    SQLiteStore(path).close()
    return SQLiteStore.writer(path, encode_record=writer_child._raw_of)


def test_the_childs_blobs_bind_without_an_adapter(tmp_path: Path, adapted: list[type]) -> None:
    """Bench-shaped groups (a creation, statuses, inline runs; many rows and one row a group): no blob is adapted."""
    store = _child(tmp_path / DB_FILE)
    try:
        for group in groups(6):
            assert writer_child.commit(store, [encode_group(_encoder, group)], True)
        assert writer_child.commit(store, [encode_group(_encoder, lifecycle(9)[0])], True)  # one row: stamped
    finally:
        store.close()
    assert adapted == []


def test_the_stored_blobs_are_the_records_encodings(tmp_path: Path) -> None:
    """Blobs stay blobs, each the record's encoding (the events: their runs, less each run's array header), with
    the checksums the store keeps; the file loads back with every checksum checked."""
    path = tmp_path / DB_FILE
    store = _child(path)
    try:
        for group in groups(4):
            assert writer_child.commit(store, [encode_group(_encoder, group)], True)
    finally:
        store.close()
    db = sqlite3.connect(path)
    try:
        rows = db.execute(
            "SELECT id, typeof(spec), typeof(status), typeof(events), spec, status, events, nevents, spec_crc, "
            "status_crc, events_crc FROM plans ORDER BY rowid"
        ).fetchall()
    finally:
        db.close()
    assert len(rows) == 4
    for n, (plan_id, *types, spec, status, events, nevents, spec_crc, status_crc, events_crc) in enumerate(rows):
        first, lease, end = lifecycle(n)
        assert plan_id == f"p{n}" and types == ["blob", "blob", "blob"]
        assert spec == _encoder.encode(first[0]) and status == _encoder.encode(end[3]) and nevents == 5
        runs = [[(e.kind, e.data, e.seq, e.attempt, e.ephemeral) for e in step if isinstance(e, Event)]
                for step in (first, lease, end)]  # fmt: skip
        assert events == b"".join(_encoder.encode(run)[1:] for run in runs)
        assert (spec_crc, status_crc, events_crc) == (zlib.crc32(spec), zlib.crc32(status), zlib.crc32(events))
    again = SQLiteStore(path)
    try:
        loaded = {p.created.plan_id: p for p in again.load()}
        assert [e.kind for e in loaded["p3"].events] == ["queued", "waiting", "leased", "running", "succeeded"]
        assert loaded["p3"].status.state == "succeeded"
    finally:
        again.close()
