"""Cross-shard views of a cluster: plans read from PostgreSQL by any coordinator (docs/CLUSTER.md).

A shard's core answers ``get_plan``/``plans`` for its own shard only. A coordinator's main port
(coordinator/io/cluster_host.py) answers, for every shard, from the committed rows:

* ``GET /v1/plans?id=ID``: ``{"plans": [PlanInfo]}``, the ``get_plan`` view (result included);
  404 when no shard holds that id;
* ``GET /v1/plans[?state=queued,running][&limit=N]``: ``{"plans": [...], "total": N, "counts":
  {state: n}}``, the ``plans`` listing view (no result bodies), highest store key first (keys come
  in blocks per coordinator, so that is roughly, not strictly, newest first); ``limit`` at most
  1000 (default 200).

The admin token only (``Authorization: Bearer``; every owner's plans are shown). Rows are decoded
with the shared decoders and checksums (coordinator/io/store_rows.py ``decode_plans``,
coordinator/recovery.py ``plan_from_store``); a damaged row is left out and counted in
``damaged``. What is read is what is committed: a core's view may be one group commit ahead.
"""

from __future__ import annotations

from typing import Any, Final, get_args

import msgspec

from coordinator.io.store_rows import decode_plans
from coordinator.recovery import plan_from_store
from protocol.messages import PlanStateName

__all__ = ["MAX_LIMIT", "PLAN_STATES", "ViewError", "parse_query", "read_plans"]

MAX_LIMIT: Final = 1000
PLAN_STATES: Final = get_args(PlanStateName)
_COLUMNS = "key, id, ord, state, spec, status, events, nevents, spec_crc, status_crc, events_crc"
_BY_ID = f"SELECT {_COLUMNS} FROM fleetwire_plans WHERE id = $1 ORDER BY key"
_EVENTS = "SELECT plan, seq, body, crc FROM fleetwire_events WHERE plan = ANY($1::bigint[]) ORDER BY plan, seq"
_LIST = f"SELECT {_COLUMNS} FROM fleetwire_plans WHERE cardinality($1::text[]) = 0 OR state = ANY($1::text[]) " \
        "ORDER BY key DESC LIMIT $2"  # fmt: skip
_COUNTS = "SELECT state, count(*) FROM fleetwire_plans GROUP BY state"


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
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            rows = [tuple(r) for r in await conn.fetch(_BY_ID, plan_id)]
            events = [tuple(r) for r in await conn.fetch(_EVENTS, [r[0] for r in rows])] if rows else []
        stored, damaged = decode_plans(rows, events)
        if not stored and not damaged:
            return 404, msgspec.json.encode({"error": f"no plan {plan_id!r} in any shard of this cluster"})
        infos = [plan_from_store(p).info() for p in stored]
        return 200, msgspec.json.encode({"plans": infos, "damaged": len(damaged)})
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        rows = [tuple(r) for r in await conn.fetch(_LIST, states, limit)]
        counts = {r[0]: r[1] for r in await conn.fetch(_COUNTS)}
    stored, damaged = decode_plans(rows, [])
    summaries = [plan_from_store(p) for p in stored]  # in key order, highest first
    total = sum(n for state, n in counts.items() if not states or state in states)
    body = {"plans": [p.summary() for p in summaries], "total": total, "counts": counts, "damaged": len(damaged)}
    return 200, msgspec.json.encode(body)
