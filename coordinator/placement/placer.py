"""Where a plan goes: filtering, pools, sticky sessions, KV-block admission, policies, stealing.

Rules (docs/SEMANTICS.md §Placement, docs/ROUTING.md):

1. *Filter.* A worker can take a plan when it is alive, not draining, meets the plan's
   signature (op, tags, accelerator, model, GPU memory, python env, not avoided), has room
   (``leases < max_concurrency + prefetch``) and the plan's KV blocks fit its budget.
   Workers that meet a signature form its *pool*; the registry caches pools per signature,
   so a submit never scans every worker's capabilities.
2. *Tiers.* Workers with a free slot (``leases < max_concurrency``) come first; only when
   none has one does a plan go to a worker's local queue (prefetch).
3. *Sticky sessions.* A plan whose hints carry a ``session_key`` goes to the worker that
   took the session's previous plan while that worker has room; otherwise the policy
   chooses and the session moves there. Keys are scoped by the plan's owner.
4. *Policy.* The plan's ``hints.policy``, else the coordinator's default, ranks the tier
   (coordinator/placement/policies.py). While no worker of the pool reports a load figure a policy
   reads, every policy but round robin and prefix-matching ``kv_aware`` picks what least
   busy picks, and the pool's room index answers in O(log W) (coordinator/capacity.py);
   while every worker of the pool reports the figure it ranks by first, ``joule_weighted``
   (µJ/token) and ``carbon_weighted`` (µJ/token and zone intensity; both without a busyness
   gap) and ``latency_weighted`` (latency) take their best workers from the pool's index by
   that figure (breaking a tie among at most ``candidates`` of them); otherwise the policy
   ranks the tier. Every way gives the
   same worker as a pass over the pool, except that in a pool of more than
   ``candidates`` workers (``--placement-candidates``, 0: no bound) the policy ranks only
   the ``candidates`` usable workers of the best tier that the room index puts first
   (fewest leases, least recently assigned), plus, for ``kv_aware`` with prefix hashes, the
   usable workers holding a longer prefix match than any of those, and for those three
   policies while only some workers report their figure, the ``candidates`` best by it
   (docs/ROUTING.md §Large pools).
5. *KV-block admission.* A plan reserves ``ceil((prompt + max output tokens) / block
   tokens)`` blocks on a worker that advertises a budget, for as long as it holds the lease;
   the reservation is computed from the worker's leases, so releasing a lease frees it.
   *Devices.* A plan with ``resources.gpus`` fits a worker only while that many of its matching
   devices are free (coordinator/devices.py; the registry takes them with the lease and gives
   them back with it). Such a plan skips the room index's shortcut and the full-pool memo: each
   candidate is vetted as a KV plan is (an exact, slower path); plans without devices pay one
   attribute test.
6. *Stealing.* When a worker has a free slot and nothing queued it can run, the coordinator
   revokes an unstarted lease from the most backlogged worker that the idle one could run.
   Nothing changes until that worker answers: ``reject(code="revoked")`` requeues the plan;
   an ``accept`` (it had started) keeps it where it is (Dask's transactional stealing).

Ownership and invariants: :class:`Placement` owns its prefix index, its recent shares, its sticky sessions, the
revokes it asked for and its memo of pools found full; it reads the registry's records and
pools but never writes them. What a decision changes in a record goes through the registry
(the scheduler claims the lease and hands it the tokens :meth:`Placement.claimed` returns,
:meth:`~coordinator.registry.WorkerRegistry.count_placed_tokens`). :meth:`Placement.choose`
takes a :class:`~coordinator.capacity.Pool`: indexed (the registry's), answered
from its indexes where they are exact, or unindexed, answered by one pass; both give the
same worker (tests/unit/test_capacity.py).

Nothing here reads a clock: ``now`` comes in.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from coordinator.capacity import Pool
from coordinator.devices import pick
from coordinator.placement.plan_queue import Signature
from coordinator.placement.policies import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    Ask,
    CarbonWeighted,
    JouleWeighted,
    LatencyWeighted,
    Policy,
    PolicyKnobs,
    busyness,
    make_policies,
    projected_carbon,
)
from coordinator.placement.prefix import PrefixIndex
from coordinator.placement.shares import RecentShares
from coordinator.plans import Plan
from coordinator.registry import WorkerRegistry
from coordinator.workers import WorkerRecord
from protocol.caps import MAX_SESSION_KEY_BYTES, too_long
from protocol.messages import RoutingHints

__all__ = ["DEFAULT_BLOCK_TOKENS", "DEFAULT_CANDIDATES", "Placement", "PlacementConfig", "hints_problem"]

DEFAULT_BLOCK_TOKENS: Final = 16  # vLLM's default KV block size, for hashes of unknown block length
# Policies that rank plain workers (coordinator/capacity.py) exactly as least busy does.
LEAST_BUSY_WHEN_PLAIN: Final = frozenset({"least_busy", "joule_weighted", "carbon_weighted", "latency_weighted"})
DEFAULT_CANDIDATES: Final = 16  # workers a policy ranks in a large pool (docs/ROUTING.md §Large pools)
MAX_PREFIX_HASHES: Final = 16_384  # 8M tokens of 512-token blocks; more would only bloat the index


@dataclass(frozen=True)
class PlacementConfig:
    """Placement settings; the server fills them from ``--policy``, ``--prefetch`` and friends.

    Attributes:
        policy: the default policy (a plan's ``hints.policy`` overrides it).
        prefetch: leases a worker may hold unstarted beyond its concurrency.
        knobs: the policies' tunable numbers.
        max_sessions: sticky session keys remembered (least recently used forgotten first).
        default_cache_tokens: prefix-cache size assumed for a worker without a KV budget.
        candidates: in a pool of more workers than this, the policy ranks only this many
            (the least loaded by the room index; module doc, rule 4); 0 ranks them all.
        cluster: this core serves one shard of a cluster: it sees only the workers of that
            shard's pools, and waiting reasons say so (plan_queue.py ``explain_wait``).
    """

    policy: str = DEFAULT_POLICY
    prefetch: int = 0
    knobs: PolicyKnobs = field(default_factory=PolicyKnobs)
    max_sessions: int = 100_000
    default_cache_tokens: int = 1 << 21
    candidates: int = DEFAULT_CANDIDATES
    cluster: bool = False

    def check(self) -> None:
        """Raise ``ValueError`` with an actionable message when a setting cannot work."""
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"unknown placement policy {self.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
        if self.prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {self.prefetch}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        self.knobs.check()
        if self.candidates < 0:
            raise ValueError(f"placement candidates must be >= 0 (0: rank every worker), got {self.candidates}")


def hints_problem(hints: RoutingHints) -> str | None:
    """Why a submit's routing hints are invalid, in words a person can act on; None when valid."""
    if hints.policy is not None and hints.policy not in POLICY_NAMES:
        return f"hints.policy {hints.policy!r} is not a placement policy; use one of {', '.join(POLICY_NAMES)}"
    if hints.prompt_tokens < 0 or hints.max_output_tokens < 0 or hints.prefix_block_tokens < 0:  # the rare case
        for name in ("prompt_tokens", "max_output_tokens", "prefix_block_tokens"):
            value = getattr(hints, name)
            if value < 0:
                return f"hints.{name} must be >= 0 (got {value})"
    if hints.session_key is not None:
        if not hints.session_key:
            return "hints.session_key must be non-empty when given"
        key_problem = too_long("hints.session_key", hints.session_key, MAX_SESSION_KEY_BYTES)
        if key_problem is not None:
            return key_problem
    if len(hints.prefix_hashes) > MAX_PREFIX_HASHES:
        return f"hints.prefix_hashes has {len(hints.prefix_hashes)} hashes; at most {MAX_PREFIX_HASHES} are allowed"
    return None


def ask_of(plan: Plan) -> Ask:
    """What the policies see of a plan."""
    hints = plan.hints
    return Ask(
        tokens=hints.prompt_tokens + hints.max_output_tokens,
        prompt_tokens=hints.prompt_tokens,
        prefix_hashes=tuple(hints.prefix_hashes),
        data=bool(plan.inputs or plan.outputs),
    )


def _missing(pool: Pool, figure: str) -> int:
    """How many members of the pool do not report ``figure`` (see :meth:`Placement._figure`)."""
    if figure == "energy":
        return pool.no_energy
    return pool.no_carbon if figure == "carbon" else pool.no_latency


class Placement:
    """The placement decisions of one coordinator (it is the policies' :class:`FleetView`).

    Args:
        registry: the coordinator's worker registry.
        plans: the coordinator's plans by id (read to find unstarted leases to steal).
        config: settings.
    """

    def __init__(self, registry: WorkerRegistry, plans: Mapping[str, Plan], config: PlacementConfig) -> None:
        config.check()
        self.registry = registry
        self.plans = plans
        self.config = config
        self.policies: dict[str, Policy] = make_policies(config.knobs)
        self.prefix = PrefixIndex()
        self._sessions: OrderedDict[tuple[str, str], str] = OrderedDict()  # (owner, key) -> worker id
        self._revoking: dict[str, tuple[str, int]] = {}  # plan id -> (idle worker it is for, attempt)
        self._now = 0.0  # the time of the decision in progress (busyness ages reports with it)
        # Pools found without room, by id(pool): (pool, registry generation, releases) then.
        self._full: dict[int, tuple[Pool, int, int]] = {}
        self.shares = RecentShares(config.knobs.kv_share_window)  # recent placements per worker (kv_aware)

    # ------------------------------------------------------------------ FleetView

    def busyness(self, worker: WorkerRecord) -> float:
        """4 per lease plus 0.1 per queued prompt token (reported, placed since, aged by its drain rate)."""
        return busyness(len(worker.leases), worker.queued_tokens(self._now))

    def prefix_match(self, hashes: Sequence[int], workers: Sequence[WorkerRecord]) -> dict[str, int]:
        """Per worker id, how many leading ``hashes`` its cache is thought to hold."""
        return self.prefix.match(hashes, (w.id for w in workers))

    def recent_placements(self, worker: WorkerRecord) -> float:
        """The worker's placements, each fading by ``1 - 1/kv_share_window`` per later one (shares.py)."""
        return self.shares.of(worker.id)

    # ------------------------------------------------------------------ workers

    def registered(self, worker: WorkerRecord) -> None:
        """A worker (re)registered: size its prefix index from its KV budget."""
        caps = worker.capabilities
        tokens = caps.prefix_cache_tokens or caps.kv_blocks * caps.kv_block_tokens or self.config.default_cache_tokens
        self.prefix.set_capacity(worker.id, tokens)

    def room_may_have_changed(self) -> None:
        """A drain, undrain or revival: room may have appeared outside a release or registration."""
        self._full.clear()

    def forget(self, worker_ids: Iterable[str]) -> None:
        """Workers were reaped: their caches are gone."""
        for worker_id in worker_ids:
            self.prefix.forget(worker_id)
            self.shares.forget(worker_id)

    # ------------------------------------------------------------------ admission

    def kv_need(self, plan: Plan, worker: WorkerRecord) -> int:
        """KV blocks the plan reserves on the worker (0 when either side gives no figure)."""
        caps = worker.capabilities
        tokens = plan.hints.prompt_tokens + plan.hints.max_output_tokens
        if caps.kv_blocks <= 0 or caps.kv_block_tokens <= 0 or tokens <= 0:
            return 0
        return -(-tokens // caps.kv_block_tokens)

    def kv_reserved(self, worker: WorkerRecord) -> int:
        """Blocks the worker's leases reserve (computed from the leases, so a release frees them)."""
        plans = self.plans
        return sum(self.kv_need(plans[pid], worker) for pid in worker.leases if pid in plans)

    def fits(self, plan: Plan, worker: WorkerRecord) -> bool:
        """Whether the plan's KV blocks fit in what the worker's budget has left, and its devices are free."""
        gpus = plan.gpus
        if gpus is not None and pick(gpus, worker.capabilities, worker.gpu_use) is None:
            return False
        need = self.kv_need(plan, worker)
        return need == 0 or self.kv_reserved(worker) + need <= worker.capabilities.kv_blocks

    def kv_reason(self, plan: Plan, pool: Iterable[WorkerRecord]) -> str | None:
        """Why the plan waits when the only thing missing is KV room, else None."""
        needs = [(self.kv_need(plan, w), w) for w in pool]
        needs = [(need, w) for need, w in needs if need > 0]
        if not needs or any(self.fits(plan, w) for _, w in needs):
            return None
        need, largest = max(needs, key=lambda pair: pair[1].capabilities.kv_blocks)
        if need > largest.capabilities.kv_blocks:
            return (
                f"it needs {need} KV blocks and the largest budget among matching workers is "
                f"{largest.capabilities.kv_blocks} ({largest.id}); lower prompt_tokens/max_output_tokens"
            )
        return f"waiting for KV blocks: it needs {need} and no matching worker has that many free"

    # ------------------------------------------------------------------ choosing

    def policy_name(self, plan: Plan) -> str:
        """The policy that places this plan."""
        return plan.hints.policy or self.config.policy

    def choose(self, plan: Plan, pool: Pool, now: float) -> WorkerRecord | None:
        """The worker of ``pool`` (the signature's workers) that gets the plan; None if none can.

        An indexed pool (the registry's cached one for the signature:
        :meth:`WorkerRegistry.matching`) is answered from its indexes where they are exact (module
        doc, rule 4); an unindexed one (:meth:`Pool.unindexed`, or one the registry retired) by a
        pass over its members. A pool found with no room is remembered: until a lease is
        released, the registry changes or :meth:`room_may_have_changed` is called, a plan without
        KV blocks is answered None without a pass over the pool (with thousands of busy workers
        that pass was most of queueing a submit).
        """
        self._now = now
        registry = self.registry
        # A plan that holds devices is vetted per worker like one with KV blocks: the exact, slower path.
        no_kv = plan.hints.prompt_tokens + plan.hints.max_output_tokens <= 0 and plan.gpus is None
        indexed = pool.indexed
        # The indexes do not know data endpoints: a plan with inputs or outputs is ranked by its policy
        # (a worker with a data endpoint wins a tie: policies._tie).
        if indexed and not (plan.inputs or plan.outputs):
            if not pool.not_plain and self._indexable(plan):
                return self._choose_indexed(plan, pool, now, no_kv)
            figure = self._figure(plan)
            if figure is not None and not _missing(pool, figure):
                return self._choose_indexed(plan, pool, now, no_kv, figure=figure)
        stamp = (registry.generation, registry.releases)
        if no_kv:
            full = self._full.get(id(pool))
            if full is not None and full[0] is pool and full[1:] == stamp:
                return None
        bound = self.config.candidates
        if indexed and 0 < bound < len(pool):
            chosen = self._choose_bounded(plan, pool, now, no_kv, bound)
            if chosen is None and no_kv:
                self._remember_full(pool, stamp)
            return chosen
        free: list[WorkerRecord] = []
        queued: list[WorkerRecord] = []
        for worker in pool:
            if not worker.has_capacity() or not registry.is_alive(worker.id, now) or not self.fits(plan, worker):
                continue
            (free if worker.has_free_slot() else queued).append(worker)
        if not free and not queued:
            if no_kv:
                self._remember_full(pool, stamp)
            return None
        key = plan.hints.session_key
        if key is not None:
            held = self._sessions.get((plan.owner, key))
            for worker in (*free, *queued):
                if worker.id == held:
                    return worker
        return self.policies[self.policy_name(plan)].choose(ask_of(plan), free or queued, self)

    def _remember_full(self, pool: Pool, stamp: tuple[int, int]) -> None:
        """The pool has no room for a plan without KV blocks until ``stamp`` changes (see :meth:`choose`)."""
        if len(self._full) >= 4096:  # many one-off pools: start over rather than grow
            self._full.clear()
        self._full[id(pool)] = (pool, *stamp)

    def _usable(self, plan: Plan, now: float, no_kv: bool) -> Callable[[WorkerRecord], bool]:
        """Whether a member with room can take the plan now: not draining, alive, its KV blocks fit."""
        timeout = self.registry.heartbeat_timeout_s

        def usable(worker: WorkerRecord) -> bool:
            # registry.is_alive, inlined: members of a live pool are the registry's own records.
            return (
                not worker.draining
                and worker.connected
                and now - worker.last_beat_s <= timeout
                and (no_kv or self.fits(plan, worker))
            )

        return usable

    def _sticky(self, plan: Plan, pool: Pool, usable: Callable[[WorkerRecord], bool]) -> WorkerRecord | None:
        """The member the plan's session sticks to, while it can take the plan; else None."""
        key = plan.hints.session_key
        if key is None:
            return None
        held = pool.ids.get(self._sessions.get((plan.owner, key), ""))
        return held if held is not None and held.has_capacity() and usable(held) else None

    def _choose_bounded(self, plan: Plan, pool: Pool, now: float, no_kv: bool, bound: int) -> WorkerRecord | None:
        """:meth:`choose` in a pool of more than ``bound`` members: the policy ranks ``bound`` candidates.

        The candidates are the room index's first ``bound`` usable members of the best tier
        (fewest leases, least recently assigned), so a pool of 10,000 costs O(bound log W);
        ``kv_aware`` with prefix hashes also gets the usable members of that tier whose
        prefix match is longer than every candidate's (the prefix index knows who holds a
        block). When the tier has no more than ``bound`` usable members this is the pass.
        """
        usable = self._usable(plan, now, no_kv)
        held = self._sticky(plan, pool, usable)
        if held is not None:
            return held
        candidates = pool.top(usable, bound)
        if not candidates:
            return None
        name = self.policy_name(plan)
        figure = self._figure(plan)
        if figure is not None and _missing(pool, figure) < len(pool):
            # Some members lack the figure (else its index answered): the best by it join the least loaded.
            tier = 0 if candidates[0].has_free_slot() else 1
            have = {w.id for w in candidates}
            extra = self._by_figure(plan, pool, figure, usable, bound, ties=False, tier=tier)
            candidates += [w for w in extra if w.id not in have]
        hashes = plan.hints.prefix_hashes
        if name == "kv_aware" and hashes:
            free = candidates[0].has_free_slot()

            def eligible(worker_id: str) -> bool:
                worker = pool.ids.get(worker_id)
                return (
                    worker is not None
                    and worker.has_capacity()
                    and (not free or worker.has_free_slot())
                    and usable(worker)
                )

            best = max(self.prefix_match(hashes, candidates).values(), default=0)
            ids = {w.id for w in candidates}
            candidates += [pool.ids[i] for i in self.prefix.longer_holders(hashes, best, eligible) if i not in ids]
        return self.policies[name].choose(ask_of(plan), candidates, self)

    def _indexable(self, plan: Plan) -> bool:
        """Whether the plan's policy ranks plain workers as least busy does (see the module doc)."""
        name = self.policy_name(plan)
        return name in LEAST_BUSY_WHEN_PLAIN or (name == "kv_aware" and not plan.hints.prefix_hashes)

    def _figure(self, plan: Plan) -> str | None:
        """The figure index that ranks first for the plan's policy: "energy", "carbon", "latency"; None if none.

        ``joule_weighted`` and ``carbon_weighted`` without a busyness gap rank by their projection
        first, ``latency_weighted`` by expected latency; busyness only breaks ties.
        """
        policy = self.policies[self.policy_name(plan)]
        if isinstance(policy, JouleWeighted) and policy.max_gap == math.inf:
            return "energy"
        if isinstance(policy, CarbonWeighted) and policy.max_gap == math.inf:
            return "carbon"
        if isinstance(policy, LatencyWeighted):
            return "latency"
        return None

    def _by_figure(
        self,
        plan: Plan,
        pool: Pool,
        figure: str,
        usable: Callable[[WorkerRecord], bool],
        limit: int,
        *,
        ties: bool,
        tier: int | None = None,
    ) -> list[WorkerRecord]:
        """The usable members the figure index puts first (with ``ties``, those tied on the least score)."""
        if figure == "latency":
            return pool.least_latency(usable, limit, ties=ties, tier=tier)
        tokens = max(plan.hints.prompt_tokens + plan.hints.max_output_tokens, 1)
        if figure == "energy":
            return pool.least_energy(usable, tokens, limit, ties=ties, tier=tier)
        return pool.least_carbon(usable, lambda g: projected_carbon(g, tokens), limit, ties=ties, tier=tier)

    def _choose_indexed(
        self, plan: Plan, pool: Pool, now: float, no_kv: bool, *, figure: str | None = None
    ) -> WorkerRecord | None:
        """:meth:`choose` from a pool's indexes: the sticky worker, else the index's answer.

        Plain workers all have busyness 4 per lease, so every policy of
        :data:`LEAST_BUSY_WHEN_PLAIN` ranks them by (tier, leases, last assigned, id): the
        room index's order. With a ``figure`` (every member reports the figure the plan's
        policy ranks by first: :meth:`_figure`), that figure's index gives the best tier's
        workers with the least projection (energy, emissions or expected latency) and
        busyness breaks their tie as the policy does (among the first ``candidates`` of them,
        fewest leases first, in a pool larger than that). The pass in :meth:`choose` gives the
        same worker (tests/unit/test_capacity.py).
        """
        usable = self._usable(plan, now, no_kv)
        held = self._sticky(plan, pool, usable)
        if held is not None:
            return held
        if figure is None:
            return pool.first(usable)
        # Past ``candidates`` members, a tie is broken among the least leased of the tied.
        limit = self.config.candidates if self.config.candidates < len(pool) else 0
        tied = self._by_figure(plan, pool, figure, usable, limit, ties=True)
        return min(tied, key=lambda w: (self.busyness(w), w.last_assigned, w.id), default=None)

    def claimed(self, plan: Plan, worker: WorkerRecord) -> int:
        """The plan was assigned to the worker: count it, remember its prefix and session; return the tokens placed.

        Placement updates only its own indexes (prefix cache, sessions). The prompt tokens the
        worker's cache does not already hold are returned for the caller to hand to the
        registry, which owns the record (:meth:`WorkerRegistry.count_placed_tokens`).
        """
        hints = plan.hints
        self.shares.add(worker.id)
        matched_tokens = 0
        if hints.prefix_hashes:
            block = hints.prefix_block_tokens or worker.capabilities.kv_block_tokens or DEFAULT_BLOCK_TOKENS
            matched = self.prefix.match(hints.prefix_hashes, (worker.id,)).get(worker.id, 0)
            matched_tokens = matched * block
            self.prefix.insert(worker.id, hints.prefix_hashes, block)
        if hints.session_key is not None:
            sessions = self._sessions
            sessions[(plan.owner, hints.session_key)] = worker.id
            sessions.move_to_end((plan.owner, hints.session_key))
            while len(sessions) > self.config.max_sessions:
                sessions.popitem(last=False)
        return max(0, hints.prompt_tokens - matched_tokens)

    def session_worker(self, owner: str, key: str) -> str | None:
        """The worker a session key sticks to now, if any."""
        return self._sessions.get((owner, key))

    # ------------------------------------------------------------------ stealing

    def _revoke_live(self, plan_id: str) -> bool:
        entry = self._revoking.get(plan_id)
        if entry is None:
            return False
        plan = self.plans.get(plan_id)
        if plan is not None and plan.state == "leased" and plan.attempt == entry[1]:
            return True
        del self._revoking[plan_id]  # the lease moved on (started, ended, lost): the steal is over
        return False

    def revoking(self, plan_id: str) -> bool:
        """Whether a revoke of the plan's current lease is awaiting the worker's answer."""
        return self._revoke_live(plan_id)

    def steal_for(self, thief: WorkerRecord, now: float) -> tuple[Plan, WorkerRecord] | None:
        """An unstarted lease to revoke for an idle worker, and the worker holding it; None if none.

        The victim is the alive worker with the most leases beyond its concurrency; the lease
        is the one that would start last there (lowest priority, then newest) among those
        the thief can run. Steals already asked for the thief count against its free slots.
        """
        registry = self.registry
        if self.config.prefetch <= 0 or not thief.has_free_slot() or not registry.is_alive(thief.id, now):
            return None  # without prefetch no worker holds unstarted leases beyond its slots
        asked = sum(1 for pid, (to, _) in list(self._revoking.items()) if to == thief.id and self._revoke_live(pid))
        if len(thief.leases) + asked >= thief.capabilities.max_concurrency:
            return None
        victims = [w for w in registry.iter_alive(now) if w is not thief and w.backlog() > 0 and w.conn_id is not None]
        for victim in sorted(victims, key=lambda w: (-w.backlog(), w.id)):
            unstarted = [
                plan
                for pid in victim.leases
                if (plan := self.plans.get(pid)) is not None
                and plan.state == "leased"
                and plan.worker_id == victim.id
                and not self._revoke_live(pid)
            ]
            unstarted.sort(key=lambda p: (p.priority, -p.queued_at_s, -p.order))
            for plan in unstarted:
                if Signature.of(plan.op, plan.requirements, plan.avoid, plan.gpus).admits(thief) and self.fits(
                    plan, thief
                ):
                    self._revoking[plan.id] = (thief.id, plan.attempt)
                    return plan, victim
        return None
