"""The SQLite store's tables, one definition per table version, and the migrations between versions.

``coordinator/io/stores/sqlite.py`` writes and reads these tables; ``coordinator/io/stores/integrity.py`` checks
them. A new file is created as version 3's tables followed by every later migration, so the
current schema and the path an old file takes to it are the same statements.

Version 6 (this one)::

    plans(id, owner, ord, state, spec BLOB, status BLOB, events BLOB, nevents,
          spec_crc, status_crc, events_crc, gen)             -- rowid: submit order
    events(plan, seq, body BLOB, crc, PRIMARY KEY (plan, seq))
    store_meta(generation)                                    -- one row: groups committed (see below)
    usage(hour, principal, team, totals BLOB, crc, PRIMARY KEY (hour, principal, team))  -- the usage ledger

Checksums (:func:`crc`) are CRC-32 of the stored bytes: ``spec_crc`` of ``spec``,
``status_crc`` of ``status``, ``events_crc`` of the whole inline ``events`` blob (kept running:
an appended run continues the previous value), ``events.crc`` of ``body`` seeded with the
plan's rowid, so a run moved to another plan does not verify either.

The generation (:data:`GENERATION`) counts committed groups; a side file next to the database
(``<db>.generation``) holds the same number, written after each commit, so a database found behind
it lost acknowledged commits. It is ``max(store_meta.generation, max(plans.gen))``: a group that
writes one plan row (a lone plan's commit) stamps it with its number (``gen``) and leaves
``store_meta`` alone, so it dirties one page, its row's, not two; any other group (many rows, whose
pages one more hardly adds to, or none) writes ``store_meta``. So after the commit of group ``g``
one of them holds ``g`` and none more (a later group that deletes the stamped row records a higher
number itself; dropping a damaged plan, which is no group, writes ``store_meta``), and a commit
lost with the ``-wal`` takes its stamp with it.
"""

from __future__ import annotations

import sqlite3
import zlib
from typing import Final

__all__ = ["GENERATION", "MIGRATIONS", "SCHEMA_VERSION", "crc", "create_schema", "migrate"]

SCHEMA_VERSION: Final = 6

GENERATION: Final = "SELECT max(generation, (SELECT coalesce(max(gen), 0) FROM plans)) FROM store_meta"
"""The groups a version 6 file has committed (one scan of ``plans``: at the open only)."""

crc = zlib.crc32
"""``crc(data, start=0)``: the checksum the store keeps of each blob (CRC-32, unsigned)."""

# A table's definition as of the version that introduced it: the current schema and the
# migrations that reach it share these (a later version adds its own, never edits these).
_PLANS_V3 = """(
    id TEXT NOT NULL,
    owner TEXT NOT NULL,
    ord INTEGER NOT NULL,
    state TEXT NOT NULL,
    spec BLOB NOT NULL,
    status BLOB,
    events BLOB,
    nevents INTEGER NOT NULL DEFAULT 0
)"""
_EVENTS_V2 = """(
    plan INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    body BLOB NOT NULL,
    PRIMARY KEY (plan, seq)
) WITHOUT ROWID"""

_CREATE_V3 = f"""
CREATE TABLE plans {_PLANS_V3};
CREATE TABLE events {_EVENTS_V2};
"""

# Version 1 keyed events by the plan's id: ids are random, so every group of events landed on
# B-tree pages all over the table (twice the writer's CPU). Version 2 keys them by the plan's
# rowid, which grows with submit order: new events append near the end of the table.
_MIGRATE_V1 = f"""
CREATE TABLE events_v2 {_EVENTS_V2};
INSERT INTO events_v2 (plan, seq, body) SELECT plans.rowid, events.seq, events.body
    FROM events JOIN plans ON plans.id = events.plan_id;
DROP TABLE events;
ALTER TABLE events_v2 RENAME TO events;
"""

# Version 2 wrote one events row per event (~5 per plan, plus the plan's row twice or more).
# Version 3 writes one row per plan per group: a plan's first events are appended to its own
# row, in the same statement as its status; an events row holds a run of events (a msgpack
# array), so a version 2 row becomes a run of one (0x91: array of one element).
#
# Version 3 also drops the unique index on plans.id: ids are random, so each group of new plans
# dirtied index pages all over the file (the whole index, in a busy run), and every dirty page
# is written to the WAL at the commit. The store keeps every id's rowid in memory and is the
# file's only writer (the lock file): it makes sure an id is created once. New plans now append
# at the end of the table, and the plans in flight, which a group updates, sit next to each other.
_MIGRATE_V2 = f"""
CREATE TABLE plans_v3 {_PLANS_V3};
INSERT INTO plans_v3 (rowid, id, owner, ord, state, spec, status)
    SELECT rowid, id, owner, ord, state, spec, status FROM plans;
DROP TABLE plans;
ALTER TABLE plans_v3 RENAME TO plans;
UPDATE events SET body = CAST(x'91' || body AS BLOB);
"""

# Version 4 adds a checksum to every stored blob (SQLite's own checks pass most payload byte
# flips) and the count of committed groups that the generation side file is compared with.
# Added columns go at the end of each row: existing rows are rewritten once, here.
_MIGRATE_V3 = """
ALTER TABLE plans ADD COLUMN spec_crc INTEGER;
ALTER TABLE plans ADD COLUMN status_crc INTEGER;
ALTER TABLE plans ADD COLUMN events_crc INTEGER;
UPDATE plans SET spec_crc = fleetwire_crc(spec, 0), status_crc = fleetwire_crc(status, 0),
    events_crc = fleetwire_crc(events, 0);
ALTER TABLE events ADD COLUMN crc INTEGER;
UPDATE events SET crc = fleetwire_crc(body, plan);
CREATE TABLE store_meta (generation INTEGER NOT NULL);
INSERT INTO store_meta (generation) VALUES (0);
"""
# Version 5 adds the usage ledger (coordinator/ledger.py): one row per (hour, principal, team), its totals a
# msgpack array in ledger.FIELDS order with its checksum; hour 0 holds what was folded from old hours.
_MIGRATE_V4 = """
CREATE TABLE usage (
    hour INTEGER NOT NULL,
    principal TEXT NOT NULL,
    team TEXT NOT NULL,
    totals BLOB NOT NULL,
    crc INTEGER NOT NULL,
    PRIMARY KEY (hour, principal, team)
) WITHOUT ROWID;
"""
# Version 6 stamps the one plan row of a one-row group with the group's generation (see the module's docstring):
# the commit of a lone plan writes one WAL frame, not a second for store_meta's page. Older rows read 0.
_MIGRATE_V5 = """
ALTER TABLE plans ADD COLUMN gen INTEGER NOT NULL DEFAULT 0;
"""
# From version N to N + 1.
MIGRATIONS: Final = {1: _MIGRATE_V1, 2: _MIGRATE_V2, 3: _MIGRATE_V3, 4: _MIGRATE_V4, 5: _MIGRATE_V5}


def _sql_crc(data: bytes | None, start: int) -> int | None:
    return None if data is None else crc(data, start & 0xFFFFFFFF)


def _steps(version: int) -> str:
    return " ".join(MIGRATIONS[v] for v in range(version, SCHEMA_VERSION))


def migrate(db: sqlite3.Connection, version: int) -> None:
    """Bring a version ``version`` file to :data:`SCHEMA_VERSION` in one transaction (with the version)."""
    db.create_function("fleetwire_crc", 2, _sql_crc, deterministic=True)
    # executescript commits first; the migration is one transaction with the version.
    db.executescript(f"BEGIN IMMEDIATE; {_steps(version)} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")


def create_schema(db: sqlite3.Connection) -> None:
    """Create the current tables in an empty file: version 3's, then every later step."""
    db.create_function("fleetwire_crc", 2, _sql_crc, deterministic=True)
    db.executescript(f"BEGIN IMMEDIATE; {_CREATE_V3} {_steps(3)} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
