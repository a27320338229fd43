"""The stores' rows: read back with checksums and cross-references verified, damage named; encoded.

Used by the store's ``load`` (``coordinator/io/stores/sqlite.py``), by ``fleetwire store check``
(``coordinator/io/stores/admin.py``) and by ``--accept-store-loss`` salvage, so the three read
a file the same way. The PostgreSQL store (``coordinator/io/stores/postgres.py``) stores the same blobs
with the same checksums, reads them back with :func:`decode_plans` and encodes them with
:func:`encode_record` and :func:`encode_run`.
"""

from __future__ import annotations

import itertools
import operator
import zlib
from collections.abc import Iterable, Iterator
from sys import intern
from typing import Any

import msgspec

from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, StoredPlan, UsageRows
from protocol.messages import TERMINAL_STATES, Event

__all__ = [
    "SELECT_EVENTS", "SELECT_PLANS", "StoredEvent", "array_header", "as_text", "by_seq", "decode_plans",
    "encode_record", "encode_run", "events_of", "iter_plans", "not_storable", "run_by_seq",
]

crc = zlib.crc32
_seq = operator.attrgetter("seq")
_order = operator.attrgetter("created.order")

SELECT_PLANS = (
    "SELECT rowid, id, ord, state, spec, status, events, nevents, spec_crc, status_crc, events_crc FROM plans"
)
SELECT_EVENTS = "SELECT plan, seq, body, crc FROM events ORDER BY plan, seq"
StoredEvent = tuple[str, Any, int, int, bool]  # kind, data, seq, attempt, ephemeral


class _Damage(Exception):
    """A stored plan that fails a check (the message says which)."""


def decode_plans(
    plan_rows: Iterable[tuple[Any, ...]],
    event_rows: Iterable[tuple[Any, ...]],
    *,
    keep_crc: dict[str, int] | None = None,
    keep_rowids: dict[str, int] | None = None,
) -> tuple[list[StoredPlan], dict[int, str]]:
    """Plans from their stored rows, every blob's checksum and every cross-reference verified.

    Args:
        plan_rows: ``plans`` rows as :data:`SELECT_PLANS` reads them.
        event_rows: ``events`` rows as :data:`SELECT_EVENTS` reads them (by plan, then seq).
        keep_crc: filled with the inline events' checksum of every plan not ended, which the
            writer continues.
        keep_rowids: filled with every sound plan's rowid, keyed by its (decoded) id.

    Returns:
        The sound plans in submit order, and the damaged ones: plans rowid -> what is wrong
        (a sentence naming the plan). A damaged plan is left out whole.
    """
    decoder = _Decoder(keep_crc)
    plans: dict[int, StoredPlan] = {}
    damaged: dict[int, str] = {}
    for row in plan_rows:
        stored = decoder.plan(row, damaged)
        if stored is not None:
            plans[row[0]] = stored
    runs: set[int] = set()
    for event_row in event_rows:
        plan = event_row[0]
        if decoder.events(event_row, plans.get(plan), damaged):
            runs.add(plan)
        elif plan in damaged:
            plans.pop(plan, None)
    # A plan with events rows: its inline runs and its rows interleave by seq. The core never
    # writes a seq twice (next_seq is in every status); were one written again in two groups,
    # one inline and one in a row, the row's would be kept.
    for plan in runs:
        stored = plans.get(plan)
        if stored is not None:
            stored.events = by_seq(stored.events)
    if keep_rowids is not None:
        keep_rowids.update((stored.created.plan_id, rowid) for rowid, stored in plans.items())
    return sorted(plans.values(), key=_order), damaged


def iter_plans(
    plan_rows: Iterable[tuple[Any, ...]],
    event_rows: Iterable[tuple[Any, ...]],
    damaged: dict[int, str],
    *,
    keep_crc: dict[str, int] | None = None,
    keep_rowids: dict[str, int] | None = None,
) -> Iterator[StoredPlan]:
    """:func:`decode_plans` one plan at a time: each sound plan as soon as its rows are read.

    A restart hands each plan to the core as it is decoded, so the decoded form of the whole
    store is never in memory at once (its peak, freed afterwards, left the heap fragmented:
    +12 % RSS after a restart of 200,000 open plans, bench/restart.py).

    Args:
        plan_rows: ``plans`` rows as :data:`SELECT_PLANS` reads them, **by rowid** (a merge
            with ``event_rows`` on the plan's rowid); plans come out in that order.
        event_rows: ``events`` rows as :data:`SELECT_EVENTS` reads them (by plan, then seq).
        damaged: filled as :func:`decode_plans` returns it; complete once the iterator is
            exhausted (a damaged plan is never yielded).
        keep_crc, keep_rowids: as :func:`decode_plans`'s.
    """
    decoder = _Decoder(keep_crc)
    events = iter(event_rows)
    pending = next(events, None)
    for row in plan_rows:
        rowid = row[0]
        while pending is not None and pending[0] < rowid:  # a row of no plan (see _Decoder.events)
            decoder.events(pending, None, damaged)
            pending = next(events, None)
        stored = decoder.plan(row, damaged)
        spilled = False
        while pending is not None and pending[0] == rowid:
            if stored is not None:
                spilled = decoder.events(pending, stored, damaged)
                if not spilled:
                    stored = None
            else:
                decoder.events(pending, None, damaged)
            pending = next(events, None)
        if stored is None:
            continue
        if spilled:
            stored.events = by_seq(stored.events)
        if keep_rowids is not None:
            keep_rowids[stored.created.plan_id] = rowid
        yield stored
    while pending is not None:
        decoder.events(pending, None, damaged)
        pending = next(events, None)


class _Decoder:
    """The checks and decoding of one plans row and one events row, shared by both readers."""

    def __init__(self, keep_crc: dict[str, int] | None) -> None:
        self.keep_crc = keep_crc
        self.submit = msgspec.msgpack.Decoder(PlanCreated).decode
        self.status = msgspec.msgpack.Decoder(PlanStatus).decode
        # A version 2 events row (migrated to a run of one) holds a whole Event.
        self.run = msgspec.msgpack.Decoder(list[StoredEvent | Event]).decode

    def plan(self, row: tuple[Any, ...], damaged: dict[int, str]) -> StoredPlan | None:
        """The plan of a plans row; None (and ``damaged`` says why) when it fails a check."""
        rowid, plan_id, order, state, spec, status, inline, count, spec_crc, status_crc, events_crc = row
        try:
            if crc(spec) != spec_crc:
                raise _Damage("its submit fails its checksum")
            created = self.submit(spec)
            if created.plan_id != plan_id or created.order != order:
                raise _Damage("its submit does not match its row")
            plan_id = created.plan_id  # one string object per plan id, as a submitted plan has
            stored_status = None
            if status is not None:
                if crc(status) != status_crc:
                    raise _Damage("its status fails its checksum")
                stored_status = self.status(status)
                if stored_status.plan_id != plan_id or stored_status.state != state:
                    raise _Damage("its status does not match its row")
            events: list[Event] = []
            if inline:
                if crc(inline) != events_crc:
                    raise _Damage("its events fail their checksum")
                events = events_of(plan_id, self.run(array_header(count) + inline))
                if self.keep_crc is not None and (stored_status is None
                                                  or stored_status.state not in TERMINAL_STATES):
                    self.keep_crc[plan_id] = events_crc
        except (_Damage, msgspec.DecodeError, TypeError, ValueError) as exc:
            why = str(exc) if isinstance(exc, _Damage) else f"it cannot be decoded ({exc})"
            damaged[rowid] = f"plan {plan_id!r}: {why}"
            return None
        return StoredPlan(created, stored_status, events)

    def events(self, row: tuple[Any, ...], stored: StoredPlan | None, damaged: dict[int, str]) -> bool:
        """Add an events row's run to ``stored``; True when added.

        False for a row of no sound plan (a damaged plan's, or left by an interrupted write of an
        old version: its checksum is still verified), and for a row that fails a check, whose
        plan is then damaged (``damaged`` says why; the caller drops the plan).
        """
        plan, seq, body, row_crc = row
        name = f"plan {stored.created.plan_id!r}" if stored is not None else f"plan #{plan}"
        try:
            if crc(body, plan & 0xFFFFFFFF) != row_crc:
                raise _Damage(f"its events from seq {seq} fail their checksum")
            if stored is None:
                return False
            run = events_of(stored.created.plan_id, self.run(body))
            if not run or run[0].seq != seq:
                raise _Damage(f"its events row of seq {seq} does not match its key")
        except (_Damage, msgspec.DecodeError, TypeError, ValueError) as exc:
            why = str(exc) if isinstance(exc, _Damage) else f"its events from seq {seq} cannot be decoded ({exc})"
            damaged.setdefault(plan, f"{name}: {why}")
            if stored is not None and self.keep_crc is not None:
                self.keep_crc.pop(stored.created.plan_id, None)
            return False
        stored.events.extend(run)
        return True


def events_of(plan_id: str, stored: list[StoredEvent | Event]) -> list[Event]:
    """The events of plan ``plan_id`` from their stored form."""
    # Kinds are interned: a few distinct ones over every event, as the core's own literals are.
    return [Event(plan_id=plan_id, kind=intern(e[0]), data=e[1], seq=e[2], attempt=e[3], ephemeral=e[4])
            if type(e) is tuple else e for e in stored]  # type: ignore[misc]  # fmt: skip


def by_seq(events: list[Event]) -> list[Event]:
    """``events`` in seq order, the last of each seq kept (``events`` itself when already so)."""
    if all(a.seq < b.seq for a, b in itertools.pairwise(events)):
        return events
    return sorted({e.seq: e for e in events}.values(), key=_seq)


def array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` elements."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


# ---------------------------------------------------------------- writing (both stores)


def encode_record(encoder: msgspec.msgpack.Encoder, record: Any) -> bytes:
    """A record as stored (msgpack); a payload msgpack cannot hold is stored as text, never refused."""
    try:
        return encoder.encode(record)
    except (TypeError, ValueError, OverflowError):
        return encoder.encode(as_text(record))


def encode_run(encoder: msgspec.msgpack.Encoder, run: list[StoredEvent]) -> bytes:
    """A run of a plan's events as one msgpack array of ``[kind, data, seq, attempt, ephemeral]`` arrays."""
    try:
        return encoder.encode(run)
    except (TypeError, ValueError, OverflowError):
        rows = []
        for kind, data, seq, attempt, ephemeral in run:
            try:
                encoder.encode(data)
            except (TypeError, ValueError, OverflowError):
                data = not_storable(data)
            rows.append((kind, data, seq, attempt, ephemeral))
        return encoder.encode(rows)


def run_by_seq(run: list[StoredEvent]) -> list[StoredEvent]:
    """A run of stored events in seq order, the last of each seq kept."""
    # The usual runs (2 or 3 events, already in order) without a generator: all(pairwise) cost
    # ~0.5 µs a run of 3, one per plan in the writer (bench/throughput.py's groups).
    if len(run) == 2 and run[0][2] < run[1][2]:
        return run
    previous = -1
    for item in run:
        seq = item[2]
        if seq <= previous:
            return sorted({e[2]: e for e in run}.values(), key=operator.itemgetter(2))
        previous = seq
    return run


def not_storable(value: Any) -> str:
    """What is stored in place of a payload msgpack cannot hold."""
    return f"<not storable: {value!r:.200}>"


def as_text(record: Any) -> Any:
    """``record`` with its free-form payloads (args, data, result, error detail) replaced by their repr."""
    if isinstance(record, Event):
        return msgspec.structs.replace(record, data=not_storable(record.data))
    if isinstance(record, PlanStatus):
        error = record.error
        if error is not None and error.detail is not None:
            error = msgspec.structs.replace(error, detail=not_storable(error.detail))
        result = not_storable(record.result) if record.result is not None else None
        return msgspec.structs.replace(record, result=result, error=error, history=[])
    if isinstance(record, PlanForgotten | UsageRows):
        return record
    submit = msgspec.structs.replace(record.submit, args=not_storable(record.submit.args))
    return msgspec.structs.replace(record, submit=submit)


def group_records(
    records: Iterable[Any], usage: list[UsageRows] | None = None,
) -> tuple[dict[str, PlanCreated], dict[str, PlanStatus], dict[str, list[StoredEvent]], set[str]]:
    """One group's records as each store writes them: creations, the last status per plan (a status
    is a whole snapshot), each plan's events in the order written, and the plans forgotten.

    Records are applied in order: a ``PlanForgotten`` drops what the group wrote of that plan so far
    (a later creation of the id in the same group is a new plan). ``usage``, when given, gets the
    group's :class:`UsageRows` (not a plan's: a store that keeps the usage ledger writes them apart),
    so that store needs no second pass over the group to find them.
    """
    created: dict[str, PlanCreated] = {}
    latest: dict[str, PlanStatus] = {}
    runs: dict[str, list[StoredEvent]] = {}
    forgotten: set[str] = set()
    for record in records:
        kind = type(record)
        if kind is Event:
            item = (record.kind, record.data, record.seq, record.attempt, record.ephemeral)
            run = runs.get(record.plan_id)
            if run is None:
                runs[record.plan_id] = [item]
            else:
                run.append(item)
        elif kind is PlanStatus:
            latest[record.plan_id] = record
        elif kind is UsageRows:
            if usage is not None:  # not a plan's: a store that keeps the ledger writes them apart (sqlite.py)
                usage.append(record)
        elif kind is PlanForgotten:
            gone = record.plan_id
            created.pop(gone, None)
            latest.pop(gone, None)
            runs.pop(gone, None)
            forgotten.add(gone)
        else:
            created.setdefault(record.plan_id, record)
    return created, latest, runs, forgotten
