"""The rows of a PostgreSQL group commit, made without I/O (split out of coordinator/io/stores/postgres.py).

:class:`RowGroup` holds one group's records by plan and then its rows; :class:`PgRows` (a part of
:class:`~coordinator.io.stores.postgres.PgStore`) makes them from the store's write-side keys: each touched plan's
row insert or update and its spilled run, one list per column (``PgRows.encode_rows``), and applies a committed
group's keys (``PgRows.apply_committed``). :func:`split_group` cuts a big group in two, :func:`grid` folds a part's
columns into one array parameter. The statement they feed is pg_schema.py ``commit_statement``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from math import isqrt
from typing import Any

import msgspec

from coordinator.io.stores.rows import StoredEvent, encode_record, encode_run, run_by_seq
from coordinator.mypyc_compat import mypyc_attr
from coordinator.records import PlanCreated, PlanStatus, Record
from coordinator.shards import SubmitShards
from protocol.messages import TERMINAL_STATES

__all__ = ["INLINE_MAX_BYTES", "INLINE_MAX_SEQ", "PgRows", "RowGroup", "columns", "grid", "split_group"]

crc = zlib.crc32
_Part = tuple["RowGroup", list[int]]  # a group and its new keys
_NO_ROW: list[tuple[Any, ...]] = [()]  # columns(): an empty column each

INLINE_MAX_SEQ = 15  # as the SQLite store: a plan's first small runs go in its own row
INLINE_MAX_BYTES = 512

# One group's rows (PgRows.encode_rows), one list per column: new plans rows, updates, spilled runs;
# then each plan's inline events' checksum after the group, the shards the rows are in, and the plans
# that reached a terminal state (their running checksum is dropped).
_Columns = tuple[list[list[Any]], list[list[Any]], list[list[Any]], dict[str, int], set[int], list[str]]


class RowGroup:
    """One group commit's records by plan (``group_records``), then its rows (``PgRows.encode_rows``)."""

    __slots__ = ("created", "doomed", "forgotten", "fresh", "fresh_ids", "fresh_shards", "latest", "records", "rest",
                 "rows", "runs", "shards")  # fmt: skip

    def __init__(self, records: Sequence[Record], created: dict[str, PlanCreated], latest: dict[str, PlanStatus],
                 runs: dict[str, list[StoredEvent]], forgotten: set[str]) -> None:  # fmt: skip
        self.records, self.created, self.latest, self.runs, self.forgotten = records, created, latest, runs, forgotten
        self.doomed: list[int] = []  # keys of the forgotten plans held
        self.shards: set[int] = set()  # the forgotten plans' shards (the rows' are in rows[4])
        self.fresh_ids: list[str] = []  # plans that get a new row (and key)
        self.fresh: dict[str, int] = {}
        self.fresh_shards: dict[str, int] = {}
        self.rows: _Columns = ([], [], [], {}, set(), [])
        self.rest: _Part | None = None  # a split group's second part and its new keys: split_group


def split_group(group: RowGroup, fresh_keys: list[int]) -> tuple[_Part, _Part]:
    """``group`` as two, its first third of plans and the rest, each with its new keys: a plan's records in one.

    A third: PostgreSQL takes about twice as long to apply a plan's rows as the loop to encode them
    (bench/cluster_throughput.py: ~20 against ~10 us), so the rest is encoded while the first third runs.
    More parts would hide a little more of the first encoding, but each statement is a wake-up of the
    database's backend, and on a loaded machine one waits for the scheduler's next tick (4 ms).

    The first holds the forgotten plans' deletes (``doomed``); each holds the forgotten ids among its own plans
    (one forgotten and created again gets its new row there, after the delete), so that applying both in order
    (:meth:`PgRows.apply_committed`) leaves what applying ``group`` would.
    """
    created, latest, runs, forgotten = group.created, group.latest, group.runs, group.forgotten
    ids = list({**created, **latest, **runs})
    key_of = dict(zip(group.fresh_ids, fresh_keys, strict=True))
    third = max(1, len(ids) // 3)
    parts: list[_Part] = []
    for part in (ids[:third], ids[third:]):
        gone = forgotten if not parts else forgotten.intersection(part) if forgotten else forgotten
        one = RowGroup(group.records, {p: created[p] for p in part if p in created},
                     {p: latest[p] for p in part if p in latest}, {p: runs[p] for p in part if p in runs}, gone)
        if not parts:
            one.doomed, one.shards = group.doomed, group.shards
        one.fresh_ids = [p for p in one.created if p in key_of]
        parts.append((one, [key_of[p] for p in one.fresh_ids]))
    return parts[0], parts[1]


def columns(rows: list[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """``rows`` as one list per column (``width`` empty lists when there is none)."""
    if not rows:
        return list(map(list, _NO_ROW * width))
    return list(map(list, zip(*rows, strict=True)))  # map, no comprehension: a lone group's row costs less


def grid(columns: list[list[Any]]) -> list[Any]:
    """Columns of equal length n as one array parameter: each column folded into rows of ~sqrt(n) values.

    The last row is padded with None (its rows have a NULL key: the statement skips them). asyncpg
    checks the elements of an array parameter in Python to find its shape, but only along the first
    element of each dimension: ~3 sqrt(n) checks a column instead of n (pg_schema.py ``_PARTS``).
    """
    n = len(columns[0])
    if n <= 4:
        return columns
    width = isqrt(n - 1) + 1
    pad = -n % width
    if pad:
        filler = [None] * pad
        for column in columns:
            column += filler
        n += pad
    return [[column[i : i + width] for i in range(0, n, width)] for column in columns]


@mypyc_attr(allow_interpreted_subclasses=True)  # compiled (setup.py): PgStore, pure, derives from it
class PgRows:
    """The row making of :class:`~coordinator.io.stores.postgres.PgStore`: its write-side keys, and a group's rows."""

    _encoder: msgspec.msgpack.Encoder
    _submit_shard: SubmitShards  # each new row's shard
    _keys: dict[str, int]  # plan id -> key of every plan held
    _shards: dict[str, int]  # plan id -> its shard
    _events_crc: dict[str, int]  # running checksum of each open plan's inline events

    def encode_rows(self, group: RowGroup, fresh_keys: list[int], stored: dict[int, int]) -> list[int]:
        """Each touched plan's row insert or update and its spilled run, one array per column (``group.rows``); no I/O.

        ``stored``: key -> the database's chained checksum where memory has none; the keys it lacks are returned.
        Rows as tuples, into a list per column at the end by zip(*rows) (an append per column cost ~2 us a plan);
        names local, the encoder called directly (encode_run/encode_record when it refuses a payload). The new
        plans first (:meth:`_new_rows`), then the others (:meth:`_updated_rows`): no test of which a row is, per row.
        """
        created, latest, runs = group.created, group.latest, group.runs
        fresh, fresh_shards = group.fresh, group.fresh_shards  # empty unless the group creates plans
        if group.fresh_ids:
            fresh = group.fresh = dict(zip(group.fresh_ids, fresh_keys, strict=True))
            fresh_shards = group.fresh_shards = {p: self._submit_shard(created[p].submit) for p in fresh}
        touched: Iterable[str] = latest
        # (no set made for a lone update's test: its one run's plan is its status's)
        if len(runs) > len(latest) or (fresh and fresh.keys() - latest.keys()) or not runs.keys() <= latest.keys():
            touched = {**fresh, **latest, **runs}
        chained_now: dict[str, int] = {}  # applied once committed, like the keys
        ended: list[str] = []
        ev_rows: list[tuple[Any, ...]] = []
        new_rows = self._new_rows(group, ev_rows, chained_now, ended) if fresh else []
        shards: set[int] = set(fresh_shards.values())  # the new rows' at once
        missing: list[int] = []
        upd_rows = self._updated_rows(group, touched, stored, ev_rows, chained_now, ended, shards, missing)
        group.rows = columns(new_rows, 14), columns(upd_rows, 7), columns(ev_rows, 5), chained_now, shards, ended
        return missing

    def _new_rows(self, group: RowGroup, ev_rows: list[tuple[Any, ...]], chained_now: dict[str, int],
                  ended: list[str]) -> list[tuple[Any, ...]]:  # fmt: skip
        """The new plans' rows (:meth:`encode_rows`): no forgotten/key look-up, no chained checksum to find."""
        created, fresh, fresh_shards = group.created, group.fresh, group.fresh_shards
        new_rows: list[tuple[Any, ...]] = []
        add_new, add_ev = new_rows.append, ev_rows.append
        encoder = self._encoder
        encode = encoder.encode
        run_of, status_of = group.runs.get, group.latest.get
        terminal, checksum, max_seq, max_bytes = TERMINAL_STATES, crc, INLINE_MAX_SEQ, INLINE_MAX_BYTES
        unencodable = (TypeError, ValueError, OverflowError)
        for plan_id, new_key in fresh.items():
            shard = fresh_shards[plan_id]
            inline = inline_crc = None
            count = 0
            run = run_of(plan_id)
            if run is not None:
                count = len(run)
                if count > 1 and (count > 2 or run[0][2] >= run[1][2]):  # two in order (the usual run): as it is
                    run = run_by_seq(run)
                    count = len(run)
                try:
                    body = encode(run)
                except unencodable:
                    body = encode_run(encoder, run)
                if count < 16 and run[-1][2] <= max_seq and len(body) <= max_bytes:
                    inline = body[1:]  # without its one-byte array header
                    inline_crc = chained_now[plan_id] = checksum(inline)
                else:
                    count = 0
                    add_ev((new_key, run[0][2], shard, checksum(body, new_key & 0xFFFFFFFF), body))
            if inline_crc is None:  # no inline events yet (events_crc NULL): their chain starts at 0, kept in memory
                chained_now[plan_id] = 0  # so the first inline run needs no look-up in the database (_updated_rows)
            status = status_of(plan_id)
            if status is None:
                state = status_blob = status_crc = None
            else:
                state = status.state
                try:
                    status_blob = encode(status)
                except unencodable:
                    status_blob = encode_record(encoder, status)
                status_crc = checksum(status_blob)
                if state in terminal:
                    ended.append(plan_id)
            record = created[plan_id]
            try:
                spec = encode(record)
            except unencodable:
                spec = encode_record(encoder, record)
            name = record.submit.plan_id  # the owner's id for it: kept only where it is not the key
            add_new((new_key, shard, record.order, count, checksum(spec), status_crc, inline_crc,
                     plan_id, record.owner, state or "queued", None if name == plan_id else name,
                     spec, status_blob, inline))  # fmt: skip
        return new_rows

    def _updated_rows(self, group: RowGroup, touched: Iterable[str], stored: dict[int, int],
                      ev_rows: list[tuple[Any, ...]], chained_now: dict[str, int], ended: list[str], shards: set[int],
                      missing: list[int]) -> list[tuple[Any, ...]]:  # fmt: skip
        """The other touched plans' row updates (:meth:`encode_rows`), their shards added to ``shards``."""
        fresh, forgotten, chained = group.fresh, group.forgotten, self._events_crc
        shards_of = self._shards
        upd_rows: list[tuple[Any, ...]] = []
        encoder = self._encoder
        encode = encoder.encode
        runs, latest, keys = group.runs, group.latest, self._keys  # method calls, not bound ones: mypyc's C calls
        terminal, checksum, max_seq, max_bytes = TERMINAL_STATES, crc, INLINE_MAX_SEQ, INLINE_MAX_BYTES
        unencodable = (TypeError, ValueError, OverflowError)
        for plan_id in touched:
            if fresh and plan_id in fresh:
                continue  # a new row, above
            key = None if forgotten and plan_id in forgotten else keys.get(plan_id)
            if key is None:
                continue  # a record of a plan never created (or deleted)
            shard = shards_of[plan_id]
            shards.add(shard)
            inline = inline_crc = None
            count = 0
            run = runs.get(plan_id)
            if run is not None:
                count = len(run)
                if count > 1 and (count > 2 or run[0][2] >= run[1][2]):  # two in order (the usual run): as it is
                    run = run_by_seq(run)
                    count = len(run)
                try:
                    body = encode(run)
                except unencodable:
                    body = encode_run(encoder, run)
                if count < 16 and run[-1][2] <= max_seq and len(body) <= max_bytes:
                    inline = body[1:]  # without its one-byte array header
                    previous = chained.get(plan_id)
                    if previous is None:
                        previous = stored.get(key)
                        if previous is None:
                            missing.append(key)
                            previous = 0
                    inline_crc = chained_now[plan_id] = checksum(inline, previous)
                else:
                    count = 0
                    ev_rows.append((key, run[0][2], shard, checksum(body, key & 0xFFFFFFFF), body))
            status = latest.get(plan_id)
            if status is None:
                state = status_blob = status_crc = None
            else:
                state = status.state
                try:
                    status_blob = encode(status)
                except unencodable:
                    status_blob = encode_record(encoder, status)
                status_crc = checksum(status_blob)
                if state in terminal:
                    ended.append(plan_id)
            upd_rows.append((key, count, status_crc, inline_crc, state, status_blob, inline))
        return upd_rows

    def apply_committed(self, group: RowGroup) -> None:
        """The in-memory keys follow a committed group only (or one :meth:`encode_ahead` made: the committer's)."""
        fresh, fresh_shards, forgotten = group.fresh, group.fresh_shards, group.forgotten
        chained_now, ended = group.rows[3], group.rows[5]
        keys, shards_of, chained = self._keys, self._shards, self._events_crc
        for plan_id in forgotten:
            keys.pop(plan_id, None)
            shards_of.pop(plan_id, None)
            chained.pop(plan_id, None)
        if chained_now:
            chained.update(chained_now)
        for plan_id in ended:
            chained.pop(plan_id, None)
        if fresh:
            keys.update(fresh)
            shards_of.update(fresh_shards)
