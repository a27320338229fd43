"""The PostgreSQL store's schema and statements (coordinator/io/stores/postgres.py runs them).

Tables (``fleetwire_meta.schema_version`` = :data:`SCHEMA_VERSION`, created or migrated on open)::

    fleetwire_meta(key PRIMARY KEY, value)    -- schema_version, cluster_name, shards, pool_partitions
    shard_leases(shard PRIMARY KEY, owner, owner_url, epoch, expires_at, acquired_at)
    fleetwire_plans(key PRIMARY KEY, shard, ord, spec_crc, id, owner, name, spec,
                    state, nevents, status_crc, events_crc, status, events)  -- name: version 4; this order: 6
    fleetwire_events(plan, seq, shard, body, crc, PRIMARY KEY (plan, seq))
    fleetwire_coordinators(owner PRIMARY KEY, url, expires_at)   -- live coordinators (version 2)
    fleetwire_shard_workers(shard PRIMARY KEY, owner, epoch, workers, written_at)  -- (version 3)
    fleetwire_views(key PRIMARY KEY, wanted_until)     -- registries wanted by a view (version 3)
    fleetwire_usage(shard, hour, principal, team, totals, PRIMARY KEY (shard, hour, principal, team))
                                                       -- the usage ledger, per shard (version 5: pg_usage.py)
    index fleetwire_plans_by_id ON fleetwire_plans (id)  -- the views' look-up by id (version 3)
    index fleetwire_plans_by_shard ON fleetwire_plans (shard, key)  -- a shard's plans, newest (version 3)
    index fleetwire_plans_by_name ON fleetwire_plans (owner, name) WHERE name IS NOT NULL  -- (version 4)

``id`` is a plan's key in its shard's core, ``name`` the id its owner submitted when that is not the key
(another principal's plan held it: coordinator/plans.py ``PlanNames``), NULL otherwise, as in every row
written before version 4: a client's look-up by the id it knows is ``owner = $2 AND (name = $1 OR (id = $1
AND name IS NULL))`` (coordinator/io/cluster/views.py), through the two indexes.

A database of an older version is migrated at open, every step in the same transaction as the
version bump (:data:`MIGRATIONS`); one of a newer version is refused, naming both versions. The
one exception is the indexes of versions 3 and 4 on a migrated database: a plain ``CREATE INDEX``
would hold every shard's commits for the whole build and ``CREATE INDEX CONCURRENTLY`` cannot
run in a transaction, so a fresh database gets them with its tables (an empty table: instant) and
a migrated one gets them from ``ensure_indexes`` (postgres.py) right after open, concurrently on a
connection of its own (the cluster host's start; one left invalid by an interrupted build is
dropped and built again). Until they are there, the views' reads are sequential scans, nothing worse.

``fleetwire_plans`` keeps two thirds of each page free for updates (``fillfactor`` :data:`PLANS_FILLFACTOR`, set
at open where the table has none, an operator's own kept): a plan's row is updated about three times right
after its insert (leased, running, done), and with full pages none of those updates was HOT (~1 %), so each
one added an entry to every index. With room on the page they are HOT: PostgreSQL's CPU per plan went
from 36-42 to 23-25 us (groups of bench/store_bench.py's plans; docs/PERFORMANCE.md §Cluster mode), and
the indexes stop filling with dead entries, at the price of a plans table about twice its packed size.
Half a page (fillfactor 50 before) was not enough: a worker's frame updates every plan of a
page in one statement, each row growing by its status and first events, and those new versions cannot be
pruned during it, so ~17 % of the updates in bench/cluster_throughput.py went to other pages (every index
written again); with 35 none did, the WAL a plan fell by 6-10 % and the indexes by ~28 %, the table grew ~11 %
(docs/PERFORMANCE.md §C29f, "WAL a plan"). A table made with 50 keeps it (only a table with none is set).

**The WAL of an update.** PostgreSQL logs an update that stays on its page (a HOT one, above) as the new row
less the bytes it shares with the old one at its start and at its end, so the columns a plan's updates never
change (its key, shard, order, ids and ``spec``) come first, and ``events`` (appended to, or left as it was)
last. In the order of versions 1-5 (``state`` before ``spec``, then ``status``, ``events``, the counts and
checksums) every update logged the plan's spec again: 176 of its ~575 bytes in bench/cluster_throughput.py's
echo plans (docs/PERFORMANCE.md §C29f, "WAL a plan").

``key`` plays SQLite's rowid: an integer per plan, taken in blocks of 1024 from the sequence
``fleetwire_plan_keys`` (unique across every coordinator of the cluster), the key of the events
rows and the seed of their checksum. The blobs and checksums are the SQLite store's
(coordinator/io/stores/rows.py). The cluster's name, shard count and pool partitions
(``--pool-partitions``, :func:`partitions_text`) are kept in ``fleetwire_meta``: another name,
another count, other partitions or a newer schema is refused at open. (A database of version 2
or older kept no partitions: the first coordinator of version 3 to open it records its own.)

A group commit is ONE statement (:func:`commit_statement`): the fence
(:data:`~coordinator.io.cluster.leases.FENCE`) and the group's deletes, inserts, updates and event
upserts (and, once a tick, the usage ledger's rows: pg_usage.py) as parts of one ``WITH`` query,
each row kind's columns of one type sent as one array parameter (a slice per column:
:func:`commit_statement`'s notes) that ``unnest()`` reads back, row by row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import structlog

from coordinator.io.cluster.leases import FENCE
from coordinator.io.stores.integrity import StoreError
from coordinator.io.stores.pg_usage import CREATE_USAGE, USAGE_PARTS, USAGE_TYPES
from coordinator.shards import ClusterConfig

__all__ = ["INDEXES", "INDEX_VALID", "MIGRATIONS", "PART_COLUMNS", "PLANS_FILLFACTOR", "SCHEMA_VERSION",
           "SELECT_EVENTS", "SELECT_PLANS", "commit_statement", "partitions_text", "setup_schema"]

log = structlog.get_logger("coordinator.io.stores.postgres")  # the store's own lines, as before this module

SCHEMA_VERSION: Final = 6
_CREATE_META = "CREATE TABLE IF NOT EXISTS fleetwire_meta (key text PRIMARY KEY, value text NOT NULL)"
_CREATE_V1 = """
CREATE TABLE shard_leases (
    shard int PRIMARY KEY,
    owner text NOT NULL DEFAULT '',
    owner_url text NOT NULL DEFAULT '',
    epoch bigint NOT NULL DEFAULT 0,
    expires_at timestamptz NOT NULL DEFAULT '-infinity',
    acquired_at timestamptz
);
CREATE TABLE fleetwire_plans (
    key bigint PRIMARY KEY,
    shard int NOT NULL,
    id text NOT NULL,
    owner text NOT NULL,
    ord bigint NOT NULL,
    state text NOT NULL,
    spec bytea NOT NULL,
    status bytea,
    events bytea,
    nevents int NOT NULL DEFAULT 0,
    spec_crc bigint NOT NULL,
    status_crc bigint,
    events_crc bigint
);
CREATE TABLE fleetwire_events (
    plan bigint NOT NULL,
    seq int NOT NULL,
    shard int NOT NULL,
    body bytea NOT NULL,
    crc bigint NOT NULL,
    PRIMARY KEY (plan, seq)
);
CREATE SEQUENCE fleetwire_plan_keys START 1 INCREMENT 1024;
"""
# Version 2: the coordinators' heartbeat rows (coordinator/io/cluster/host.py: live coordinators and
# the fair share of slots). Before, the cluster host created it outside the versioned schema; ``IF NOT
# EXISTS`` keeps a version 1 database that already has it (same columns) as it is.
_MIGRATE_V1 = """
CREATE TABLE IF NOT EXISTS fleetwire_coordinators (
    owner text PRIMARY KEY,
    url text NOT NULL,
    expires_at timestamptz NOT NULL
);
"""
# Version 3: the cross-shard views' tables (coordinator/io/cluster/views.py: each shard's registry as
# its owner wrote it, and whether a view wants them written). Before, the cluster host created them
# outside the versioned schema; ``IF NOT EXISTS`` keeps a version 2 database's (same columns) as they are.
_MIGRATE_V2 = """
CREATE TABLE IF NOT EXISTS fleetwire_shard_workers (
    shard int PRIMARY KEY,
    owner text NOT NULL,
    epoch bigint NOT NULL,
    workers bytea NOT NULL,
    written_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS fleetwire_views (key text PRIMARY KEY, wanted_until timestamptz NOT NULL);
"""
# Version 4: plan ids scoped per principal (issue #24 part 6): the id a plan's owner submitted, where it is not
# the plan's key (its ``id``). NULL (the column's default) is "the same as id", so no row is rewritten.
_MIGRATE_V3 = """
ALTER TABLE fleetwire_plans ADD COLUMN IF NOT EXISTS name text;
"""
# Version 5: the usage ledger's rows, per shard (coordinator/io/stores/pg_usage.py); a new table, nothing rewritten.
# Version 6: fleetwire_plans' columns in a new order, the ones a plan's updates never change first (the module
# docstring: the WAL of an update). PostgreSQL cannot move a column, so the table is copied into its new order:
# its options (fillfactor), grants to other roles and valid indexes besides the key are carried over (an index
# the old table lacked stays for ensure_indexes to build online), and a view or foreign key on it fails the
# step (nothing changes; the coordinator does not start). Every row is rewritten under the migration's lock.
_PLANS_V6_COLUMNS = ("key, shard, ord, spec_crc, id, owner, name, spec, "
                     "state, nevents, status_crc, events_crc, status, events")  # fmt: skip
_MIGRATE_V5 = f"""
DO $$
DECLARE
    opts text[];
    indexes text[];
    def text;
    g record;
BEGIN
    SELECT c.reloptions INTO opts FROM pg_class c WHERE c.oid = 'fleetwire_plans'::regclass;
    SELECT array_agg(pg_get_indexdef(i.indexrelid)) INTO indexes FROM pg_index i
    WHERE i.indrelid = 'fleetwire_plans'::regclass AND NOT i.indisprimary AND i.indisvalid;
    CREATE TABLE fleetwire_plans_v6 (
        key bigint NOT NULL,
        shard int NOT NULL,
        ord bigint NOT NULL,
        spec_crc bigint NOT NULL,
        id text NOT NULL,
        owner text NOT NULL,
        name text,
        spec bytea NOT NULL,
        state text NOT NULL,
        nevents int NOT NULL DEFAULT 0,
        status_crc bigint,
        events_crc bigint,
        status bytea,
        events bytea
    );
    IF opts IS NOT NULL THEN
        EXECUTE format('ALTER TABLE fleetwire_plans_v6 SET (%s)', array_to_string(opts, ', '));
    END IF;
    INSERT INTO fleetwire_plans_v6 ({_PLANS_V6_COLUMNS}) SELECT {_PLANS_V6_COLUMNS} FROM fleetwire_plans;
    FOR g IN SELECT a.grantee, a.privilege_type, a.is_grantable FROM pg_class c, aclexplode(c.relacl) a
             WHERE c.oid = 'fleetwire_plans'::regclass AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT %s ON fleetwire_plans_v6 TO %s%s', g.privilege_type,
                       CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.grantee)) END,
                       CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    DROP TABLE fleetwire_plans;
    ALTER TABLE fleetwire_plans_v6 RENAME TO fleetwire_plans;
    ALTER TABLE fleetwire_plans ADD PRIMARY KEY (key);
    FOREACH def IN ARRAY coalesce(indexes, '{{}}') LOOP
        EXECUTE def;
    END LOOP;
    -- The planner's figures for a copied table at once, not at an autovacuum later; an empty one (a new
    -- database passes through this step too) is left never analyzed: analyzed empty, its statements' generic
    -- plans would scan it whole as it grows (a lone commit 1.6 -> 3.5 ms at 10,000 plans).
    IF EXISTS (SELECT 1 FROM fleetwire_plans) THEN
        ANALYZE fleetwire_plans;
    END IF;
END $$;
"""
MIGRATIONS: Final[dict[int, str]] = {1: _MIGRATE_V1, 2: _MIGRATE_V2, 3: _MIGRATE_V3, 4: CREATE_USAGE,
                                     5: _MIGRATE_V5}  # N -> N + 1  # fmt: skip
# Versions 3 and 4's indexes, name -> columns: the views' look-up of a plan by id (get_plan, cancel, subscribe
# on a main port: an admin's by key, a client's by the id it submitted, whose rare name rows the partial index
# holds) and a shard's plans by key (a subscribe to all plans on a main port: each shard's new plans; the load
# of a shard taken over). Created with the tables of a fresh database; on a migrated one by ensure_indexes.
INDEXES: Final = {
    "fleetwire_plans_by_id": "fleetwire_plans (id)",
    "fleetwire_plans_by_shard": "fleetwire_plans (shard, key)",
    "fleetwire_plans_by_name": "fleetwire_plans (owner, name) WHERE name IS NOT NULL",
}
_CREATE_INDEXES = "".join(f"CREATE INDEX IF NOT EXISTS {name} ON {on};\n" for name, on in INDEXES.items())
INDEX_VALID = """SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
WHERE c.relname = $1 AND c.relnamespace = to_regnamespace(current_schema())::oid"""

PLANS_FILLFACTOR: Final = 35  # % of each fleetwire_plans page filled by inserts: the rest for HOT updates
_PLANS_FILLFACTOR_SET = """SELECT coalesce(bool_or(o LIKE 'fillfactor=%'), false)
FROM pg_class c, unnest(c.reloptions) AS o WHERE c.oid = 'fleetwire_plans'::regclass"""
_SET_PLANS_FILLFACTOR = f"ALTER TABLE fleetwire_plans SET (fillfactor = {PLANS_FILLFACTOR})"

SELECT_PLANS = (  # decode_plans' columns (coordinator/io/stores/rows.py), then the shard
    "SELECT key, id, ord, state, spec, status, events, nevents, spec_crc, status_crc, events_crc, shard "
    "FROM fleetwire_plans WHERE shard = ANY($1::int[])"
)
SELECT_EVENTS = "SELECT plan, seq, body, crc FROM fleetwire_events WHERE shard = ANY($1::int[]) ORDER BY plan, seq"
# One group commit is ONE statement (one round trip, its own transaction), built from the parts
# the group has (a statement per combination, prepared once per connection by asyncpg): the fence
# locks the lease rows it checks (FOR SHARE: a takeover's UPDATE waits for this commit, or this
# commit sees the new epoch and writes nothing), and every data-modifying part runs only when every
# shard written is still held (``ok``, an InitPlan evaluated before them; for one shard, the fence's row
# exists: _ONE_SHARD_FENCE). The answer is the shards the fence found held; fewer than asked means
# nothing was written.
#
# A part's columns of one type travel as ONE array parameter, a slice per column (``({0})[2:2]`` is the
# second), each column folded into rows of about sqrt(n) values, NULL-padded (pg_rows.py ``grid``;
# ``unnest`` reads a slice back in order and the padding rows, key NULL, are skipped): asyncpg finds an
# array parameter's shape by checking its elements against collections.abc's Iterable and Sized in
# Python (~0.12 us each), but only along the first element of each dimension, so a group of n rows
# costs ~sqrt(n) checks a column, not n (bench/store_bench.py's plan: ~51 checks before, ~2 now).
#
# The slices are unnested in a subquery's select list (``SELECT unnest(a) AS key, unnest(b) AS shard ...``:
# set-returning functions there run in step, row by row, a ProjectSet node), not as ``FROM unnest(a, b, ...) AS
# v(...)``: a function in FROM is a Function Scan, which first copies every row of the group into a tuplestore and
# then reads it back (10.6 % of a backend's CPU in a perf profile of grouped commits). The same rows (the slices are
# of equal length, so none is padded), ~1.4-2.7 us less of PostgreSQL's CPU a plan (bench/store_bench.py's plans in
# groups of ~2,700 records: 18.3-19.7 against 16.7-17.3; docs/PERFORMANCE.md §C29g2).
def _rows(columns: tuple[tuple[int, int], ...], names: str) -> str:
    """``(SELECT unnest(({p})[1:1]) AS n1, ...) AS v``: the columns of each ``(param, count)``, as rows of ``names``."""
    slices = [f"({{{param}}})[{i}:{i}]" for param, count in columns for i in range(1, count + 1)]
    named = names.split(", ")
    assert len(slices) == len(named), names
    return "(SELECT " + ", ".join(f"unnest({c}) AS {n}" for c, n in zip(slices, named, strict=True)) + ") AS v"


_NEW_COLUMNS = ("key, shard, ord, nevents, spec_crc, status_crc, events_crc, "
                "id, owner, state, name, spec, status, events")  # fmt: skip
_CHANGED_COLUMNS = "key, nevents, status_crc, events_crc, state, status, events"

_PARTS: Final = (  # (name, SQL with {0}, {1}... for its parameters, their types)
    ("gone_plans", "DELETE FROM fleetwire_plans WHERE key = ANY({0}) AND {held}", ("bigint[]",)),
    ("gone_events", "DELETE FROM fleetwire_events WHERE plan = ANY({0}) AND {held}", ()),
    ("created", f"""INSERT INTO fleetwire_plans (key, shard, ord, nevents, spec_crc, status_crc, events_crc,
                                 id, owner, state, name, spec, status, events)
    SELECT * FROM {_rows(((0, 7), (1, 4), (2, 3)), _NEW_COLUMNS)}
    WHERE v.key IS NOT NULL AND {{held}}""",
     ("bigint[]", "text[]", "bytea[]")),
    ("changed", f"""UPDATE fleetwire_plans AS p SET
        state = coalesce(v.state, p.state),
        status = coalesce(v.status, p.status),
        events = CASE WHEN v.events IS NULL THEN p.events ELSE coalesce(p.events, ''::bytea) || v.events END,
        nevents = p.nevents + v.nevents,
        status_crc = coalesce(v.status_crc, p.status_crc),
        events_crc = coalesce(v.events_crc, p.events_crc)
    FROM {_rows(((0, 4), (1, 1), (2, 2)), _CHANGED_COLUMNS)}
    WHERE p.key = v.key AND {{held}}""",
     ("bigint[]", "text[]", "bytea[]")),
    ("runs", f"""INSERT INTO fleetwire_events (plan, seq, shard, crc, body)
    SELECT * FROM {_rows(((0, 4), (1, 1)), "plan, seq, shard, crc, body")}
    WHERE v.plan IS NOT NULL AND {{held}}
    ON CONFLICT (plan, seq) DO UPDATE SET body = excluded.body, crc = excluded.crc""",
     ("bigint[]", "bytea[]")),
)
#: Each row part's columns, in runs of one type: one array parameter a run (a lone group: that many scalars);
#: PgStore._commit slices its rows by them, the statements read them in the same order (_rows).
PART_COLUMNS: Final = {"created": (7, 4, 3), "changed": (4, 1, 2), "runs": (4, 1)}
# A lone group's row parts (commit_statement's ``lone``): the one row's values, scalar parameters in PART_COLUMNS'
# order ({0} the first), written where the rows' columns are read: no array built, sliced and unnested (a ProjectSet
# under a Subquery Scan, and a Nested Loop for the update) in a plan the backend sets up again at every execution.
# The writer backend's CPU a lone commit ~25-30 us less (/dev/shm: ~117-137 against ~92-107; docs/PERFORMANCE.md
# §C29o). The same rows, the same gate on the fence (``ok``), the same parameters.
_LONE_PARTS: Final = {
    "created": """INSERT INTO fleetwire_plans (key, shard, ord, nevents, spec_crc, status_crc, events_crc,
                                 id, owner, state, name, spec, status, events)
    SELECT {0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13} WHERE {held}""",
    "changed": """UPDATE fleetwire_plans AS p SET
        state = coalesce({4}, p.state),
        status = coalesce({5}, p.status),
        events = CASE WHEN {6} IS NULL THEN p.events ELSE coalesce(p.events, ''::bytea) || {6} END,
        nevents = p.nevents + {1},
        status_crc = coalesce({2}, p.status_crc),
        events_crc = coalesce({3}, p.events_crc)
    WHERE p.key = {0} AND {held}""",
    "runs": """INSERT INTO fleetwire_events (plan, seq, shard, crc, body)
    SELECT {0}, {1}, {2}, {3}, {4} WHERE {held}
    ON CONFLICT (plan, seq) DO UPDATE SET body = excluded.body, crc = excluded.crc""",
}
# The fence over one shard's two scalars (commit_statement's ``one_shard``): FENCE's conditions on the lease row
# itself, read through its primary key, and locked the same way (FOR SHARE: a takeover's UPDATE waits for this
# commit, or this commit, having waited, finds the new epoch or owner and writes nothing); each data part runs when
# the fence found the row (``EXISTS``: the shard is the key, so one row at most). No join with a VALUES list and no
# count() over the fence: two Aggregates, a Nested Loop and a Values Scan fewer for the backend to set up at each
# execution, ~10 us of its CPU a lone commit (docs/PERFORMANCE.md §C29o).
_ONE_SHARD_FENCE: Final = (
    "fence AS (SELECT shard FROM shard_leases "
    "WHERE shard = $1::int AND epoch = $2::bigint AND owner = $3 AND expires_at > now() FOR SHARE)"
)
assert "WHERE l.owner = $3 AND l.expires_at > now()\nFOR SHARE OF l" in FENCE, "FENCE changed: _ONE_SHARD_FENCE too"
_FENCES: Final = (  # (the fence and its check, each data part's gate): over arrays of shards and epochs, over one
    (f"fence AS ({FENCE}),\nok AS (SELECT count(*) = cardinality($1::int[]) AS held FROM fence)",
     "(SELECT held FROM ok)"),
    (_ONE_SHARD_FENCE, "EXISTS (SELECT FROM fence)"),
)  # fmt: skip
_COMMITS: dict[tuple[bool, bool, bool, bool, bool, bool, bool, bool], str] = {}


def commit_statement(
    doomed: bool,
    created: bool,
    changed: bool,
    runs: bool,
    lone: bool = False,
    one_shard: bool = False,
    usage_gone: bool = False,
    usage_kept: bool = False,
) -> str:
    """The one statement of a group commit with these parts ($1-$3: the fence's shards, epochs, owner).

    ``one_shard``: $1 and $2 are the one shard's number and epoch, scalars, not arrays (the same fence).

    ``usage_gone``, ``usage_kept``: the usage ledger's deletes and rows (pg_usage.py ``USAGE_PARTS``), last, gated on
    the fence as the plans' parts; the rows go to the fence's first shard (the lowest: the ledger's, PgStore._send).
    A tick's group is one statement too, not a transaction of four or more (docs/PERFORMANCE.md §C29s).

    ``lone``: each row part holds one row, whose values are scalar parameters, in the order of the parts'
    columns, read where the part reads its row's columns (``_LONE_PARTS``: the insert's select list, the update's
    SET and key): asyncpg checks an array parameter's shape in Python, two to four ABC ``isinstance`` checks a
    parameter and a value (~1,300 instructions each), which a scalar parameter does not pay, and the server
    builds, slices and unnests no array. The deletes' keys stay an array.
    """
    key = (doomed, created, changed, runs, lone, one_shard, usage_gone, usage_kept)
    sql = _COMMITS.get(key)
    if sql is None:
        wanted = (doomed, doomed, created, changed, runs)
        fence, held = _FENCES[one_shard]
        parts = [fence]
        n = 4
        for (name, text, types), on in zip(_PARTS, wanted, strict=True):
            if not on:
                continue
            if name == "gone_events":  # the same keys as gone_plans
                parts.append(f"{name} AS ({text.format(f'${n - 1}::bigint[]', held=held)})")
                continue
            counts = PART_COLUMNS.get(name) if lone else None
            if counts is None:
                params = [f"${n + i}::{t}" for i, t in enumerate(types)]
                n += len(types)
            else:
                params = []
                for t, count in zip(types, counts, strict=True):
                    params += (f"${n + i}::{t[:-2]}" for i in range(count))
                    n += count
                text = _LONE_PARTS[name]
            parts.append(f"{name} AS ({text.format(*params, held=held)})")
        shard = "$1::int" if one_shard else "($1::int[])[1]"
        for name, on in (("usage_gone", usage_gone), ("usage_kept", usage_kept)):
            if on:
                types = USAGE_TYPES[name]
                params = [f"${n + i}::{t}" for i, t in enumerate(types)]
                n += len(types)
                parts.append(f"{name} AS ({USAGE_PARTS[name].format(*params, held=held, shard=shard)})")
        sql = _COMMITS[key] = "WITH " + ",\n".join(parts) + "\nSELECT ARRAY(SELECT shard FROM fence)"
    return sql


def partitions_text(partitions: Iterable[tuple[str, int]]) -> str:
    """``--pool-partitions`` as kept in ``fleetwire_meta``: ``gpu=4,llm=2`` by pool name ("" for none)."""
    return ",".join(f"{pool}={k}" for pool, k in sorted(partitions))


async def setup_schema(conn: Any, config: ClusterConfig, description: str) -> None:
    """Create or migrate the schema on ``conn``; check the version, the cluster's name, shard count and partitions.

    Raises:
        StoreError: a newer schema, another cluster's database, another shard count or other partitions
        (one line naming both values); asyncpg's ``PostgresError`` when a statement fails.
    """
    import asyncpg  # type: ignore[import-untyped]

    try:
        await conn.execute(_CREATE_META)
    except asyncpg.UniqueViolationError:  # two coordinators created it at once: it exists now
        pass
    async with conn.transaction():
        # Coordinators starting together create or migrate one at a time (no advisory lock).
        await conn.execute("LOCK TABLE fleetwire_meta IN SHARE ROW EXCLUSIVE MODE")
        meta = {r["key"]: r["value"] for r in await conn.fetch("SELECT key, value FROM fleetwire_meta")}
        version = int(meta.get("schema_version", "0"))
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"the database at {description} has fleetwire schema version {version}; this "
                f"coordinator knows versions up to {SCHEMA_VERSION}: run a newer fleetwire"
            )
        if version == 0:
            steps = "".join(MIGRATIONS[v] for v in range(1, SCHEMA_VERSION))
            await conn.execute(_CREATE_V1 + steps + _CREATE_INDEXES + _SET_PLANS_FILLFACTOR)
            await conn.executemany(
                "INSERT INTO fleetwire_meta (key, value) VALUES ($1, $2)",
                [("schema_version", str(SCHEMA_VERSION)), ("cluster_name", config.name),
                 ("shards", str(config.shards)), ("pool_partitions", partitions_text(config.partitions))],
            )
            await conn.execute(
                "INSERT INTO shard_leases (shard) SELECT generate_series(0, $1::int - 1)", config.shards
            )
            log.info("cluster created in PostgreSQL", store=description, cluster=config.name,
                     shards=config.shards, schema_version=SCHEMA_VERSION)  # fmt: skip
            return
        for step in range(version, SCHEMA_VERSION):
            await conn.execute(MIGRATIONS[step])
        if version != SCHEMA_VERSION:
            await conn.execute("UPDATE fleetwire_meta SET value = $1 WHERE key = 'schema_version'",
                               str(SCHEMA_VERSION))  # fmt: skip
        name, shards = meta.get("cluster_name", ""), int(meta.get("shards", "0"))
        if name != config.name:
            raise StoreError(
                f"the database at {description} belongs to cluster {name!r}, not {config.name!r} "
                "(--cluster-name): two clusters must not share one database; give this one its own "
                "database, or the same --cluster-name to join that cluster"
            )
        if shards != config.shards:
            raise StoreError(
                f"cluster {name!r} at {description} has {shards} shard slots, not {config.shards} "
                "(--shards): the count is fixed when the cluster is created"
            )
        ours = partitions_text(config.partitions)
        if "pool_partitions" not in meta:  # not kept before version 3: the first to open it records its own
            await conn.execute("INSERT INTO fleetwire_meta (key, value) VALUES ('pool_partitions', $1)", ours)
        elif meta["pool_partitions"] != ours:
            stored = meta["pool_partitions"]
            raise StoreError(
                f"cluster {name!r} at {description} splits pools as --pool-partitions "
                f"{stored or '(none)'}, not {ours or '(none)'}: every coordinator of a cluster must be given "
                "the same (a pool's plans and workers are routed by it)"
            )
        if version != SCHEMA_VERSION:
            log.info("fleetwire schema migrated", store=description, from_version=version,
                     to_version=SCHEMA_VERSION)  # fmt: skip
        await _leave_room_for_updates(conn, description)


async def _leave_room_for_updates(conn: Any, description: str) -> None:
    """Set fleetwire_plans' fillfactor (:data:`PLANS_FILLFACTOR`) where it has none: the module docstring.

    Only a ShareUpdateExclusive lock (commits and reads go on); one not had within 2 s (an
    anti-wraparound vacuum of the table holds it), or a database user that does not own the table,
    leaves the table as it is (a warning) and the open goes on.
    """
    import asyncpg  # type: ignore[import-untyped]

    if await conn.fetchval(_PLANS_FILLFACTOR_SET):
        return  # ours, or an operator's own
    try:
        async with conn.transaction():  # a savepoint: its failure leaves the setup's transaction as it was
            await conn.execute("SET LOCAL lock_timeout = '2s'")
            await conn.execute(_SET_PLANS_FILLFACTOR)
    except asyncpg.PostgresError as exc:  # locked (an anti-wraparound vacuum), or a user who does not own the table
        log.warning("fleetwire_plans' fillfactor is left unset (docs/CLUSTER.md)", store=description,
                    error=" ".join(str(exc).split())[:200])  # fmt: skip
        return
    log.info("fleetwire_plans now leaves room on each page for updates", store=description,
             fillfactor=PLANS_FILLFACTOR)  # fmt: skip
