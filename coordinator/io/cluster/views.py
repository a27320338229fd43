"""Cross-shard views of a cluster: plans read from PostgreSQL by any coordinator (docs/CLUSTER.md).

A shard's core answers ``get_plan``/``plans`` for its own shard only. A coordinator's main port
(coordinator/io/cluster/host.py) answers, for every shard, from the committed rows:

* ``GET /v1/plans?id=ID``: ``{"plans": [PlanInfo]}``, the ``get_plan`` view (result included) of the plans
  whose key is ``ID`` (an admin's view: docs/SEMANTICS.md §Plan ids); 404 when no shard holds that id;
* ``GET /v1/plans[?state=queued,running][&limit=N]``: ``{"plans": [...], "total": N, "counts":
  {state: n}}``, the ``plans`` listing view (no result bodies), highest store key first (keys come
  in blocks per coordinator, so that is roughly, not strictly, newest first); ``limit`` at most
  1000 (default 200).

The same reads serve a client session on the main port (coordinator/io/cluster/sessions.py), where
a client token sees its own plans only (``owner``). Workers are read from
``fleetwire_shard_workers``: each shard's core's registry, written by its owner once per lease
renewal (:data:`PUT_WORKERS`) **while somebody looks**: a ``list_workers`` on any main port marks
the registries wanted for :data:`WANTED_S` (:func:`want_workers`; owners check with
:data:`WANTED` of ``workers``), so an idle cluster writes no registry at all (10,000 workers are about
2.5 MB and 60 ms of CPU per write). Rows of a shard whose lease moved on are ignored.

``GET /v1/plans``: the admin token only (``Authorization: Bearer``; every owner's plans are shown). Rows are decoded
with the shared decoders and checksums (coordinator/io/stores/rows.py ``decode_plans``,
coordinator/recovery.py ``plan_from_store``); a damaged row is left out and counted in
``damaged``. What is read is what is committed: a core's view may be one group commit ahead.
"""

from __future__ import annotations

import datetime
from typing import Any, Final, get_args

import msgspec

from coordinator.io.stores.rows import decode_plans
from coordinator.plans import Plan
from coordinator.recovery import plan_from_store
from coordinator.views import Watched
from protocol.messages import PlanStateName, WorkerInfo

__all__ = [
    "MAX_LIMIT", "PLAN_STATES", "PUT_WORKERS", "WANTED", "WANTED_S",
    "ViewError", "count_matching", "count_plans", "encode_workers", "list_plans", "mark_wanted", "new_plans",
    "op_marker", "parse_query",
    "plan_shard",
    "plans_by_id", "read_plans", "read_watched", "read_workers", "shard_tips", "want_workers",
]

MAX_LIMIT: Final = 1000
PLAN_STATES: Final = get_args(PlanStateName)
_COLUMNS = "key, id, ord, state, spec, status, events, nevents, spec_crc, status_crc, events_crc"
# A plan by id: an admin's look-up by key (``id``), a client's by the id it submitted among its own plans (its
# ``name`` where the row has one, else its ``id``: coordinator/io/stores/postgres.py; docs/SEMANTICS.md §Plan ids).
_BY_ID = f"SELECT {_COLUMNS} FROM fleetwire_plans WHERE id = $1 ORDER BY key"
_OWN = "owner = $2 AND (name = $1 OR (id = $1 AND name IS NULL))"
_BY_NAME = f"SELECT {_COLUMNS} FROM fleetwire_plans WHERE {_OWN} ORDER BY key"
_EVENTS = "SELECT plan, seq, body, crc FROM fleetwire_events WHERE plan = ANY($1::bigint[]) ORDER BY plan, seq"
# The filters of a listing (list_plans' op and id_contains). ``op`` is not a column: rows whose spec holds the
# msgpack of ``"op"`` then the op's name are read (:func:`op_marker`) and the decoded plan's op is checked.
# ``id_contains`` ($3) is matched on the id the session knows a plan by ($5: an admin's, the key or the owner's
# name for it; a client's, only its name, never a key the core made: docs/SEMANTICS.md §Plan ids).
_FILTERS = "(cardinality($1::text[]) = 0 OR state = ANY($1::text[])) AND ($2::text IS NULL OR owner = $2) " \
           "AND CASE WHEN $5::bool THEN strpos(id, $3::text) > 0 OR strpos(name, $3::text) > 0 " \
           "ELSE strpos(coalesce(name, id), $3::text) > 0 END " \
           "AND ($4::bytea IS NULL OR position($4::bytea IN spec) > 0)"  # fmt: skip
_LIST = f"SELECT {_COLUMNS} FROM fleetwire_plans WHERE {_FILTERS} AND key < $6 ORDER BY key DESC LIMIT $7"
_MATCHING = f"SELECT count(*) FROM fleetwire_plans WHERE {_FILTERS}"
_COUNTS = "SELECT state, count(*) FROM fleetwire_plans WHERE $1::text IS NULL OR owner = $1 GROUP BY state"
# The newest plan a session knows by an id: an admin's by key, a client's among its own (another principal's plan
# of the same id, in this shard or another, is never found for it: issue #24 part 6).
_SHARD_OF = "SELECT shard, owner, key FROM fleetwire_plans WHERE id = $1 ORDER BY key DESC LIMIT 1"
_SHARD_OF_OWN = f"SELECT shard, owner, key FROM fleetwire_plans WHERE {_OWN} ORDER BY key DESC LIMIT 1"
_BY_KEY = f"SELECT {_COLUMNS} FROM fleetwire_plans WHERE key = ANY($1::bigint[])"
# A watched plan's events rows from the last one read on (a row holds a run of events, keyed by its first seq).
_EVENTS_SINCE = """SELECT e.plan, e.seq, e.body, e.crc FROM fleetwire_events e
JOIN unnest($1::bigint[], $2::int[]) AS w(plan, since) ON e.plan = w.plan AND e.seq >= w.since
ORDER BY e.plan, e.seq"""
# The tables fleetwire_shard_workers and fleetwire_views and the id index (fleetwire_plans_by_id, the
# look-up by id of get_plan, cancel and subscribe) are of the versioned schema (coordinator/io/stores/postgres.py).
WANTED_S: Final = 30.0  # a list_workers keeps the registries written for this long
PUT_WORKERS: Final = """
INSERT INTO fleetwire_shard_workers (shard, owner, epoch, workers, written_at)
SELECT s, o, e, w, now() FROM unnest($1::int[], $2::text[], $3::bigint[], $4::bytea[]) AS u(s, o, e, w)
ON CONFLICT (shard) DO UPDATE SET owner = excluded.owner, epoch = excluded.epoch, workers = excluded.workers,
    written_at = excluded.written_at
"""
# Whether a view wants something of the owners (``key``: 'workers', the registries; 'doorbell', the
# commits' NOTIFY in coordinator/io/cluster/doorbell.py): the owners' check every lease round ...
WANTED: Final = "SELECT coalesce((SELECT wanted_until > now() FROM fleetwire_views WHERE key = $1), false)"
# ... and a view's mark for $2 s. The answer: whether it was wanted already, and the database's now().
_WANT = """
WITH old AS (SELECT wanted_until FROM fleetwire_views WHERE key = $1)
INSERT INTO fleetwire_views (key, wanted_until) VALUES ($1, now() + make_interval(secs => $2))
ON CONFLICT (key) DO UPDATE SET wanted_until = excluded.wanted_until
RETURNING coalesce((SELECT wanted_until FROM old) > now(), false), now()
"""
# Only rows written under the lease in force: a dead or former owner's registry is not shown.
_WORKERS = """SELECT w.shard, w.workers, w.written_at >= $1 FROM fleetwire_shard_workers w
JOIN shard_leases l ON l.shard = w.shard AND l.owner = w.owner AND l.epoch = w.epoch AND l.expires_at > now()
ORDER BY w.shard"""
_SERVED = "SELECT count(*) FROM shard_leases WHERE expires_at > now() AND owner <> ''"
_NO_KEY = 2**63 - 1
# Each shard's highest plan key, and the plans of each shard above a key (a subscribe to all plans): within
# a shard keys only grow in commit order (one store commits at a time, a new owner takes a higher block),
# so "above the last key read" is "committed since"; both walk fleetwire_plans_by_shard (shard, key).
_TIPS = """SELECT s, coalesce((SELECT max(key) FROM fleetwire_plans WHERE shard = s), -1)
FROM generate_series(0, $1::int - 1) AS s"""
_NEW = """SELECT p.key, p.id, p.shard, p.owner, p.name FROM unnest($1::int[], $2::bigint[]) AS h(shard, high),
LATERAL (SELECT key, id, shard, owner, name FROM fleetwire_plans
         WHERE shard = h.shard AND key > h.high ORDER BY shard, key LIMIT $3) AS p"""
_workers_decoder = msgspec.msgpack.Decoder(list[WorkerInfo])
_workers_encoder = msgspec.msgpack.Encoder()
_marker_encoder = msgspec.msgpack.Encoder()


class ViewError(ValueError):
    """A query the view cannot answer (bad ``state`` or ``limit``); the message names it."""


def parse_query(query: dict[str, list[str]]) -> tuple[str | None, list[str], int]:
    """``(id, states, limit)`` of a ``/v1/plans`` query string (``parse_qs``'s form).

    Raises:
        ViewError: an unknown state or a limit that is not an integer in 1..MAX_LIMIT.
    """
    plan_id = query.get("id", [None])[0]
    states = [s for item in query.get("state", []) for s in item.split(",") if s]
    unknown = sorted(set(states) - set(PLAN_STATES))
    if unknown:
        raise ViewError(f"unknown state {', '.join(unknown)} in ?state=; known: {', '.join(PLAN_STATES)}")
    text = query.get("limit", ["200"])[0]
    try:
        limit = int(text)
    except ValueError:
        raise ViewError(f"?limit={text!r} is not an integer") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ViewError(f"?limit={limit} is out of range: 1..{MAX_LIMIT}")
    return plan_id, states, limit


async def read_plans(conn: Any, query: dict[str, list[str]]) -> tuple[int, bytes]:
    """``(HTTP status, JSON body)`` of a ``/v1/plans`` query, read on the asyncpg connection ``conn``.

    Raises:
        ViewError: see :func:`parse_query`.
    """
    plan_id, states, limit = parse_query(query)
    if plan_id is not None:
        found = await plans_by_id(conn, plan_id)
        if not found and not found.damaged:
            return 404, msgspec.json.encode({"error": f"no plan {plan_id!r} in any shard of this cluster"})
        return 200, msgspec.json.encode({"plans": [p.info(admin=True) for p in found], "damaged": found.damaged})
    plans, counts, damaged = await list_plans(conn, states, limit)
    total = sum(n for state, n in counts.items() if not states or state in states)
    body = {"plans": [p.summary(admin=True) for _, p in plans], "total": total, "counts": counts,
            "damaged": damaged}
    return 200, msgspec.json.encode(body)


class _Found(list[Plan]):
    damaged = 0


async def plans_by_id(conn: Any, plan_id: str, owner: str | None = None) -> _Found:
    """The plans stored under ``plan_id`` (one per shard that holds that id; ``damaged``: rows left out): by key
    (``owner`` None: an admin's look-up), or ``owner``'s plans it submitted as ``plan_id``."""
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        if owner is None:
            rows = [tuple(r) for r in await conn.fetch(_BY_ID, plan_id)]
        else:
            rows = [tuple(r) for r in await conn.fetch(_BY_NAME, plan_id, owner)]
        events = [tuple(r) for r in await conn.fetch(_EVENTS, [r[0] for r in rows])] if rows else []
    stored, damaged = decode_plans(rows, events)
    found = _Found(plan_from_store(p) for p in stored)
    found.damaged = len(damaged)
    return found


def op_marker(op: str) -> bytes | None:
    """What a plan row's spec (msgpack) holds for ``op``: the key ``"op"`` then the op's name (None: any op)."""
    return _marker_encoder.encode("op") + _marker_encoder.encode(op) if op else None


async def list_plans(conn: Any, states: list[str], limit: int, *, owner: str | None = None,
                     before: int | None = None, counted: bool = True, op: str = "", id_contains: str = "",
                     admin: bool = True) -> tuple[list[tuple[int, Plan]], dict[str, int], int]:  # fmt: skip
    """``([(store key, plan)], counts per state, damaged)``: at most ``limit`` plans in ``states`` (none: all) of
    ``owner`` (None: everyone's), of ``op`` and with ``id_contains`` in their id ("": any; ``admin`` False: in
    the id their owner submitted, never their key), with a store key below ``before``, highest key first (no
    events). With ``op``, a plan whose args merely hold the op's marker (:func:`op_marker`) is among them too:
    the caller checks ``plan.op``.

    ``counted`` False: no counts (``{}``); they scan every plan row of ``owner`` (:func:`count_plans`).
    """
    marker = op_marker(op)
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = [tuple(r) for r in await conn.fetch(_LIST, states, owner, id_contains, marker, admin,
                                                   _NO_KEY if before is None else before, limit)]  # fmt: skip
        counts = {r[0]: r[1] for r in await conn.fetch(_COUNTS, owner)} if counted else {}
    keys: dict[str, int] = {}
    stored, damaged = decode_plans(rows, [], keep_rowids=keys)
    plans = sorted(((keys[p.created.plan_id], plan_from_store(p)) for p in stored), key=lambda kp: -kp[0])
    return plans, counts, len(damaged)


async def count_matching(conn: Any, states: list[str], *, owner: str | None = None, op: str = "",
                         id_contains: str = "", admin: bool = True) -> int:  # fmt: skip
    """How many plans a filtered listing matches (a scan of ``owner``'s rows: the caller charges it).

    With ``op``, a plan whose args hold the op's marker is counted too: rare enough for a total.
    """
    return int(await conn.fetchval(_MATCHING, states, owner, id_contains, op_marker(op), admin))


async def count_plans(conn: Any, owner: str | None = None) -> dict[str, int]:
    """Plans per state of ``owner`` (None: everyone's): a scan of every such row, so callers cache it."""
    return {r[0]: r[1] for r in await conn.fetch(_COUNTS, owner)}


async def shard_tips(conn: Any, shards: int) -> dict[int, int]:
    """Each shard's highest plan key now (-1: none yet)."""
    return {r[0]: r[1] for r in await conn.fetch(_TIPS, shards)}


async def new_plans(conn: Any, tips: dict[int, int], limit: int) -> list[tuple[int, str, int, str, str | None]]:
    """``[(key, id, shard, owner, name)]`` of the plans above each shard's tip, at most ``limit`` per shard, by key
    (``name``: the id its owner submitted, when it is not ``id``; else None)."""
    shards = sorted(tips)
    rows = await conn.fetch(_NEW, shards, [tips[s] for s in shards], limit)
    return [(r[0], r[1], r[2], r[3], r[4]) for r in rows]


async def plan_shard(conn: Any, plan_id: str, owner: str | None = None) -> tuple[int, str, int] | None:
    """``(shard, owner principal, store key)`` of the newest plan stored under the key ``plan_id`` (``owner``
    None: an admin's look-up), or of ``owner``'s it submitted as ``plan_id``; None when no shard holds one."""
    if owner is None:
        row = await conn.fetchrow(_SHARD_OF, plan_id)
    else:
        row = await conn.fetchrow(_SHARD_OF_OWN, plan_id, owner)
    return None if row is None else (row[0], row[1], row[2])


async def read_watched(conn: Any, watched: list[Watched]) -> dict[int, Plan]:
    """Each watched plan as stored now (key -> plan), with its inline events and its events rows from ``since``.

    A plan no longer stored (forgotten at retention) or damaged is absent.
    """
    keys = [w.key for w in watched]
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = [tuple(r) for r in await conn.fetch(_BY_KEY, keys)]
        events = [tuple(r) for r in await conn.fetch(_EVENTS_SINCE, keys, [w.since for w in watched])]
    rowids: dict[str, int] = {}  # a row's id (the core's key for the plan) -> its store key
    stored, _ = decode_plans(rows, events, keep_rowids=rowids)
    if len(rowids) == len(stored):
        return {rowids[p.created.plan_id]: plan_from_store(p) for p in stored}
    found: dict[int, Plan] = {}  # two shards' plans of one id (an admin follows both): each row on its own
    for row in rows:
        one, _ = decode_plans([row], [e for e in events if e[0] == row[0]])
        if one:
            found[row[0]] = plan_from_store(one[0])
    return found


def encode_workers(rows: list[WorkerInfo]) -> bytes:
    """One shard's registry as stored in ``fleetwire_shard_workers.workers``."""
    return _workers_encoder.encode(rows)


async def mark_wanted(conn: Any, key: str, for_s: float = WANTED_S) -> tuple[bool, Any]:
    """Mark ``key`` wanted of the owners for ``for_s``: ``(already wanted, the database's now())``."""
    row = await conn.fetchrow(_WANT, key, for_s)
    return bool(row[0]), row[1]


async def want_workers(conn: Any) -> tuple[bool, Any]:
    """Mark the registries wanted for :data:`WANTED_S`: ``(already wanted, the database's now())``."""
    return await mark_wanted(conn, "workers")


async def read_workers(conn: Any, since: Any = None) -> tuple[dict[int, list[WorkerInfo]], bool]:
    """Every served shard's registry (shard -> its workers), as its owner last wrote it, and whether
    every served shard's row was written at or after ``since`` (a database timestamp; None: any)."""
    found: dict[int, list[WorkerInfo]] = {}
    fresh = 0
    rows = await conn.fetch(_WORKERS, since or datetime.datetime.min.replace(tzinfo=datetime.UTC))
    for shard, blob, recent in rows:
        fresh += bool(recent)
        try:
            found[shard] = _workers_decoder.decode(blob)
        except msgspec.DecodeError:
            continue  # written by a newer fleetwire: left out rather than failing the view
    return found, fresh >= await conn.fetchval(_SERVED)
