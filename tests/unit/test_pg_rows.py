"""The PostgreSQL store's group rows (coordinator/io/stores/pg_rows.py), made without a database.

pg_rows.py is compiled in the fast build (setup.py ``COMPILED``), so tools/build_compiled.py ``--test`` runs
these against its extension too: the rows, checksums and key bookkeeping must be the same in either build.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec

from coordinator.io.stores.pg_rows import PgRows, RowGroup, grid
from coordinator.io.stores.rows import group_records
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record
from coordinator.shards import ClusterConfig, SubmitShards
from protocol.messages import Event, Submit

_decode = msgspec.msgpack.Decoder().decode


class Rows(PgRows):
    """PgRows with the attributes PgStore gives it, and the store's gathering (postgres.py ``PgStore._gather``)."""

    def __init__(self) -> None:
        config = ClusterConfig()
        self._submit_shard = SubmitShards(config.shards, config.partitions)
        self._encoder = msgspec.msgpack.Encoder()
        self._keys, self._shards, self._events_crc = {}, {}, {}
        self.next_key = 100

    def group(self, records: list[Record]) -> tuple[RowGroup, list[int]]:
        created, latest, runs, forgotten = group_records(records)
        group = RowGroup(records, created, latest, runs, forgotten)
        group.doomed = [self._keys[p] for p in forgotten if p in self._keys]
        group.fresh_ids = [p for p in created if p not in self._keys or p in forgotten]
        keys = list(range(self.next_key, self.next_key + len(group.fresh_ids)))
        self.next_key += len(keys)
        return group, keys

    def commit(self, records: list[Record]) -> RowGroup:
        """Encode a group as the store does, and apply it as committed."""
        group, keys = self.group(records)
        assert self.encode_rows(group, keys, {}) == []
        self.apply_committed(group)
        return group


def _event(pid: str, seq: int, kind: str = "progress") -> Event:
    return Event(plan_id=pid, kind=kind, data={"n": seq}, seq=seq, attempt=1)


def _created(pid: str, n: int) -> PlanCreated:
    return PlanCreated(pid, "owner", n, Submit(req_id=n, op="echo", args={"n": n}, plan_id=pid))


def _rows(columns_: list[list[Any]]) -> list[tuple[Any, ...]]:
    return list(zip(*columns_, strict=True))


def test_new_plans_rows_carry_their_spec_status_and_inline_events_with_checksums() -> None:
    """A new plan's row: its key and shard, the spec, status and inline run as stored, each with its CRC-32."""
    rows = Rows()
    records: list[Record] = []
    for n, pid in enumerate(("a", "b")):
        records += [_created(pid, n), _event(pid, 1, "queued"), PlanStatus(pid, "queued", next_seq=2)]
    group = rows.commit(records)
    new = _rows(group.rows[0])
    assert [r[0] for r in new] == [100, 101] and [r[7] for r in new] == ["a", "b"]
    for row, pid in zip(new, ("a", "b"), strict=True):
        key, shard, _order, nevents, spec_crc, status_crc, events_crc = row[:7]
        owner, state, name, spec, status, events = row[8:]
        assert shard == rows._shards[pid] and owner == "owner" and state == "queued" and name is None
        assert spec_crc == zlib.crc32(spec) and status_crc == zlib.crc32(status)
        assert nevents == 1 and events_crc == zlib.crc32(events) == rows._events_crc[pid]
        assert _decode(b"\x91" + events)[0][:3] == ["queued", {"n": 1}, 1]
        assert _decode(status)["state"] == "queued" and rows._keys[pid] == key
    assert group.rows[1] == [[] for _ in range(7)] and group.rows[2] == [[] for _ in range(5)]


def test_an_update_chains_the_inline_checksum_and_a_terminal_state_ends_the_chain() -> None:
    """An update's inline run is checksummed after the plan's earlier ones; a terminal status drops the chain."""
    rows = Rows()
    rows.commit([_created("a", 0), _event("a", 1), PlanStatus("a", "queued", next_seq=2)])
    first = rows._events_crc["a"]
    group = rows.commit([_event("a", 2), _event("a", 3), PlanStatus("a", "running", attempt=1, next_seq=4)])
    ((key, nevents, status_crc, events_crc, state, status, events),) = _rows(group.rows[1])
    assert key == 100 and nevents == 2 and state == "running" and status_crc == zlib.crc32(status)
    assert events_crc == zlib.crc32(events, first) == rows._events_crc["a"]
    assert [e[2] for e in _decode(b"\x92" + events)] == [2, 3]
    assert group.rows[4] == {rows._shards["a"]}
    rows.commit([_event("a", 4), PlanStatus("a", "succeeded", attempt=1, next_seq=5)])
    assert "a" not in rows._events_crc and rows._keys["a"] == 100


def test_a_long_run_is_spilled_to_the_events_rows_and_an_unknown_plan_is_skipped() -> None:
    """A run past the inline limits goes to its own row (checksum seeded by the key); a plan never created: no row."""
    rows = Rows()
    rows.commit([_created("a", 0), _event("a", 1), PlanStatus("a", "queued", next_seq=2)])
    group = rows.commit([*(_event("a", s) for s in range(2, 20)), _event("ghost", 1), PlanStatus("ghost", "running")])
    ((key, nevents, _scrc, events_crc, state, status, events),) = _rows(group.rows[1])
    assert key == 100 and nevents == 0 and events_crc is None and events is None and status is None and state is None
    ((plan, seq, shard, body_crc, body),) = _rows(group.rows[2])
    assert (plan, seq, shard) == (100, 2, rows._shards["a"]) and body_crc == zlib.crc32(body, 100)
    assert [e[2] for e in _decode(body)] == list(range(2, 20))


def test_a_forgotten_plan_created_again_gets_a_new_row_and_key() -> None:
    """A plan forgotten and created again in one group: its old key is deleted, its new row has a new key."""
    rows = Rows()
    rows.commit([_created("a", 0), PlanStatus("a", "queued")])
    group = rows.commit([PlanForgotten("a"), _created("a", 1), PlanStatus("a", "queued")])
    assert group.doomed == [100] and [r[0] for r in _rows(group.rows[0])] == [101]
    assert rows._keys["a"] == 101 and group.rows[1] == [[] for _ in range(7)]


def test_grid_folds_columns_into_rows_of_about_sqrt_n_padded_with_none() -> None:
    """grid: each column of n values in rows of ceil(sqrt(n)), the last padded with None; a small one as it is."""
    assert grid([[1, 2, 3]]) == [[1, 2, 3]]
    folded = grid([list(range(10)), list("abcdefghij")])
    assert folded == [[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, None, None]],
                      [list("abcd"), list("efgh"), ["i", "j", None, None]]]  # fmt: skip


def test_a_plan_with_only_a_run_or_only_a_status_in_the_group_gets_its_update_row() -> None:
    """encode_rows walks every plan of the group's runs and statuses: one plan's run and another's status, as many
    runs as statuses, each get their update row; a lone update (its run and status) one row; no new row, no key."""
    rows = Rows()
    rows.commit([_created("a", 0), PlanStatus("a", "queued"), _created("b", 1), PlanStatus("b", "queued")])
    group = rows.commit([_event("a", 1), PlanStatus("b", "leased", attempt=1, next_seq=2)])
    assert sorted((r[0], r[1], r[4]) for r in _rows(group.rows[1])) == [(100, 1, None), (101, 0, "leased")]
    assert group.fresh == {} and group.rows[0] == [[] for _ in range(14)] and rows.next_key == 102
    group = rows.commit([_event("b", 1), PlanStatus("b", "running", attempt=1, next_seq=3)])
    assert [(r[0], r[1], r[4]) for r in _rows(group.rows[1])] == [(101, 1, "running")]
    empty = group.rows[0]
    empty[0].append(1)  # grid() pads a column in place: each empty column is a list of its own
    assert empty[0] == [1] and empty[1:] == [[] for _ in range(13)] and group.rows[2] == [[] for _ in range(5)]


def test_the_rows_carry_each_key_as_the_object_kept_and_a_new_plans_long_run_spills_with_its_key() -> None:
    """A row's key on its column is the very int the store keeps (the new key given, the one in ``_keys``), not a
    copy made per row (the compiled build unboxed and boxed it again); a new plan's run past the inline limits goes
    to the events rows under its new key, its row with no inline events."""
    rows = Rows()
    rows.next_key = 10**9  # past the small ints Python shares
    group, keys = rows.group([_created("a", 0), *(_event("a", s) for s in range(1, 20)), PlanStatus("a", "queued"),
                              _created("b", 1), PlanStatus("b", "queued")])  # fmt: skip
    assert rows.encode_rows(group, keys, {}) == []
    rows.apply_committed(group)
    new, spilled = group.rows[0], group.rows[2]
    assert new[0] == keys and all(k is given for k, given in zip(new[0], keys, strict=True))
    assert new[3] == [0, 0] and new[6][0] is None and new[13] == [None, None]
    assert spilled[0] == [keys[0]] and spilled[0][0] is keys[0] and spilled[1] == [1]
    assert spilled[3] == [zlib.crc32(spilled[4][0], keys[0] & 0xFFFFFFFF)]
    group = rows.commit([_event("b", 1), PlanStatus("b", "running", attempt=1, next_seq=2)])
    assert group.rows[1][0] == [keys[1]] and group.rows[1][0][0] is rows._keys["b"]


def test_an_update_group_names_every_shard_its_rows_are_in() -> None:
    """The shards of a group's update rows (``rows[4]``, the fence's) hold each row's shard, also when rows of one
    shard come on both sides of another's."""
    rows = Rows()
    rows.commit([r for n, pid in enumerate("abc") for r in (_created(pid, n), PlanStatus(pid, "queued"))])
    first = rows._shards["a"]
    rows._shards["b"] = first + 1  # as if b's submit were another shard's
    group = rows.commit([PlanStatus(pid, "leased", attempt=1) for pid in "abc"])
    assert group.rows[4] == {first, first + 1} and len(group.rows[1][0]) == 3
