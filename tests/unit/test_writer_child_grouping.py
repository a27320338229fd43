"""The writer child's grouping of a request (coordinator/io/stores/writer_child.py ``_grouped``): C loops, same rows.

``_grouped`` takes a group without a ``PlanForgotten`` apart by record type (``bytes.translate``, ``compress``) and
groups each type in a loop of its own; these check that it gives what the record-by-record grouping gives, and that
the child's path stores the rows the in-process writer stores (usage rows, a second creation, events out of order).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.io.stores import writer_child
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.io.stores.writer_wire import encode_group
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record, UsageRows
from protocol.messages import Event, Submit

_decode = msgspec.msgpack.Decoder(tuple[bytes, list[msgspec.Raw]]).decode
_encoder = msgspec.msgpack.Encoder()


def created(plan_id: str, order: int, owner: str = "alice") -> PlanCreated:
    return PlanCreated(plan_id, owner, order, Submit(req_id=order, op="echo", args={"n": order}, plan_id=plan_id))


def plans(count: int, first: int = 0) -> list[Record]:
    """``count`` plans' creation, events and statuses, interleaved across plans as a busy core emits them."""
    records: list[Record] = []
    for n in range(first, first + count):
        records += [created(f"p{n}", n), Event(plan_id=f"p{n}", kind="queued", data={}, seq=1)]
    for n in range(first, first + count):
        records += [Event(plan_id=f"p{n}", kind="leased", data={"worker_id": "w1"}, seq=2, attempt=1),
                    PlanStatus(f"p{n}", "leased", 1, "w1", next_seq=3)]  # fmt: skip
    return records


def groups() -> list[list[Record]]:
    """Groups with what the rules are about: a second creation, a later status, events out of order and repeated,
    a run spilled to the events table, usage rows, events of a plan created in an earlier group."""
    usage = UsageRows(rows=[(5, "alice", "t", [1.0, 2.0])], deleted=[(4, "alice", "t")])
    return [
        [*plans(5), created("p1", 99, owner="mallory"), usage],
        [Event(plan_id="p0", kind="log", data=[4], seq=4), Event(plan_id="p2", kind="running", seq=3),
         Event(plan_id="p0", kind="log", data=[3], seq=3), PlanStatus("p0", "running", 1, "w1", next_seq=5),
         Event(plan_id="p0", kind="log", data=["again"], seq=4), PlanStatus("p0", "succeeded", 1, "w1", next_seq=6),
         Event(plan_id="p3", kind="log", data="x" * 700, seq=3), UsageRows(rows=[(5, "alice", "t", [3.0, 4.0])]),
         PlanStatus("p2", "running", 1, "w1", next_seq=4)],
        [*plans(3, first=10), Event(plan_id="p3", kind="log", data=[5], seq=4)],
    ]  # fmt: skip


def _shape(grouped: tuple[Any, ...]) -> tuple[Any, ...]:
    """A grouping's parts as plain values: key structs as their fields and bytes, in their dicts' order."""
    created, latest, runs, forgotten, usage = grouped
    return (
        [(k, v.plan_id, v.owner, v.order, bytes(v.raw)) for k, v in created.items()],
        [(k, v.plan_id, v.state, bytes(v.raw)) for k, v in latest.items()],
        [(k, [(kind, bytes(data), *rest) for kind, data, *rest in run]) for k, run in runs.items()],
        forgotten, usage,
    )  # fmt: skip


@pytest.mark.parametrize("index", range(3))
def test_a_group_without_forgotten_plans_is_grouped_as_record_by_record(index: int) -> None:
    codes, raws = _decode(encode_group(_encoder, groups()[index]))
    assert _shape(writer_child._grouped(codes, raws)) == _shape(writer_child._grouped_in_order(codes, raws))


def test_a_group_with_a_forgotten_plan_is_grouped_in_order() -> None:
    """What came before a PlanForgotten is dropped; what comes after it stays."""
    records = [*plans(2), PlanForgotten("p0"), created("p0", 7), Event(plan_id="p1", kind="log", data=[3], seq=3)]
    codes, raws = _decode(encode_group(_encoder, records))
    made, latest, runs, forgotten, _ = writer_child._grouped(codes, raws)
    assert list(made) == ["p1", "p0"] and made["p0"].order == 7 and list(latest) == ["p1"]
    assert [e[2] for e in runs["p1"]] == [1, 2, 3] and "p0" not in runs and forgotten == {"p0"}


def test_the_childs_grouping_stores_the_rows_the_thread_stores(tmp_path: Path) -> None:
    """The same groups through the child's path (decode, _grouped, a writer store) and the in-process writer leave
    identical rows in every table, and load back with every checksum checked."""
    thread_path, child_path = tmp_path / "thread" / DB_FILE, tmp_path / "child" / DB_FILE
    store = SQLiteStore(thread_path)
    for group in groups():
        store.write(group)
    store.close()
    SQLiteStore(child_path).close()
    child = SQLiteStore.writer(child_path, encode_record=writer_child._raw_of)
    for group in groups():
        assert writer_child.commit(child, [encode_group(_encoder, group)], True)
    child.close()
    tables = []
    for path in (thread_path, child_path):
        db = sqlite3.connect(path)
        try:
            tables.append([db.execute(query).fetchall() for query in (
                "SELECT rowid, * FROM plans ORDER BY rowid", "SELECT * FROM events ORDER BY plan, seq",
                "SELECT * FROM usage ORDER BY hour, principal, team", "SELECT * FROM store_meta")])  # fmt: skip
        finally:
            db.close()
    assert tables[0] == tables[1]
    assert len(tables[1][0]) == 8 and len(tables[1][1]) == 1 and len(tables[1][2]) == 1
    again = SQLiteStore(child_path)
    try:
        loaded = {p.created.plan_id: p for p in again.load()}
        assert loaded["p1"].created.owner == "alice" and [e.seq for e in loaded["p0"].events] == [1, 2, 3, 4]
        assert again.load_usage()
    finally:
        again.close()
