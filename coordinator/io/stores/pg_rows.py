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

__all__ = ["INLINE_MAX_BYTES", "INLINE_MAX_SEQ", "PgRows", "RowGroup", "grid", "split_group"]

crc = zlib.crc32
_Part = tuple["RowGroup", list[int]]  # a group and its new keys

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
                       {p: latest[p] for p in part if p in latest}, {p: runs[p] for p in part if p in runs},
                       gone)  # fmt: skip
        if not parts:
            one.doomed, one.shards = group.doomed, group.shards
        one.fresh_ids = [p for p in one.created if p in key_of]
        parts.append((one, [key_of[p] for p in one.fresh_ids]))
    return parts[0], parts[1]


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


def _empty(width: int) -> list[list[Any]]:
    """``width`` empty columns, each a list of its own."""
    return [[] for _ in range(width)]


def _add_run(ev_rows: list[list[Any]], key: Any, seq: Any, shard: Any, checksum: Any, body: bytes) -> None:
    """A spilled run's row onto the events part's columns (``encode_rows``'s ``ev_rows``)."""
    ev_rows[0].append(key)
    ev_rows[1].append(seq)
    ev_rows[2].append(shard)
    ev_rows[3].append(checksum)
    ev_rows[4].append(body)


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
        The new plans first (:meth:`_new_rows`), then the others (:meth:`_updated_rows`): no test of which a row is,
        per row. Compiled (setup.py), each row's values go straight onto its columns' lists (a C call each) and its
        integers stay the objects they came as (keys from their dicts, checksums from ``zlib.crc32``): no row
        tuples turned into columns afterwards, no int unboxed and boxed again (docs/PERFORMANCE.md §C29t).
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
        ev_rows: list[list[Any]] = [[], [], [], [], []]
        new_rows = self._new_rows(group, ev_rows, chained_now, ended) if fresh else _empty(14)
        shards: set[int] = set(fresh_shards.values())  # the new rows' at once
        missing: list[int] = []
        upd_rows = self._updated_rows(group, touched, stored, ev_rows, chained_now, ended, shards, missing)
        group.rows = new_rows, upd_rows, ev_rows, chained_now, shards, ended
        return missing

    def _new_rows(self, group: RowGroup, ev_rows: list[list[Any]], chained_now: dict[str, int],
                  ended: list[str]) -> list[list[Any]]:  # fmt: skip
        """The new plans' rows (:meth:`encode_rows`), by column: no forgotten/key look-up, no chained checksum."""
        created, fresh_shards = group.created, group.fresh_shards
        fresh: dict[str, Any] = group.fresh  # Any: each key goes on its column as the object it is
        columns: list[list[Any]] = [[] for _ in range(14)]  # the statement's new-row columns, in its order
        (keys, shard_col, orders, counts, spec_crcs, status_crcs, inline_crcs, ids, owners, states, names, specs,
         statuses, inlines) = columns  # fmt: skip
        encoder = self._encoder
        encode = encoder.encode  # bound once: a method call a value would look the method up each time
        run_of, status_of = group.runs.get, group.latest.get
        terminal, max_seq, max_bytes = TERMINAL_STATES, INLINE_MAX_SEQ, INLINE_MAX_BYTES
        checksum: Any = crc  # Any: its result goes on a column as it is (typed int, mypyc would unbox and box it)
        unencodable = (TypeError, ValueError, OverflowError)
        for plan_id, new_key in fresh.items():
            shard: Any = fresh_shards[plan_id]
            inline: Any = None
            inline_crc: Any = None
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
                    _add_run(ev_rows, new_key, run[0][2], shard, checksum(body, new_key & 0xFFFFFFFF), body)
            if inline_crc is None:  # no inline events yet (events_crc NULL): their chain starts at 0, kept in memory
                chained_now[plan_id] = 0  # so the first inline run needs no look-up in the database (_updated_rows)
            status = status_of(plan_id)
            state: Any = None
            status_blob: Any = None
            status_crc: Any = None
            if status is not None:
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
            keys.append(new_key)
            shard_col.append(shard)
            orders.append(record.order)
            counts.append(count)
            spec_crcs.append(checksum(spec))
            status_crcs.append(status_crc)
            inline_crcs.append(inline_crc)
            ids.append(plan_id)
            owners.append(record.owner)
            states.append(state or "queued")
            names.append(None if name == plan_id else name)
            specs.append(spec)
            statuses.append(status_blob)
            inlines.append(inline)
        return columns

    def _updated_rows(self, group: RowGroup, touched: Iterable[str], stored: dict[int, int],
                      ev_rows: list[list[Any]], chained_now: dict[str, int], ended: list[str], shards: set[int],
                      missing: list[int]) -> list[list[Any]]:  # fmt: skip
        """The other touched plans' row updates (:meth:`encode_rows`), by column, their shards added to ``shards``."""
        forgotten = group.forgotten
        chained: dict[str, Any] = self._events_crc  # Any: a checksum is passed on as the object it is
        keys_of: dict[str, Any] = self._keys
        shards_of: dict[str, Any] = self._shards
        keys: list[Any] = []
        counts: list[Any] = []
        status_crcs: list[Any] = []
        inline_crcs: list[Any] = []
        states: list[Any] = []
        statuses: list[Any] = []
        inlines: list[Any] = []
        encoder = self._encoder
        encode = encoder.encode  # bound once: a method call a value would look the method up each time
        runs, latest = group.runs, group.latest  # method calls, not bound ones: mypyc's C calls
        terminal, max_seq, max_bytes = TERMINAL_STATES, INLINE_MAX_SEQ, INLINE_MAX_BYTES
        checksum: Any = crc  # Any: its result goes on a column as it is (typed int, mypyc would unbox and box it)
        unencodable = (TypeError, ValueError, OverflowError)
        last_shard: Any = None
        for plan_id in touched:
            # A new row's plan (above) has no key yet, or is forgotten (created again): no look-up in ``fresh``.
            key: Any = None if forgotten and plan_id in forgotten else keys_of.get(plan_id)
            if key is None:
                continue  # a new row, or a record of a plan never created (or deleted)
            shard: Any = shards_of[plan_id]
            if shard is not last_shard:  # (the rows of a group are mostly of one shard: no set look-up each)
                shards.add(shard)
                last_shard = shard
            inline: Any = None
            inline_crc: Any = None
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
                    previous: Any = chained.get(plan_id)
                    if previous is None:
                        previous = stored.get(key)
                        if previous is None:
                            missing.append(key)
                            previous = 0
                    inline_crc = checksum(inline, previous)
                    chained_now[plan_id] = inline_crc
                else:
                    count = 0
                    _add_run(ev_rows, key, run[0][2], shard, checksum(body, key & 0xFFFFFFFF), body)
            status = latest.get(plan_id)
            state: Any = None
            status_blob: Any = None
            status_crc: Any = None
            if status is not None:
                state = status.state
                try:
                    status_blob = encode(status)
                except unencodable:
                    status_blob = encode_record(encoder, status)
                status_crc = checksum(status_blob)
                if state in terminal:
                    ended.append(plan_id)
            keys.append(key)
            counts.append(count)
            status_crcs.append(status_crc)
            inline_crcs.append(inline_crc)
            states.append(state)
            statuses.append(status_blob)
            inlines.append(inline)
        return [keys, counts, status_crcs, inline_crcs, states, statuses, inlines]

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
