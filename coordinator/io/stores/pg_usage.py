"""The usage ledger in the PostgreSQL store of cluster mode (coordinator/ledger.py, docs/SEMANTICS.md §Usage ledger).

Table (schema version 5, pg_schema.py ``MIGRATIONS``)::

    fleetwire_usage(shard, hour, principal, team, totals float8[], PRIMARY KEY (shard, hour, principal, team))
    index fleetwire_usage_by_principal ON fleetwire_usage (principal, hour)   -- a client's own rows

Each shard's core keeps its own ledger (one core per owned shard: coordinator/io/cluster/host.py), so its
rows are keyed by its shard too, and a shard's new owner reads that shard's rows back on load, as a
restarted SQLite coordinator reads its ``usage`` table: the same ledger state, folded the same way at the
core's next tick (the hours older than 35 days go to hour 0, the folded keys are deleted here).

* **Written** with the group that carries the core's :class:`~coordinator.records.UsageRows` (at most one a
  tick), as two more parts of that group's one commit statement (pg_schema.py ``commit_statement``'s
  ``usage_gone`` and ``usage_kept``: :data:`USAGE_PARTS`, their parameters from :func:`usage_params`), gated on
  its fence like the plans' rows: the fence holds the shard's lease row ``FOR SHARE`` until the commit, and a
  group whose fence fails writes nothing, so a stale-epoch core writes no usage. One statement, so a tick's
  group is one round trip like any other (it was BEGIN, the statement, a DELETE, an upsert a row and COMMIT,
  each a turn of the server's loop: docs/PERFORMANCE.md §C29s). Rows only for the hours that changed: no cost
  per plan.
* **One core holding several shards** (``fleetwire up`` or a lone ``CoordinatorServer`` on the database: its lease
  keeper holds every shard) loads all their rows summed per key and writes its rows under the lowest shard it
  holds. A key it writes or deletes is deleted from its other shards in the same statement, those shards fenced
  with the group (a core that lost one deletes none of its new owner's rows): their rows were
  summed into its own at the load, so left there they would be counted twice, by the cluster's sum and by its next
  load (a database used first by one core per shard, then by one core for all).
* **Totals** are a ``float8[]`` in :data:`coordinator.ledger.FIELDS` order (``UsageRow.values``), so the
  cluster-wide read sums them in the database; a shorter array (an older coordinator's) reads as zeros
  past its end. The plans' blobs carry our checksums; these numbers rely on PostgreSQL's own.
* **Read across the cluster** (:func:`cluster_totals`): the main port's view sessions answer ``get_usage``
  from here, every shard's rows summed (coordinator/io/cluster/sessions.py): whichever coordinator a client
  asked, the same figures, at most one tick behind each core's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from coordinator.ledger import BUCKET_S, FIELDS, Totals, UsageRow
from coordinator.records import UsageRows

__all__ = ["CREATE_USAGE", "USAGE_PARTS", "USAGE_TYPES", "cluster_totals", "load_usage", "usage_params", "usage_parts"]

# Version 5 (pg_schema.py MIGRATIONS[4]); ``IF NOT EXISTS``: a fresh database runs every step too. The index is a
# client's get_usage (its own rows across shards, not a scan of everyone's); built with the table, so empty: instant.
CREATE_USAGE: Final = """
CREATE TABLE IF NOT EXISTS fleetwire_usage (
    shard int NOT NULL,
    hour bigint NOT NULL,
    principal text NOT NULL,
    team text NOT NULL,
    totals float8[] NOT NULL,
    PRIMARY KEY (shard, hour, principal, team)
);
CREATE INDEX IF NOT EXISTS fleetwire_usage_by_principal ON fleetwire_usage (principal, hour);
"""
# The commit statement's usage parts (pg_schema.py commit_statement), {0}...: their parameters (USAGE_TYPES), {held}:
# the fence's gate, {shard}: the ledger's shard, the fence's lowest (PgStore._send adds it to the group's shards).
# ``usage_gone`` deletes (shard, key) rows; ``usage_kept`` upserts the ledger's rows, each one's totals a slice of
# one flat array of equal widths. The two never touch one row (usage_params): a row changed twice by one statement
# is an error (an upsert's) or undefined (a delete's).
USAGE_PARTS: Final = {
    "usage_gone": """DELETE FROM fleetwire_usage u
    USING (SELECT unnest({0}) AS shard, unnest({1}) AS hour, unnest({2}) AS principal, unnest({3}) AS team) AS d
    WHERE u.shard = d.shard AND u.hour = d.hour AND u.principal = d.principal AND u.team = d.team AND {held}""",
    "usage_kept": """INSERT INTO fleetwire_usage (shard, hour, principal, team, totals)
    SELECT {shard}, v.hour, v.principal, v.team, ({3})[v.i * v.w - v.w + 1 : v.i * v.w]
    FROM (SELECT unnest({0}) AS hour, unnest({1}) AS principal, unnest({2}) AS team,
                 generate_series(1, cardinality({0})) AS i, cardinality({3}) / cardinality({0}) AS w) AS v
    WHERE {held}
    ON CONFLICT (shard, hour, principal, team) DO UPDATE SET totals = excluded.totals""",
}
USAGE_TYPES: Final = {
    "usage_gone": ("int[]", "bigint[]", "text[]", "text[]"),
    "usage_kept": ("bigint[]", "text[]", "text[]", "float8[]"),
}
_SELECT = "SELECT hour, principal, team, totals FROM fleetwire_usage WHERE shard = ANY($1::int[])"
# Every shard's rows summed per principal (or team) and field, from an hour on, for some principals or all.
_TOTALS = """
SELECT {by} AS name, t.i, sum(t.v)
    FROM fleetwire_usage u, unnest(u.totals) WITH ORDINALITY AS t(v, i)
    WHERE u.hour >= $1 AND ($2::text[] IS NULL OR u.principal = ANY($2::text[]))
    GROUP BY 1, 2
"""
# A principal's team: that of its newest row (rows keep the team of their hour, coordinator/ledger.py).
_TEAMS = """
SELECT DISTINCT ON (principal) principal, team FROM fleetwire_usage
    WHERE hour >= $1 AND ($2::text[] IS NULL OR principal = ANY($2::text[]))
    ORDER BY principal, hour DESC
"""

Key = tuple[int, str, str]


def usage_parts(records: Sequence[UsageRows]) -> tuple[list[Key], dict[Key, list[float]]]:
    """The keys to delete and the rows to keep of a group's :class:`UsageRows`, in order (a later row wins)."""
    deleted: list[Key] = []
    kept: dict[Key, list[float]] = {}
    for record in records:
        for key in record.deleted:
            key = (int(key[0]), str(key[1]), str(key[2]))
            deleted.append(key)
            kept.pop(key, None)
        for hour, principal, team, values in record.rows:
            kept[hour, principal, team] = [float(v) for v in values]
    return deleted, kept


def usage_params(shards: Sequence[int], records: Sequence[UsageRows]) -> tuple[list[Any], list[Any]]:
    """The parameters of a group's :data:`USAGE_PARTS` (``usage_gone``'s, ``usage_kept``'s; an empty list: no such
    part). ``shards``: those the core holds (its fence), lowest first: the rows go to the first, and the keys written
    or deleted are deleted from the others (rows summed into the core's at its load: see the module's docstring).
    A key deleted and then written again in the group is only written (the upsert replaces the row)."""
    shard, others = shards[0], list(shards[1:])
    deleted, kept = usage_parts(records)
    gone = dict.fromkeys((s, k) for s in others for k in kept)
    gone.update(dict.fromkeys((s, k) for k in deleted for s in shards if s != shard or k not in kept))
    gone_params: list[Any] = []
    if gone:
        gone_params = [[s for s, _ in gone], *_columns([k for _, k in gone])]
    kept_params: list[Any] = []
    if kept:
        width = max(len(v) for v in kept.values())
        flat = [x for v in kept.values() for x in (v + [0.0] * (width - len(v)) if len(v) < width else v)]
        kept_params = [*_columns(list(kept)), flat]  # a shorter row padded with zeros: read as zeros either way
    return gone_params, kept_params


def _columns(keys: list[Key]) -> list[Any]:
    return [[k[0] for k in keys], [k[1] for k in keys], [k[2] for k in keys]]


async def load_usage(conn: Any, shards: list[int]) -> list[UsageRow]:
    """The ledger rows of ``shards`` (a shard's load); rows of one key in several shards are added up."""
    merged: dict[Key, UsageRow] = {}
    for hour, principal, team, totals in await conn.fetch(_SELECT, shards):
        row = UsageRow.of(int(hour), principal, team, totals)
        key = (row.hour_s, principal, team)
        into = merged.get(key)
        if into is None:
            merged[key] = row
        else:
            into.totals.add(row.totals)
    return list(merged.values())


async def cluster_totals(
    conn: Any, by: str = "principal", *, since_s: float | None = None, only: Sequence[str] | None = None
) -> tuple[dict[str, Totals], dict[str, str]]:
    """Every shard's totals by principal or team (as ``UsageLedger.totals``), and each principal's team.

    ``since_s``: whole hours from the one that holds it (None: all, hour 0's folded rows included);
    ``only``: these principals (a client sees its own).
    """
    start = -1 if since_s is None else int(since_s // BUCKET_S) * BUCKET_S
    names = None if only is None else list(only)
    column = "u.principal" if by == "principal" else "u.team"
    result: dict[str, Totals] = {}
    for name, index, value in await conn.fetch(_TOTALS.format(by=column), start, names):
        if not 1 <= index <= len(FIELDS):
            continue
        totals = result.get(name)
        if totals is None:
            totals = result[name] = Totals()
        field = FIELDS[index - 1]
        setattr(totals, field, type(getattr(totals, field))(value or 0))
    teams: dict[str, str] = {}
    if by == "principal":
        teams = {principal: team for principal, team in await conn.fetch(_TEAMS, start, names)}
    return result, teams
