"""Placement in the core: filtering, sticky sessions, KV-block admission, prefetch and stealing (fake clock)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from coordinator import Coordinator, CoreConfig
from coordinator.placement.placer import PlacementConfig
from coordinator.placement.plan_queue import PlanQueue, Signature
from coordinator.placement.policies import PolicyKnobs
from coordinator.placement.prefix import PrefixIndex
from coordinator.registry import WorkerRegistry
from protocol import errors
from protocol.messages import (
    Accept,
    Accepted,
    Assign,
    Capabilities,
    Done,
    Error,
    Event,
    GpuInfo,
    Heartbeat,
    Hello,
    Load,
    Reject,
    Requirements,
    Revoke,
    RoutingHints,
    Submit,
    Welcome,
)


class Fleet:
    """A core with a fake clock; workers and clients as connection ids, their inboxes filled from the effects."""

    def __init__(self, **placement: Any) -> None:
        self.now = 0.0
        ids = (f"p{i}" for i in itertools.count(1))
        self.core = Coordinator(CoreConfig(placement=PlacementConfig(**placement)), new_id=lambda: next(ids))
        self.inbox: dict[int, list[Any]] = {}
        self.conn_of: dict[str, int] = {}
        self._conns = itertools.count(1)
        self._req = itertools.count(1)
        self.client = self.open_client("alice")

    def open_client(self, principal: str) -> int:
        conn = next(self._conns)
        self.core.open_session(conn, "client", self.now, principal=principal)
        return conn

    def _pump(self) -> None:
        for conn_id, msgs in self.core.take_effects().sends.items():
            self.inbox.setdefault(conn_id, []).extend(msgs)

    def send(self, conn: int, msg: Any) -> None:
        self.core.receive(conn, msg, self.now)
        self._pump()

    def worker(self, worker_id: str, max_concurrency: int = 2, **caps: Any) -> int:
        conn = next(self._conns)
        self.conn_of[worker_id] = conn
        self.core.open_session(conn, "worker", self.now)
        caps.setdefault("ops", ["generate"])
        self.send(conn, Hello(worker_id=worker_id, capabilities=Capabilities(max_concurrency=max_concurrency, **caps)))
        return conn

    def submit(self, op: str = "generate", *, client: int | None = None, **kw: Any) -> str:
        conn = self.client if client is None else client
        self.send(conn, Submit(req_id=next(self._req), op=op, subscribe=False, **kw))
        replies = self.take(conn)
        accepted = [m for m in replies if isinstance(m, Accepted)]
        assert accepted, replies
        return accepted[-1].plan_id

    def take(self, conn: int) -> list[Any]:
        return self.inbox.pop(conn, [])

    def assigns(self, worker_id: str) -> list[str]:
        return [m.plan_id for m in self.take(self.conn_of[worker_id]) if isinstance(m, Assign)]

    def where(self, plan_id: str) -> str | None:
        plan = self.core.plans[plan_id]
        return plan.worker_id if plan.state in ("leased", "running") else None

    def finish(self, plan_id: str) -> None:
        plan = self.core.plans[plan_id]
        assert plan.worker_id is not None
        conn = self.conn_of[plan.worker_id]
        if plan.state == "leased":
            self.send(conn, Accept(plan_id=plan_id, attempt=plan.attempt))
        self.send(conn, Done(plan_id=plan_id, attempt=plan.attempt, outcome="succeeded"))


GB = 1_000_000_000


# ---------------------------------------------------------------- filtering


def test_plan_lands_only_on_a_worker_with_its_tags_model_and_gpu_memory() -> None:
    """A plan needing tags, a model and GPU memory goes to the one worker that has all three."""
    f = Fleet(policy="least_busy")
    f.worker("cpu", tags=["eu"], models=["llama"])
    f.worker("small-gpu", tags=["eu"], models=["llama"], gpus=[GpuInfo("L4", memory_bytes=24 * GB)])
    f.worker("big-gpu", tags=["eu"], models=["llama"], gpus=[GpuInfo("H100", memory_bytes=80 * GB)])
    f.worker("big-gpu-other-model", tags=["eu"], models=["mistral"], gpus=[GpuInfo("H100", memory_bytes=80 * GB)])
    needs = Requirements(tags=["eu"], model="llama", min_gpu_memory_bytes=40 * GB)
    placed = [f.where(f.submit(requirements=needs)) for _ in range(3)]
    assert placed == ["big-gpu", "big-gpu", None]  # the third waits for big-gpu's room; it goes nowhere else


def test_plan_that_fits_nowhere_waits_and_says_why() -> None:
    """No worker with enough GPU memory: the plan stays queued with a reason naming the requirement."""
    f = Fleet()
    f.worker("small-gpu", gpus=[GpuInfo("L4", memory_bytes=24 * GB)])
    plan_id = f.submit(requirements=Requirements(min_gpu_memory_bytes=40 * GB))
    assert f.core.plans[plan_id].state == "queued"
    assert "40.0 GB" in (f.core.plans[plan_id].waiting_reason or "")


def test_hints_are_validated_at_submit() -> None:
    """An unknown policy or a negative token estimate is refused with invalid_argument naming the field."""
    f = Fleet()
    f.send(f.client, Submit(req_id=1, op="generate", hints=RoutingHints(policy="fastest")))
    error = next(m for m in f.take(f.client) if isinstance(m, Error))
    assert error.code == errors.INVALID_ARGUMENT and "fastest" in error.message and "kv_aware" in error.message
    f.send(f.client, Submit(req_id=2, op="generate", hints=RoutingHints(prompt_tokens=-1)))
    error = next(m for m in f.take(f.client) if isinstance(m, Error))
    assert error.code == errors.INVALID_ARGUMENT and "prompt_tokens" in error.message
    f.send(f.client, Submit(req_id=3, op="generate", hints=RoutingHints(prefix_hashes=list(range(20_000)))))
    error = next(m for m in f.take(f.client) if isinstance(m, Error))
    assert error.code == errors.INVALID_ARGUMENT and "prefix_hashes" in error.message
    assert not f.core.plans


def test_unknown_default_policy_is_refused_at_startup() -> None:
    """A coordinator configured with an unknown default policy does not start."""
    with pytest.raises(ValueError, match="unknown placement policy 'nope'"):
        Fleet(policy="nope")


def test_plan_policy_overrides_the_default_and_is_counted() -> None:
    """hints.policy picks the policy for that plan; placements are counted per policy."""
    f = Fleet(policy="least_busy")
    f.worker("a", max_concurrency=8)
    f.worker("b", max_concurrency=8)
    f.submit()
    f.submit(hints=RoutingHints(policy="round_robin"))
    assert f.core.counters["placements.least_busy"] == 1
    assert f.core.counters["placements.round_robin"] == 1


def test_load_counts_the_coordinators_own_leases_not_a_stale_report() -> None:
    """Workers whose last reports say idle still get a burst spread evenly: the core counts its own leases."""
    f = Fleet(policy="least_busy")
    for name in ("a", "b", "c"):
        f.send(f.worker(name, max_concurrency=10), Heartbeat(load=Load(in_flight=0)))
    placed = [f.where(f.submit()) for _ in range(9)]
    assert sorted(placed.count(w) for w in ("a", "b", "c")) == [3, 3, 3]


def test_queued_tokens_placed_since_the_report_count_until_the_next_one() -> None:
    """Prompt tokens placed since a worker's report make it busier until its next report covers them."""
    f = Fleet(policy="least_busy")
    a = f.worker("a", max_concurrency=10)
    f.worker("b", max_concurrency=10)
    first = f.submit(hints=RoutingHints(prompt_tokens=8000))  # a: 4 + 800
    second = f.submit(hints=RoutingHints(prompt_tokens=100))  # b: 4 + 10
    assert (f.where(first), f.where(second)) == ("a", "b")
    assert f.where(f.submit()) == "b"  # a is still busier (804 vs 14)
    f.now = 1.0
    f.send(a, Heartbeat(load=Load(queued_tokens=0)))  # a worked through its queue
    assert f.where(f.submit()) == "a"  # a: 4 vs b: 8 + 10


def test_drain_rate_is_learned_from_reports_and_ages_the_estimate() -> None:
    """Two reports teach the registry how fast a worker drains queued tokens; its estimate decays with time."""
    reg = WorkerRegistry(30.0)
    record = reg.register("a", Capabilities(max_concurrency=4), 0.0)
    reg.heartbeat("a", Load(queued_tokens=10_000), 0.0)
    reg.count_placed_tokens("a", 2_000)
    reg.heartbeat("a", Load(queued_tokens=2_000), 10.0)  # had 12k, has 2k: 1k tokens/s
    assert record.drain_tokens_per_s == pytest.approx(1_000)
    assert record.queued_tokens(10.0) == pytest.approx(2_000)
    assert record.queued_tokens(11.5) == pytest.approx(500)
    assert record.queued_tokens(20.0) == 0


# ---------------------------------------------------------------- sticky sessions


def test_session_key_sticks_to_its_worker_while_it_has_room() -> None:
    """Plans with one session key go to the same worker, although the policy would spread them."""
    f = Fleet(policy="round_robin")
    for name in ("a", "b", "c"):
        f.worker(name, max_concurrency=4)
    placed = [f.where(f.submit(hints=RoutingHints(session_key="chat-1"))) for _ in range(4)]
    assert len(set(placed)) == 1


def test_session_moves_when_its_worker_is_full_or_gone() -> None:
    """A session whose worker is full moves to the policy's choice and stays there; a gone worker too."""
    f = Fleet(policy="least_busy")
    f.worker("a", max_concurrency=1)
    f.worker("b", max_concurrency=1)
    first = f.submit(hints=RoutingHints(session_key="s"))
    home = f.where(first)
    second = f.submit(hints=RoutingHints(session_key="s"))  # home is full
    other = f.where(second)
    assert other not in (None, home)
    f.finish(first)
    f.finish(second)
    assert f.where(f.submit(hints=RoutingHints(session_key="s"))) == other  # the session moved
    f.core.close_session(f.conn_of[other], f.now)  # its worker disconnects (not alive)
    f._pump()
    assert f.where(f.submit(hints=RoutingHints(session_key="s"))) == home


def test_session_keys_are_scoped_by_principal() -> None:
    """Two principals using the same session key do not share a worker through it."""
    f = Fleet(policy="least_busy")
    f.worker("a", max_concurrency=4)
    f.worker("b", max_concurrency=4)
    bob = f.open_client("bob")
    alice_home = f.where(f.submit(hints=RoutingHints(session_key="k")))
    bob_home = f.where(f.submit(client=bob, hints=RoutingHints(session_key="k")))
    assert alice_home != bob_home  # least busy sent bob elsewhere; alice's key did not pull him
    assert f.core.placement.session_worker("alice", "k") == alice_home
    assert f.core.placement.session_worker("bob", "k") == bob_home


# ---------------------------------------------------------------- KV-block admission


def test_kv_blocks_are_reserved_while_leased_and_freed_on_done() -> None:
    """A plan reserves ceil(tokens / block) blocks; one that does not fit waits until blocks are freed."""
    f = Fleet()
    f.worker("gpu", max_concurrency=8, kv_blocks=100, kv_block_tokens=16)
    big = f.submit(hints=RoutingHints(prompt_tokens=1000, max_output_tokens=200))  # 75 blocks
    record = f.core.registry.get("gpu")
    assert f.core.placement.kv_reserved(record) == 75
    second = f.submit(hints=RoutingHints(prompt_tokens=400, max_output_tokens=16))  # 26 blocks: 101 > 100
    assert f.core.plans[second].state == "queued"
    assert "KV blocks" in (f.core.plans[second].waiting_reason or "")
    small = f.submit(hints=RoutingHints(prompt_tokens=300, max_output_tokens=20))  # 20 blocks
    assert f.core.plans[small].state == "queued"  # queued behind second: first come, first served in a group
    f.finish(big)
    assert f.where(second) == "gpu" and f.where(small) == "gpu"
    assert f.core.placement.kv_reserved(record) == 46


def test_kv_need_beyond_every_budget_names_the_largest() -> None:
    """A plan needing more blocks than any matching worker has waits with a reason naming the largest budget."""
    f = Fleet()
    f.worker("gpu", kv_blocks=50, kv_block_tokens=16)
    plan_id = f.submit(hints=RoutingHints(prompt_tokens=4000))
    reason = f.core.plans[plan_id].waiting_reason or ""
    assert "250 KV blocks" in reason and "largest budget" in reason and "50" in reason


def test_workers_without_a_budget_and_plans_without_tokens_skip_admission() -> None:
    """KV admission applies only when the worker has a budget and the plan has token estimates."""
    f = Fleet()
    f.worker("cpu", max_concurrency=4)
    f.worker("gpu", max_concurrency=4, kv_blocks=1, kv_block_tokens=16)
    assert f.where(f.submit(hints=RoutingHints(prompt_tokens=10_000))) == "cpu"
    assert f.where(f.submit()) is not None


# ---------------------------------------------------------------- prefetch and stealing


def test_prefetch_gives_a_busy_worker_leases_beyond_its_concurrency() -> None:
    """With prefetch 2, a worker of concurrency 1 holds three leases; welcome tells it the prefetch."""
    f = Fleet(prefetch=2)
    conn = f.worker("a", max_concurrency=1)
    assert next(m for m in f.take(conn) if isinstance(m, Welcome)).prefetch == 2
    plans = [f.submit() for _ in range(4)]
    assert [f.where(p) for p in plans] == ["a", "a", "a", None]


def test_free_slots_come_before_prefetch() -> None:
    """A plan goes to a worker's local queue only when no matching worker has a free slot."""
    f = Fleet(policy="joule_weighted", prefetch=4)
    f.send(f.worker("efficient", max_concurrency=1), Heartbeat(load=Load(uj_per_token=1.0)))
    f.send(f.worker("wasteful", max_concurrency=1), Heartbeat(load=Load(uj_per_token=9.0)))
    assert [f.where(f.submit()) for _ in range(3)] == ["efficient", "wasteful", "efficient"]


def _backlogged() -> tuple[Fleet, list[str]]:
    f = Fleet(prefetch=3)
    a = f.worker("a", max_concurrency=1)
    plans = [f.submit() for _ in range(4)]
    f.send(a, Accept(plan_id=plans[0], attempt=1))  # it runs the first; three wait in its local queue
    f.take(a)
    return f, plans


def test_idle_worker_steals_the_newest_unstarted_lease_of_the_most_backlogged() -> None:
    """A worker that joins idle, with nothing queued, makes the core revoke the newest unstarted lease."""
    f, plans = _backlogged()
    f.worker("b", max_concurrency=1)
    revokes = [m for m in f.take(f.conn_of["a"]) if isinstance(m, Revoke)]
    assert [(r.plan_id, r.attempt) for r in revokes] == [(plans[3], 1)]
    assert f.where(plans[3]) == "a"  # nothing changes until a answers
    f.send(f.conn_of["a"], Reject(plan_id=plans[3], attempt=1, code=errors.REVOKED))
    assert f.where(plans[3]) == "b" and f.core.plans[plans[3]].attempt == 2
    assert "a" not in f.core.plans[plans[3]].avoid  # a revoke is no reject: a may get it again
    assert f.core.counters["plans_revoked"] == 1
    assert f.assigns("b") == [plans[3]]


def test_revoke_of_a_started_plan_changes_nothing() -> None:
    """If the victim started the plan before the revoke arrived, its accept wins and the plan stays."""
    f, plans = _backlogged()
    f.worker("b", max_concurrency=1)
    victim = f.conn_of["a"]
    f.send(victim, Accept(plan_id=plans[3], attempt=1))  # started: it ignores the revoke
    assert f.core.plans[plans[3]].state == "running" and f.where(plans[3]) == "a"
    assert not f.core.placement.revoking(plans[3])
    f.send(victim, Done(plan_id=plans[3], attempt=1, outcome="succeeded"))
    assert f.core.plans[plans[3]].state == "succeeded"


def test_one_steal_per_free_slot() -> None:
    """An idle worker asks for no more steals than it has free slots, counting those in flight."""
    f, _ = _backlogged()
    f.worker("b", max_concurrency=1)
    f.worker("c", max_concurrency=2)
    revoked = [m.plan_id for m in f.take(f.conn_of["a"]) if isinstance(m, Revoke)]
    assert len(revoked) == 3 and len(set(revoked)) == 3  # one for b, two for c


def test_no_steal_while_the_queue_has_work_for_the_idle_worker() -> None:
    """An idle worker takes queued plans first; stealing only starts when nothing queued fits it."""
    f = Fleet(prefetch=1)
    a = f.worker("a", max_concurrency=1)
    plans = [f.submit() for _ in range(3)]  # a runs one, holds one; one queued
    f.send(a, Accept(plan_id=plans[0], attempt=1))
    f.take(a)
    f.worker("b", max_concurrency=1)
    assert f.where(plans[2]) == "b"
    assert not [m for m in f.take(a) if isinstance(m, Revoke)]


# ---------------------------------------------------------------- the queue and the prefix index


def test_best_for_holds_a_group_back_behind_a_head_that_does_not_fit() -> None:
    """best_for skips a group whose head does not fit, rather than letting a later plan overtake it."""
    queue = PlanQueue()
    sig = Signature(op="generate")
    queue.push("big", sig, 0, 1)
    queue.push("small", sig, 0, 2)
    other = Signature(op="generate", tags=("x",))
    queue.push("other", other, 0, 3)
    assert queue.best_for(lambda s: True, lambda pid: pid != "big") == "other"
    assert queue.best_for(lambda s: True) == "big"
    assert queue.counts() == {sig: 2, other: 1}


def test_prefix_index_matches_leading_blocks_and_evicts_the_tail_first() -> None:
    """The index holds per worker an LRU of block hashes; a prompt's deepest blocks are evicted first."""
    index = PrefixIndex()
    index.set_capacity("a", 4 * 512)
    index.set_capacity("b", 100 * 512)
    index.insert("a", [1, 2, 3], 512)
    index.insert("b", [1, 2, 9], 512)
    assert index.match([1, 2, 3, 4], ["a", "b"]) == {"a": 3, "b": 2}
    index.insert("a", [7, 8], 512)  # 5 blocks > 4: the oldest touched, block 3 (the tail), goes first
    assert index.match([1, 2, 3], ["a"]) == {"a": 2}
    assert index.held("a") == 4
    index.forget("b")
    assert index.match([1, 2], ["a", "b"]) == {"a": 2}


def test_kv_aware_routes_a_follow_up_to_the_worker_that_holds_its_prefix() -> None:
    """Through the core: a follow-up turn sharing a long prefix goes where the first turn went."""
    f = Fleet(policy="kv_aware", knobs=PolicyKnobs(kv_min_match_blocks=2))
    for name in ("a", "b", "c"):
        f.worker(name, max_concurrency=8, prefix_cache_tokens=1_000_000)
    first = f.submit(hints=RoutingHints(prefix_hashes=[0, 11, 12], prompt_tokens=1500, prefix_block_tokens=512))
    home = f.where(first)
    for _ in range(3):  # other conversations sharing only block 0 spread by load
        f.submit(hints=RoutingHints(prefix_hashes=[0, 99], prompt_tokens=1000, prefix_block_tokens=512))
    follow_up = f.submit(hints=RoutingHints(prefix_hashes=[0, 11, 12, 13], prompt_tokens=2000, prefix_block_tokens=512))
    assert f.where(follow_up) == home
    events = [m for m in f.take(f.client) if isinstance(m, Event)]
    assert events == []  # subscribe=False: nothing streamed to the client
