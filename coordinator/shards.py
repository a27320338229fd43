"""Cluster mode's shard leases, as a pure state machine: which shards this coordinator holds, when
to acquire or renew, and when it must stop (docs/CLUSTER.md).

A cluster has a fixed number of shard slots (``ClusterConfig.shards``, fixed when the cluster's
database is created). Each slot is a lease row in PostgreSQL: owner, epoch, expiry. Only the
database clock judges expiry (``now()`` in SQL, coordinator/io/cluster/leases.py); this module never
compares clocks of two hosts. It only keeps its *own* monotonic clock to stop early: the lease
it renewed at local time ``t`` expires in the database no sooner than ``t + ttl`` (the database
sets the expiry after it receives the statement), so a coordinator that could not renew by
``t + ttl - margin`` stops serving before anybody else can take the shard over.

The epoch is the fencing token: it grows by one on every change of owner, and every group
commit checks (in its own transaction) that the epochs it was given are still the ones in the
table. A coordinator whose lease was taken (it was paused, partitioned, slow) can therefore
never commit, and since frames leave only after their commit it never sends a stale decision.

Phase 1 policy (one core per process): a coordinator serves only when it holds *every* slot;
one that holds some but not shard 0 gives them back, so two coordinators that start together
cannot split the slots and both wait forever (the holder of shard 0 wins). The attempt is one
statement over all slots: acquire the expired ones, renew its own (coordinator/io/cluster/leases.py).

The driver calls :meth:`ShardLeases.attempt` when :meth:`ShardLeases.due` says, runs the
statement, and feeds the rows back to :meth:`ShardLeases.result` (or :meth:`ShardLeases.failed`
when the database could not be reached); each returns an :class:`Outcome` to act on.
"""

from __future__ import annotations

import enum
import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.records import PlanCreated
from protocol.messages import Submit

__all__ = [
    "DEFAULT_SHARD", "ClusterConfig", "LeaseRow", "LeaseState", "Outcome", "PartialLeases", "Partitions", "Round",
    "ShardLeases", "SubmitShards", "fair_share", "parse_partitions", "partition_of", "partition_shard", "plan_round",
    "pool_of", "pool_shard", "shard_of", "submit_shard", "worker_shard",
]

DEFAULT_SHARD = 0
"""The shard of the default placement unit. Phase 1 writes every plan there (one core serves
every pool); phase 2 maps pools to shards and keeps the default pool on shard 0, so the rows
written now stay where they belong."""


POOL_TAG = "pool:"


def pool_of(tags: Sequence[str]) -> str:
    """The worker pool named by a worker's tags or a plan's required tags (docs/CLUSTER.md §Pools).

    The value of a ``pool:NAME`` tag when there is one, else the first tag, else the default
    pool ``""``. A worker started with ``--pool NAME`` carries the tag ``pool:NAME``.
    """
    for tag in tags:
        if tag.startswith(POOL_TAG):
            return tag[len(POOL_TAG):]
    return tags[0] if tags else ""


def pool_shard(pool: str, shards: int) -> int:
    """The shard slot of a pool: the default pool is :data:`DEFAULT_SHARD`, others CRC-32 of the name mod ``shards``."""
    if not pool or shards <= 1:
        return DEFAULT_SHARD
    return zlib.crc32(pool.encode()) % shards


def shard_of(created: PlanCreated, shards: int, partitions: Partitions = ()) -> int:
    """The shard slot that holds a plan: :func:`submit_shard` of the submit it was created from."""
    return submit_shard(created.submit, shards, partitions)


Partitions = tuple[tuple[str, int], ...]
"""Pools split into partitions: ``((pool, K), ...)`` (``--pool-partitions gpu=4``)."""


def parse_partitions(text: str) -> Partitions:
    """``"gpu=4,llm=2"`` as :data:`Partitions` (sorted by pool; "" gives none).

    Raises:
        ValueError: naming the item that is not ``POOL=K`` with a K of at least 1, or a pool given twice.
    """
    found: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        pool, sep, count = item.partition("=")
        pool = pool.strip()
        try:
            k = int(count) if sep else 0
        except ValueError:
            k = 0
        if not pool or k < 1:
            raise ValueError(f"--pool-partitions: {item!r} is not POOL=K with a pool name and a count K >= 1")
        if pool in found:
            raise ValueError(f"--pool-partitions: pool {pool!r} is given twice")
        found[pool] = k
    return tuple(sorted(found.items()))


def partition_of(key: str, partitions: int) -> int:
    """The partition of a worker id or a session key among ``partitions``: CRC-32 of it mod the count."""
    if partitions <= 1:
        return 0
    return zlib.crc32(key.encode()) % partitions


def partition_shard(pool: str, partition: int, shards: int) -> int:
    """The shard of partition ``partition`` of ``pool``: the pool's own shard, then the next ones, in turn."""
    return (pool_shard(pool, shards) + partition) % max(1, shards)


def worker_shard(tags: Sequence[str], worker_id: str, shards: int, partitions: Partitions = ()) -> int:
    """The shard a worker belongs to: its pool's, or in a partitioned pool its partition's (hash of its id)."""
    pool = pool_of(tags)
    k = dict(partitions).get(pool, 1) if pool else 1
    if k <= 1:
        return pool_shard(pool, shards)
    return partition_shard(pool, partition_of(worker_id, k), shards)


def submit_shard(submit: Submit, shards: int, partitions: Partitions = ()) -> int:
    """The shard a submit belongs to: its pool's, or in a partitioned pool the partition of its key.

    The key is the sticky session key (``hints.session_key``), so a session stays in one core;
    a plan without one goes by its ``plan_id`` (the SDK always gives one), and one with neither
    to partition 0. Only what the submit itself says counts, so the shard that answers the
    submit and the shard its rows are written to agree.
    """
    pool = pool_of(submit.requirements.tags)
    k = dict(partitions).get(pool, 1) if pool else 1
    if k <= 1:
        return pool_shard(pool, shards)
    key = submit.hints.session_key or submit.plan_id or ""
    return partition_shard(pool, partition_of(key, k) if key else 0, shards)


SUBMIT_SHARDS_MAX = 4096  # tags a SubmitShards remembers (then it starts again: clients choose tags)


class SubmitShards:
    """:func:`submit_shard` for a cluster's shard count and partitions, by a submit's one required tag where no pool
    is partitioned (the shard then depends on that tag alone): per submit a dict look-up, not a scan of the tags
    and a CRC-32 (a shard core's redirect and the PostgreSQL store's rows, each once a plan).
    """

    __slots__ = ("_by_tag", "partitions", "shards")

    def __init__(self, shards: int, partitions: Partitions = ()) -> None:
        self.shards = shards
        self.partitions = partitions
        self._by_tag: dict[str, int] = {}

    def __call__(self, submit: Submit) -> int:
        tags = submit.requirements.tags
        if self.partitions or len(tags) > 1:
            return submit_shard(submit, self.shards, self.partitions)
        if not tags:
            return DEFAULT_SHARD  # the default pool's
        known = self._by_tag
        shard = known.get(tags[0])
        if shard is None:
            if len(known) >= SUBMIT_SHARDS_MAX:
                known.clear()
            shard = known[tags[0]] = submit_shard(submit, self.shards, self.partitions)
        return shard

    def __len__(self) -> int:
        """The tags remembered."""
        return len(self._by_tag)


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster mode's settings (used only with a ``postgresql://`` store).

    Attributes:
        name: the cluster's name, kept in the database: a coordinator of another name is refused,
            so two clusters cannot share one database by mistake.
        shards: shard slots, fixed when the database is first used (a different count is refused).
        lease_ttl_s: how long a lease lasts after its last renewal (database clock). A dead
            owner's shards are taken over after at most this plus one standby scan.
        lease_renew_s: how often the owner renews (a standby scans twice as often).
        partitions: pools split into K partitions, each on its own shard (``--pool-partitions``;
            every coordinator of the cluster must be given the same).
    """

    name: str = "fleetwire"
    shards: int = 16
    lease_ttl_s: float = 3.0
    lease_renew_s: float = 1.0
    partitions: Partitions = ()

    def check(self) -> None:
        """Raise ``ValueError`` naming the setting that cannot work."""
        if not self.name or len(self.name) > 200 or not self.name.isprintable():
            raise ValueError(f"--cluster-name must be 1 to 200 printable characters, got {self.name!r}")
        if not 1 <= self.shards <= 4096:
            raise ValueError(f"--shards must be between 1 and 4096, got {self.shards}")
        if not self.lease_renew_s > 0 or not self.lease_ttl_s > 0:
            raise ValueError("--lease-ttl and --lease-renew must be positive seconds")
        for pool, k in self.partitions:
            if k > self.shards:
                raise ValueError(
                    f"--pool-partitions {pool}={k}: a pool cannot have more partitions than the {self.shards} shard "
                    "slots (--shards)"
                )
        if self.lease_ttl_s < 2 * self.lease_renew_s:
            raise ValueError(
                f"--lease-ttl ({self.lease_ttl_s} s) must be at least twice --lease-renew ({self.lease_renew_s} s), "
                "or one late renewal loses the lease"
            )

    @property
    def scan_s(self) -> float:
        """How often a coordinator that does not hold every slot tries to take them."""
        return self.lease_renew_s / 2

    @property
    def margin_s(self) -> float:
        """How long before its lease's earliest possible expiry an owner that could not renew stops."""
        return min(0.5, self.lease_ttl_s / 10)


class LeaseState(enum.Enum):
    STANDBY = "standby"  # holds not every slot: does not serve
    OWNER = "owner"  # holds every slot: serves
    FENCED = "fenced"  # lost a slot it served, or could not renew in time: must stop (fail-stop)
    RELEASED = "released"  # gave its slots back (shutdown)


class Outcome(enum.Enum):
    NONE = "none"  # nothing to do
    ACQUIRED = "acquired"  # became the owner of every slot: load the plans and serve
    GIVE_BACK = "give_back"  # holds a few slots but not shard 0: release them (the driver calls released())
    FENCED = "fenced"  # stop serving now (fail-stop)


class ShardLeases:
    """The lease state of one coordinator process (``owner``: unique per process run).

    Attributes:
        held: shard -> epoch of every slot held (the fence each group commit checks).
        state: see :class:`LeaseState`.
        valid_until: local monotonic time after which an owner that could not renew stops.
        why: what made the state FENCED (for the log line).
        acquisitions / renewals: attempts that took a slot / kept every held slot.
    """

    def __init__(self, config: ClusterConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.held: dict[int, int] = {}
        self.state = LeaseState.STANDBY
        self.valid_until = 0.0
        self.why = ""
        self.acquisitions = 0
        self.renewals = 0
        self._next = 0.0  # when the next attempt is due
        self._sent_at: float | None = None

    @property
    def wanted(self) -> list[int]:
        """The slots the next attempt asks for (phase 1: every one)."""
        return list(range(self.config.shards))

    def due(self, now: float) -> float:
        """Seconds until the next attempt (0: now)."""
        return max(0.0, self._next - now)

    def attempt(self, now: float) -> list[int]:
        """An attempt is being sent at ``now``: the slots to acquire or renew."""
        self._sent_at = now
        return self.wanted

    def result(self, rows: list[tuple[int, int]], now: float) -> Outcome:
        """The attempt's answer: ``(shard, epoch)`` of every slot this owner now holds."""
        if self.state in (LeaseState.FENCED, LeaseState.RELEASED):
            return Outcome.NONE
        sent_at = now if self._sent_at is None else self._sent_at
        self._sent_at = None
        got = dict(rows)
        config = self.config
        if self.state is LeaseState.OWNER:
            lost = sorted(s for s, epoch in self.held.items() if got.get(s) != epoch)
            if lost:
                return self._fence(f"lost the lease of shard(s) {_few(lost)} to another coordinator", lost)
            if sent_at + config.lease_ttl_s - config.margin_s <= now:
                # The answer came too late to prove anything about the time it was sent at.
                return self._fence(f"a lease renewal took {now - sent_at:.2f} s, longer than the lease", [])
        taken = any(self.held.get(s) != epoch for s, epoch in got.items())
        self.held = got
        self.valid_until = sent_at + config.lease_ttl_s - config.margin_s
        if self.state is LeaseState.OWNER:
            self.renewals += 1
            self._next = sent_at + config.lease_renew_s
            return Outcome.NONE
        if taken:
            self.acquisitions += 1
        if len(got) == config.shards:
            self.state = LeaseState.OWNER
            self._next = sent_at + config.lease_renew_s
            return Outcome.ACQUIRED
        self._next = sent_at + config.scan_s
        if got and DEFAULT_SHARD not in got:
            return Outcome.GIVE_BACK  # another coordinator holds shard 0: it gets the rest
        return Outcome.NONE

    def failed(self, now: float) -> Outcome:
        """The attempt got no answer (the database could not be reached or refused it)."""
        self._sent_at = None
        if self.state is LeaseState.OWNER and now >= self.valid_until:
            return self._fence("could not renew the shard leases before they could expire", sorted(self.held))
        self._next = now + self.config.scan_s
        return Outcome.NONE

    def check(self, now: float) -> Outcome:
        """Self-demotion: an owner whose lease may have expired (no renewal in time) stops."""
        if self.state is LeaseState.OWNER and now >= self.valid_until:
            return self._fence("no lease renewal succeeded before the lease could expire", sorted(self.held))
        return Outcome.NONE

    def released(self) -> None:
        """Every held slot was given back (shutdown: RELEASED; a GIVE_BACK: standby again)."""
        self.held = {}
        if self.state is LeaseState.OWNER:
            self.state = LeaseState.RELEASED

    def _fence(self, why: str, shards: list[int]) -> Outcome:
        self.state = LeaseState.FENCED
        self.why = why
        for shard in shards:
            self.held.pop(shard, None)
        return Outcome.FENCED


def _few(shards: list[int]) -> str:
    return ", ".join(map(str, shards[:8])) + (f" and {len(shards) - 8} more" if len(shards) > 8 else "")


# --------------------------------------------------------------------------- partial ownership (phase 2)


def fair_share(shards: int, coordinators: int) -> int:
    """How many shards one coordinator should own: ``ceil(shards / live coordinators)``."""
    return math.ceil(shards / max(1, coordinators))


@dataclass(frozen=True)
class LeaseRow:
    """One ``shard_leases`` row as the last scan saw it (``live``: unexpired by the database clock)."""

    shard: int
    owner: str
    epoch: int
    live: bool
    url: str = ""


@dataclass(frozen=True)
class Round:
    """What one rebalance round decided: slots to try to acquire and held slots to give back."""

    acquire: list[int] = field(default_factory=list)
    release: list[int] = field(default_factory=list)


def plan_round(
    me: str, held: Iterable[int], rows: Sequence[LeaseRow], peers: Iterable[str], *, max_moves: int = 2
) -> Round:
    """Decide a round of partial ownership (pure; the driver runs the statements).

    * ``share`` = :func:`fair_share` over the live coordinators (``peers``, this one included);
    * orphaned slots (expired leases: their owner died, stalled or gave them back) are taken up
      to the share;
    * a coordinator over its share gives back at most ``max_moves`` slots per round, and only
      while another live coordinator is under its share (someone will take them).
    """
    held_set = set(held)
    live = set(peers) | {me}
    shards = len(rows)
    share = fair_share(shards, len(live))
    orphaned = sorted(r.shard for r in rows if not r.live and r.shard not in held_set)
    acquire = orphaned[: max(0, share - len(held_set))]
    release: list[int] = []
    if len(held_set) > share:
        counts = dict.fromkeys(live - {me}, 0)
        for row in rows:
            if row.live and row.owner in counts:
                counts[row.owner] += 1
        deficit = sum(max(0, share - n) for n in counts.values()) - len(orphaned)
        n = min(len(held_set) - share, max_moves, max(0, deficit))
        release = sorted(held_set, reverse=True)[:n]
    return Round(acquire, release)


class PartialLeases:
    """The leases of one coordinator that owns *some* slots; each slot is won and lost on its own.

    The statement of a round renews every held slot and tries the ones :func:`plan_round` chose
    (coordinator/io/cluster/host.py). :meth:`result` says which slots were won and which were
    lost (their epoch changed, or the answer came too late to prove the lease); :meth:`check`
    loses every held slot when no renewal succeeded in time. A lost slot is fail-stop for that
    slot only: the driver stops its core, the others keep serving.

    Attributes:
        held: shard -> epoch of every slot held (each shard's group commits are fenced with it).
        valid_until: local monotonic time after which the held slots may have expired.
    """

    def __init__(self, config: ClusterConfig, owner: str) -> None:
        self.config = config
        self.owner = owner
        self.held: dict[int, int] = {}
        self.valid_until = 0.0
        self.acquisitions = 0

    def result(self, rows: Iterable[tuple[int, int]], sent_at: float, now: float) -> tuple[list[int], list[int]]:
        """The round's answer ``(shard, epoch)`` of every slot held now: ``(won, lost)``."""
        config = self.config
        got = dict(rows)
        if sent_at + config.lease_ttl_s - config.margin_s <= now:
            lost = sorted(self.held)  # too late to prove anything about the time it was sent at
            self.held = {}
            return [], lost
        lost = sorted(s for s, epoch in self.held.items() if got.get(s) != epoch)
        won = sorted(s for s in got if s not in self.held)
        self.held = {s: e for s, e in got.items() if s not in lost}
        self.acquisitions += len(won)
        self.valid_until = sent_at + config.lease_ttl_s - config.margin_s
        return won, lost

    def check(self, now: float) -> list[int]:
        """Self-demotion: every held slot is lost when no renewal succeeded before it could expire."""
        if self.held and now >= self.valid_until:
            lost = sorted(self.held)
            self.held = {}
            return lost
        return []

    def released(self, shards: Iterable[int]) -> None:
        """These slots were given back."""
        for shard in shards:
            self.held.pop(shard, None)
