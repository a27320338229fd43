"""The write-side keys a commit hands to the other side of the SQLite writer process (``SQLiteStore.keys_message``).

A plan that ends in a group keeps no running checksum of its inline events, so its checksum is not sent either
(the receiver would store it only to drop it); an event stored after its end still chains from the row's value.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanCreated, PlanStatus, Record
from protocol.messages import Event, Submit

_keys = msgspec.msgpack.Decoder(tuple[int, int, dict[str, int], dict[str, int], list[str], list[str]]).decode


def created(plan_id: str, order: int) -> list[Record]:
    submit = Submit(req_id=order, op="echo", args=order, plan_id=plan_id)
    return [PlanCreated(plan_id, "alice", order, submit), Event(plan_id=plan_id, kind="queued", data={}, seq=1),
            PlanStatus(plan_id, "queued", next_seq=2)]  # fmt: skip


def event(plan_id: str, seq: int) -> Event:
    return Event(plan_id=plan_id, kind="log", data=seq, seq=seq, attempt=1)


def test_a_plan_that_ends_sends_no_running_checksum_only_its_end(tmp_path: Path) -> None:
    """The group that ends 'a' and runs 'b': the keys hold b's checksum, not a's; 'a' is listed as ended."""
    path = tmp_path / DB_FILE
    SQLiteStore(path).close()
    child = SQLiteStore.writer(path)
    child.write([*created("a", 1), *created("b", 2)])
    _, _, _, chained, ended, _ = _keys(child.keys_message())
    assert set(chained) == {"a", "b"} and ended == []
    child.write([event("a", 2), PlanStatus("a", "succeeded", 1, "w", next_seq=3, result=1),
                 event("b", 2), PlanStatus("b", "running", 1, "w", next_seq=3)])  # fmt: skip
    _, _, _, chained, ended, _ = _keys(child.keys_message())
    assert set(chained) == {"b"} and ended == ["a"]
    assert set(child._events_crc) == {"b"}
    child.close()


def test_an_event_after_a_plan_ended_on_the_other_side_chains_from_the_stored_checksum(tmp_path: Path) -> None:
    """The child ends 'a'; the parent, given the child's keys, stores a later event of 'a'; every checksum loads."""
    path = tmp_path / DB_FILE
    parent = SQLiteStore(path)
    parent.load()
    child = SQLiteStore.writer(path)
    for group in (created("a", 1), [event("a", 2), PlanStatus("a", "succeeded", 1, "w", next_seq=3, result=1)]):
        child.write(group)
        parent.apply_keys(child.keys_message())
    assert parent.try_write([event("a", 3), PlanStatus("a", "succeeded", 1, "w", next_seq=4, result=1)])
    child.close()
    parent.close()
    again = SQLiteStore(path)
    try:
        (plan,) = again.load()
        assert [e.seq for e in plan.events] == [1, 2, 3] and again.losses == []
    finally:
        again.close()
