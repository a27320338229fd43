"""The SQLite store's streaming load (a restart's): the same plans as ``load``, one at a time, damage still refused.

Real SQLite files; damage is a byte flipped in a payload, as tests/unit/test_store_integrity.py does.
"""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from coordinator.io.stores.integrity import StoreDamaged
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from coordinator.records import PlanForgotten, PlanStatus
from tests.unit.test_store_integrity import created, event, fill, flip, lifecycle


def test_stream_gives_the_plans_load_gives_in_submit_order(tmp_path: Path) -> None:
    """stream() yields exactly load()'s plans (inline events, events rows, a forgotten plan) in the same order."""
    path = tmp_path / DB_FILE
    store = fill(path, close=False)
    store.write([PlanForgotten("p1")])
    store.close()
    a = SQLiteStore(path)
    loaded = a.load()
    a.close()
    b = SQLiteStore(path)
    streamed = list(b.stream())
    b.close()
    assert streamed == loaded
    assert [p.created.plan_id for p in streamed] == ["p0", "p2", "p3", "p4", "long"]
    assert [e.seq for e in streamed[-1].events] == list(range(1, 40))


def test_a_streamed_store_is_written_on_as_a_loaded_one(tmp_path: Path) -> None:
    """After stream(), the writer continues the plans it yielded (rowids, running checksums): a reload is sound."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    store.write(lifecycle("a", 1)[0])
    store.write([created("b", 2), event("b", 1, "x"), PlanStatus("b", "queued", next_seq=2)])
    store.close()
    again = SQLiteStore(path)
    assert [p.created.plan_id for p in again.stream()] == ["a", "b"]
    again.write([event("b", 2, "more"), PlanStatus("b", "running", 1, "w", next_seq=3), PlanForgotten("a")])
    again.close()
    third = SQLiteStore(path)
    (plan,) = third.load()
    third.close()
    assert plan.created.plan_id == "b" and [e.data for e in plan.events] == ["x", "more"]


@pytest.mark.parametrize("needle", [b"RESULT-p2", b"SPILL-5"])
def test_stream_refuses_damage_with_loads_message_after_the_sound_plans(tmp_path: Path, needle: bytes) -> None:
    """A flipped byte: stream() never yields the damaged plan and ends with load()'s StoreDamaged."""
    path = tmp_path / DB_FILE
    fill(path)
    flip(path, needle)
    store = SQLiteStore(path)
    try:
        with pytest.raises(StoreDamaged) as loaded:
            store.load()
        seen: list[str] = []
        with pytest.raises(StoreDamaged) as streamed:
            for plan in store.stream():
                seen.append(plan.created.plan_id)
    finally:
        store.close()
    assert str(streamed.value) == str(loaded.value)
    damaged = "long" if needle.startswith(b"SPILL") else "p2"
    assert damaged not in seen and len(seen) == 5


def test_stream_with_accept_loss_drops_the_damaged_plan(tmp_path: Path) -> None:
    """--accept-store-loss: stream() gives the sound plans and the next start finds a clean file."""
    path = tmp_path / DB_FILE
    fill(path)
    flip(path, b"RESULT-p2")
    store = SQLiteStore(path, accept_loss=True)
    assert [p.created.plan_id for p in store.stream()] == ["p0", "p1", "p3", "p4", "long"]
    store.close()
    again = SQLiteStore(path)
    assert len(list(again.stream())) == 5
    again.close()


def test_stream_holds_one_plan_at_a_time_not_the_store(tmp_path: Path) -> None:
    """Taking each plan and letting it go, stream()'s peak memory is a fraction of load()'s list."""
    path = tmp_path / DB_FILE
    store = SQLiteStore(path)
    for start in range(0, 3000, 500):
        store.write([r for i in range(start, start + 500) for r in lifecycle(f"plan-{i}", i + 1)[0]])
    store.close()

    def peak(use_stream: bool) -> int:
        s = SQLiteStore(path)
        tracemalloc.start()
        try:
            if use_stream:
                for _ in s.stream():
                    pass
            else:
                plans = s.load()
                del plans
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            s.close()

    assert peak(use_stream=True) * 3 < peak(use_stream=False)
