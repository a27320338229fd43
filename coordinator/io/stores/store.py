"""Where the coordinator keeps plans across restarts: the ``Store`` interface, ``open_store`` and the memory store.

A store applies batches of records (``coordinator/records.py``) and gives every plan back on
start. It is the only part of the coordinator that touches a disk; the core never calls it
(the server does, through ``coordinator/io/stores/commit.py``, off the event loop).

* ``SQLiteStore`` (the default, ``--store sqlite`` or ``sqlite:PATH``,
  coordinator/io/stores/sqlite.py): one SQLite file in WAL mode with ``synchronous=FULL``; one
  :meth:`~Store.write` is one transaction and one fsync, whatever the number of records in it
  (group commit).
* ``PgStore`` (``--store postgresql://USER@HOST:PORT/DB``, coordinator/io/stores/postgres.py): cluster
  mode; the same records, formats and group commit in PostgreSQL, fenced by shard leases.
* :class:`MemoryStore` (``--store memory``): records kept in this process only. A restart of
  the process loses everything; a new ``CoordinatorServer`` given the same ``MemoryStore``
  object gets every plan back (tests use that).

Another backend implements the three methods of :class:`Store`, sets ``blocking`` and declares
what else it can do in ``abilities`` (coordinator/io/stores/abilities.py: a restart's streamed
load, commits on the loop, a file check, the losses it accepted, a database that can be away,
its own committer, shard leases). Nobody probes a store for a method: what is not declared
there is not used.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from coordinator.io.stores.abilities import StoreAbilities
from coordinator.io.stores.integrity import StoreDamaged, StoreError
from coordinator.io.stores.rows import by_seq
from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.ledger import UsageRow
from coordinator.records import PlanCreated, PlanForgotten, PlanStatus, Record, StoredPlan, UsageRows
from coordinator.shards import ClusterConfig
from protocol.messages import Event

__all__ = [
    "DB_FILE",
    "MemoryStore",
    "Store",
    "StoreDamaged",
    "StoreError",
    "default_data_dir",
    "open_store",
]

DB_FILE = "coordinator.sqlite3"
POSTGRES_PREFIX = "postgresql://"  # --store postgresql://USER@HOST:PORT/DB: cluster mode (postgres.py)


class Store(Protocol):
    """What the coordinator needs from a store.

    Attributes:
        description: for logs and the startup line, e.g. ``sqlite:/var/lib/fleetwire/coordinator.sqlite3``.
        blocking: ``write`` does disk I/O: the server calls it from a writer thread.
        closed: ``close`` was called (``/readyz`` reports it).
    """

    description: str
    blocking: bool
    closed: bool

    def load(self) -> list[StoredPlan]:
        """Every plan held, in submit order."""
        ...

    def write(self, records: Sequence[Record]) -> None:
        """Apply ``records`` atomically; on return they are durable.

        Raises:
            StoreError: nothing of the batch was applied.
        """
        ...

    def close(self) -> None:
        """Release the store; a second call does nothing."""
        ...

    @property
    def abilities(self) -> StoreAbilities:
        """What this store can do beyond these three methods (coordinator/io/stores/abilities.py)."""
        ...


def default_data_dir() -> Path:
    """``$FLEETWIRE_DATA_DIR``, else ``$XDG_STATE_HOME/fleetwire``, else ``~/.local/state/fleetwire``."""
    explicit = os.environ.get("FLEETWIRE_DATA_DIR")
    if explicit:
        return Path(explicit)
    state_home = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "fleetwire"


def store_path(spec: str, data_dir: str | Path | None = None) -> Path | None:
    """The database file of a ``--store`` value (None for ``memory``).

    Raises:
        StoreError: an unknown spec.
    """
    if spec == "memory":
        return None
    if spec == "sqlite":
        return (Path(data_dir) if data_dir is not None else default_data_dir()) / DB_FILE
    if spec.startswith("sqlite:") and len(spec) > len("sqlite:"):
        return Path(spec[len("sqlite:"):])
    if spec.startswith(POSTGRES_PREFIX):
        raise StoreError(f"{spec.split('@')[-1]!r} is a PostgreSQL store: it keeps no file here")
    raise StoreError(
        f"unknown store {spec!r}: use 'sqlite' (the default), 'sqlite:PATH', 'memory' or "
        "'postgresql://USER@HOST:PORT/DB' (cluster mode)"
    )


def open_store(
    spec: str, data_dir: str | Path | None = None, *, accept_loss: bool = False, cluster: ClusterConfig | None = None
) -> Store:
    """The store a ``--store`` value names.

    Args:
        spec: ``memory``, ``sqlite`` (the file ``coordinator.sqlite3`` in ``data_dir``),
            ``sqlite:PATH``, or ``postgresql://USER@HOST:PORT/DB`` (cluster mode,
            coordinator/io/stores/postgres.py).
        data_dir: where ``sqlite`` keeps its file; default :func:`default_data_dir`.
        accept_loss: a damaged store starts from what is readable (``--accept-store-loss``).
        cluster: cluster mode's settings (a ``postgresql://`` store only).

    Raises:
        StoreError: an unknown spec, or the database cannot be opened.
        StoreDamaged: the database is damaged (and ``accept_loss`` is off).
    """
    if spec.startswith(POSTGRES_PREFIX):
        from coordinator.io.stores.postgres import PgStore

        return PgStore(spec, cluster, accept_loss=accept_loss)
    path = store_path(spec, data_dir)
    if path is None:
        return MemoryStore()
    return SQLiteStore(path, accept_loss=accept_loss)


# --------------------------------------------------------------------------- memory


class MemoryStore:
    """Records kept in this process: survives a server restart in-process, not a process restart."""

    description = "memory"
    blocking = False
    abilities = StoreAbilities()  # the usage ledger's rows only (set per store: __init__)

    def __init__(self) -> None:
        self._plans: dict[str, StoredPlan] = {}
        self._usage: dict[tuple[int, str, str], list[float]] = {}  # the usage ledger's rows (UsageRows)
        self.writes = 0  # batches applied
        self.closed = False
        self.abilities = StoreAbilities(usage=self.load_usage)

    def load_usage(self) -> list[UsageRow]:
        """The usage ledger's rows written so far (its ``usage`` ability)."""
        return [UsageRow.of(hour, principal, team, values) for (hour, principal, team), values in self._usage.items()]

    def load(self) -> list[StoredPlan]:
        self.closed = False  # a server starting on this store opens it again
        plans = sorted(self._plans.values(), key=lambda p: p.created.order)
        return [StoredPlan(p.created, p.status, by_seq(p.events)) for p in plans]

    def write(self, records: Sequence[Record]) -> None:
        self.writes += 1
        plans = self._plans
        # The usual records by exact type first: an isinstance miss on a msgspec Struct class goes
        # through its metaclass, and each of a plan's statuses missed three times.
        for record in records:
            if type(record) is Event:
                stored = plans.get(record.plan_id)
                if stored is not None:  # a seq written twice is resolved by load(): O(1) per event
                    stored.events.append(record)
            elif type(record) is PlanStatus:
                stored = plans.get(record.plan_id)
                if stored is not None:
                    stored.status = record
            elif isinstance(record, PlanCreated):
                plans.setdefault(record.plan_id, StoredPlan(record, None, []))
            elif isinstance(record, PlanForgotten):
                plans.pop(record.plan_id, None)
            elif isinstance(record, UsageRows):
                for key in record.deleted:
                    self._usage.pop((key[0], key[1], key[2]), None)
                self._usage.update(((hour, principal, team), values) for hour, principal, team, values in record.rows)
            elif isinstance(record, Event):
                stored = plans.get(record.plan_id)
                if stored is not None:
                    stored.events.append(record)
            else:
                stored = plans.get(record.plan_id)
                if stored is not None:
                    stored.status = record

    def close(self) -> None:
        # Closing keeps the records: a new server given this store restarts from them.
        self.closed = True
