"""What a store can do beyond load, write and close: its optional abilities, declared, never probed.

Every store has the three methods of :class:`~coordinator.io.stores.store.Store`. The rest
differs by backend, and each backend says what it has in one :class:`StoreAbilities`
(``store.abilities``); the server and the committer read that, not the store's attributes:

=================  ================================================  ========  ==========
ability            what it is for (who uses it)                      SQLite    PostgreSQL
=================  ================================================  ========  ==========
``stream``         a restart's load, one plan at a time (server)     yes       -
``check_files``    the ``-wal``/``-shm`` check after a commit         yes       -
                   (GroupCommitter, commit.py)
``try_write``      a commit on the loop that never waits for a       yes       -
                   lock (GroupCommitter's inline commits)
``losses``         what ``--accept-store-loss`` let go (server:      yes       yes
                   ``fleetwire_store_loss_accepted_total``)
``away``           why the database cannot take a write now          -         yes
                   (server: ``unavailable`` / 503 meanwhile)
``make_committer`` the store's own committer (pg_commit.py)          -         yes
``leases``         shard leases the server keeps (LeaseKeeper)       -         yes [1]_
``usage``          the usage ledger's rows, at start (server;        yes       - [2]_
                   coordinator/ledger.py)
``writer_process`` the writer thread's groups committed by a child    yes       -
                   process from now on, a lone commit still here
                   (server, ``--store-writer process``, the default;
                   coordinator/io/stores/writer_process.py)
``sender``         groups sent without waiting, each one's commit    yes [3]_  -
                   reported back (GroupCommitter, on the loop)
=================  ================================================  ========  ==========

.. [1] Not a shard's own store in a cluster host (``ShardPgStore``): the host keeps those.
.. [2] Not yet: a PostgreSQL store ignores ``UsageRows`` records, so a cluster's ledger restarts empty.
   ``MemoryStore`` keeps them too (in its process).
.. [3] Once its writes were handed to the writer process (``writer_process``).

``MemoryStore`` has none of them. A store built for a test declares what it has (often
``StoreAbilities()``: nothing optional).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from coordinator.ledger import UsageRow
from coordinator.records import Record, StoredPlan

if TYPE_CHECKING:
    import asyncio

    from coordinator.io.cluster.leases import LeaseStore
    from coordinator.io.stores.pg_commit import PipelinedCommitter

__all__ = ["GroupSender", "MakeCommitter", "StoreAbilities"]

T = TypeVar("T")


class MakeCommitter(Protocol):
    """A store's own committer factory (``PgStore.make_committer``): the server's ``release`` and ``on_failure``."""

    def __call__(
        self, release: Callable[[T], None], on_failure: Callable[[BaseException], None], *, max_backlog_bytes: int = 0
    ) -> PipelinedCommitter[T]: ...


class GroupSender(Protocol):
    """A store that commits groups in order without the sender waiting (``SQLiteStore`` with a writer process)."""

    def send(self, records: Sequence[Record], done: Callable[[BaseException | None], None]) -> None:
        """Send a group; ``done(None)`` (from another thread) once committed, ``done(error)`` if it failed."""

    def drain(self) -> None:
        """Wait until every group sent has had its ``done``."""

    def serve_on(self, loop: asyncio.AbstractEventLoop, notify: Callable[[], None]) -> None:
        """Send on ``loop``'s thread from now on: each ``done`` runs there (then ``notify()``), never waits."""

    def poll_commits(self) -> None:
        """On the loop after :meth:`serve_on`: the commits answered so far reported now, without waiting."""

    def leave_loop(self) -> None:
        """Undo :meth:`serve_on` (on the loop's thread)."""

    def abandon(self, why: str) -> None:
        """On the loop after :meth:`serve_on`: every group still out fails now (``StoreError`` naming ``why``,
        committed or not), the writer is ended without waiting (SIGKILL) and nothing more is sent."""


@dataclass(frozen=True, slots=True)
class StoreAbilities:
    """The optional abilities of one store (None or empty: it has not that one). See the module's table.

    Attributes:
        stream: every plan held, in submit order, each handed over as soon as it is decoded
            (instead of ``load``'s whole list).
        check_files: raises ``StoreDamaged`` when the store's files were deleted or replaced
            under it.
        try_write: ``write`` that returns False at once, nothing written, while another
            connection holds the database.
        losses: one line per loss ``accept_loss`` accepted at open or load (read after ``load``).
        away: why the store cannot take a write now (its database is away), else None.
        make_committer: the committer the server must use for this store (instead of
            ``GroupCommitter``).
        leases: the store's shard-lease connection and fence, which the server keeps with a
            ``LeaseKeeper``: it serves only while it holds them (cluster mode).
        usage: the usage ledger's rows the store keeps (from ``UsageRows`` records), read at start.
        writer_process: hands the writer thread's groups to a child process (after the load, before the
            committer starts; a lone commit on the loop stays here); raises ``StoreError`` when it cannot
            be started.
        sender: the store's groups sent without waiting for their commit (read at the committer's start).
    """

    stream: Callable[[], Iterator[StoredPlan]] | None = None
    check_files: Callable[[], None] | None = None
    try_write: Callable[[Sequence[Record]], bool] | None = None
    losses: Sequence[str] = ()
    away: Callable[[], str | None] | None = None
    make_committer: MakeCommitter | None = None
    leases: LeaseStore | None = None
    usage: Callable[[], list[UsageRow]] | None = None
    writer_process: Callable[[], None] | None = None
    sender: GroupSender | None = None
