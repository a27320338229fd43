"""Plans, their transition table and event stream, the plan queue and the coordinator errors."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, get_args

import msgspec
import pytest

from coordinator.devices import GpuNeed
from coordinator.errors import CoordinatorError, InvalidTransition, PlanNotFound, UnknownWorker
from coordinator.placement.plan_queue import PlanQueue, Signature, explain_wait
from coordinator.plans import (
    RESERVED_KINDS,
    TRANSITIONS,
    Plan,
    PlanEventName,
    Subscriptions,
    advance,
    done_event,
    event_bytes,
    submit_problem,
)
from coordinator.registry import WorkerRecord
from protocol import errors
from protocol.errors import FleetwireError
from protocol.messages import Capabilities, GpuInfo, InputSpec, PlanStateName, Requirements, Resources, Submit

STATES: tuple[PlanStateName, ...] = get_args(PlanStateName)
EVENTS: tuple[PlanEventName, ...] = get_args(PlanEventName)


def make_plan(state: PlanStateName = "queued", **kw: Any) -> Plan:
    fields: dict[str, Any] = {
        "id": "p1",
        "op": "echo",
        "args": None,
        "requirements": Requirements(),
        "priority": 0,
        "timeout_s": None,
        "max_attempts": 3,
        "owner": "alice",
        "order": 1,
    }
    late = {name: kw.pop(name) for name in list(kw) if name not in fields and name != "hints"}
    fields.update(kw)
    plan = Plan(**fields)
    plan.state = state
    for name, value in late.items():
        setattr(plan, name, value)
    return plan


def test_plan_init_sets_every_field_with_its_own_containers() -> None:
    """Plan's written-out ``__init__`` sets every declared field, and each plan gets its own lists, dict and hints."""
    first, second = make_plan(), make_plan()
    for f in dataclasses.fields(Plan):
        getattr(first, f.name)  # AttributeError: a field the __init__ left unset
    for name in ("events", "history", "inputs", "outputs", "produced", "after", "replicas", "hints"):
        assert getattr(first, name) is not getattr(second, name), name
    defaults = (first.state, first.attempt, first.next_seq, first.result_size, first.deterministic)
    assert defaults == ("queued", 0, 1, -1, True)


def test_from_submit_carries_every_option_of_the_submit() -> None:
    """``Plan.from_submit`` sets each field a submit gives (beyond the constructor's) from that submit."""
    resources = Resources(gpus=1)
    msg = Submit(
        req_id=1, op="echo", args=[1], priority=3, timeout_s=9.0, max_attempts=2, retries=4, traceparent="00-ab-cd-01",
        inputs=[InputSpec(name="a", size=1, digest="blake3:" + "d" * 64)], outputs=["o"], resources=resources,
        preemptible=True, after=["k"], deterministic=False, deadline_at=123.0, expected_run_s=5.0, replicas={"o": 2},
    )  # fmt: skip
    plan = Plan.from_submit(msg, "p9", "bob", 7)
    got = (plan.id, plan.op, plan.args, plan.priority, plan.timeout_s, plan.max_attempts, plan.owner, plan.order,
           plan.retries, plan.traceparent, plan.inputs, plan.outputs, plan.resources, plan.preemptible, plan.after,
           plan.deterministic, plan.graphed, plan.deadline_at, plan.expected_run_s, plan.replicas)  # fmt: skip
    assert got == ("p9", "echo", [1], 3, 9.0, 2, "bob", 7, 4, "00-ab-cd-01", msg.inputs, ["o"], resources, True, ["k"],
                   False, True, 123.0, 5.0, {"o": 2})  # fmt: skip
    assert plan.gpus is not None and plan.hints is msg.hints
    bare = Plan.from_submit(Submit(req_id=2, op="echo"), "p10", "bob", 8)
    assert (bare.resources, bare.gpus, bare.graphed, bare.expected_run_s) == (None, None, False, 0.0)


# ---------------------------------------------------------------- transition table


@pytest.mark.parametrize(("key", "target"), sorted(TRANSITIONS.items()), ids=lambda v: str(v))
def test_every_transition_in_the_table(key: tuple[PlanStateName, PlanEventName], target: PlanStateName) -> None:
    """Each (state, event) in the table moves the plan to its listed state."""
    state, event = key
    plan = make_plan(state)
    assert advance(plan, event) == target
    assert plan.state == target


ILLEGAL = [(s, e) for s in STATES for e in EVENTS if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda v: str(v))
def test_every_illegal_move_raises_naming_state_and_event(state: PlanStateName, event: PlanEventName) -> None:
    """A move absent from the table raises InvalidTransition naming both, and leaves the plan alone."""
    plan = make_plan(state)
    with pytest.raises(InvalidTransition) as info:
        advance(plan, event)
    assert (info.value.plan_id, info.value.state, info.value.event) == ("p1", state, event)
    assert info.value.code == errors.INVALID_TRANSITION
    assert state in str(info.value) and event in str(info.value)
    assert plan.state == state


def test_table_matches_the_semantics() -> None:
    """The table is exactly the one in docs/SEMANTICS.md §Plan lifecycle and events."""
    live = ("leased", "running")
    expected = {
        ("queued", "assign"): "leased",
        ("queued", "cancel"): "cancelled",
        ("leased", "accept"): "running",
        ("leased", "reject"): "queued",
        ("leased", "revoke"): "queued",
    }
    for state in live:
        expected |= {
            (state, "done.succeeded"): "succeeded",
            (state, "done.failed"): "failed",
            (state, "done.cancelled"): "cancelled",
            (state, "worker_lost"): "queued",
            (state, "worker_lost.final"): "failed",
            (state, "cancel"): "cancelled",
            (state, "retry"): "queued",
            (state, "handback"): "queued",
            (state, "preempt"): "queued",  # a preempted attempt (coordinator/sharing.py)
        }
    expected[("running", "timeout")] = "failed"  # the coordinator's timeout_s backstop (coordinator/timeouts.py)
    expected[("queued", "doom")] = "failed"  # a plan graph's consumer that cannot run (coordinator/plan_graphs.py)
    assert expected == TRANSITIONS


def test_terminal_states_have_no_way_out() -> None:
    """No event leaves succeeded, failed or cancelled."""
    for state in ("succeeded", "failed", "cancelled"):
        assert not [key for key in TRANSITIONS if key[0] == state]
        assert make_plan(state).terminal


def test_done_event_maps_each_outcome() -> None:
    """A worker's done outcome names the matching table event."""
    assert [done_event(o) for o in ("succeeded", "failed", "cancelled")] == [
        "done.succeeded",
        "done.failed",
        "done.cancelled",
    ]


def test_reserved_kinds_are_the_lifecycle_kinds() -> None:
    """Every lifecycle kind the coordinator emits (and data_ready, which only it may send) is reserved."""
    lifecycle = {"queued", "waiting", "leased", "running", "requeued", "preempted", "succeeded", "failed", "cancelled"}
    assert lifecycle | {"data_ready"} == RESERVED_KINDS


# ---------------------------------------------------------------- event stream


def test_events_get_consecutive_seq() -> None:
    """append_event stamps seq 1, 2, 3 and holds the events in order."""
    plan = make_plan()
    for kind in ("queued", "leased", "tok"):
        plan.append_event(kind, {}, attempt=1, ephemeral=False, max_events=100)
    assert [(e.seq, e.kind) for e in plan.events] == [(1, "queued"), (2, "leased"), (3, "tok")]
    assert {e.plan_id for e in plan.events} == {"p1"}
    assert plan.info().last_seq == 3


def test_events_after_replays_from_seq() -> None:
    """events_after(n) returns the held events with seq > n."""
    plan = make_plan()
    for i in range(5):
        plan.append_event(f"k{i}", i, attempt=0, ephemeral=False, max_events=100)
    assert [e.seq for e in plan.events_after(0)] == [1, 2, 3, 4, 5]
    assert [e.seq for e in plan.events_after(3)] == [4, 5]
    assert plan.events_after(5) == []


def test_event_bound_drops_oldest_ephemeral_first() -> None:
    """Past the bound, the oldest ephemeral events go first and durable ones stay."""
    plan = make_plan()
    plan.append_event("queued", {}, attempt=0, ephemeral=False, max_events=10)
    for i in range(20):
        plan.append_event("token", i, attempt=1, ephemeral=True, max_events=10)
    assert len(plan.events) <= 10
    assert plan.events[0].kind == "queued"
    assert plan.events[-1].seq == 21  # the newest is always held
    seqs = [e.seq for e in plan.events]
    assert seqs == sorted(seqs)


def test_event_bound_drops_oldest_durable_when_no_ephemeral_left() -> None:
    """With only durable events, the bound still holds by dropping the oldest."""
    plan = make_plan()
    for i in range(25):
        plan.append_event("log", i, attempt=1, ephemeral=False, max_events=10)
        assert len(plan.events) <= 10
    assert plan.events[-1].seq == 25
    assert plan.next_seq == 26


def test_byte_bound_holds_payload_bytes_ephemeral_first_and_keeps_the_newest() -> None:
    """Past the byte bound the oldest ephemeral payloads go, then old durable ones; the newest always stays."""
    plan = make_plan()
    plan.append_event("queued", {"a": 1}, attempt=0, ephemeral=False, max_events=1000, max_bytes=10_000)
    for _ in range(30):
        plan.append_event("log", "d" * 1000, attempt=1, ephemeral=False, max_events=1000, max_bytes=10_000)
        plan.append_event("token", "e" * 1000, attempt=1, ephemeral=True, max_events=1000, max_bytes=10_000)
        assert plan.held_bytes <= 10_000 and plan.held_bytes == sum(event_bytes(e.data) for e in plan.events)
    assert plan.events[-1].seq == plan.next_seq - 1
    seqs = [e.seq for e in plan.events]
    assert seqs == sorted(seqs)
    assert sum(e.ephemeral for e in plan.events) <= 1  # the ephemeral ones went before any more durable
    huge = plan.append_event("blob", "x" * 50_000, attempt=1, ephemeral=False, max_events=1000, max_bytes=10_000)
    assert plan.events == [huge]  # alone over the bound: held, everything older dropped


def test_event_bytes_sizes_strings_exactly_and_structures_by_encoding() -> None:
    """Strings and bytes count their length, other payloads their msgpack size, each plus a small overhead."""
    assert event_bytes("x" * 100) == 116 and event_bytes(b"x" * 100) == 116
    assert event_bytes({"t": "y" * 500}) > 500
    assert event_bytes(None) == 16


def test_event_bytes_sizes_numbers_as_their_msgpack_encoding() -> None:
    """Ints (every width and sign), floats and bools count exactly what msgpack encodes them to, plus the overhead."""
    edges = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1]
    numbers = [*edges, *(-n for n in edges[1:9]), -32, -33, -128, -129, -(2**15), -(2**15) - 1, -(2**31) - 1, -(2**63)]
    for value in [*numbers, 1.5, -0.0, True, False]:
        assert event_bytes(value) == len(msgspec.msgpack.encode(value)) + 16, value
    assert event_bytes(2**64) == event_bytes(-(2**63) - 1) == 64  # no msgpack form: as any unencodable payload


def test_plan_info_reports_the_record() -> None:
    """info() is the protocol PlanInfo of the plan."""
    plan = make_plan("running", attempt=2, worker_id="w1", priority=5, waiting_reason=None)
    info = plan.info()
    assert (info.id, info.op, info.state, info.attempt, info.worker_id, info.priority) == (
        "p1",
        "echo",
        "running",
        2,
        "w1",
        5,
    )


# ---------------------------------------------------------------- submit validation


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"op": ""}, "op"),
        ({"op": "   "}, "op"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"timeout_s": 0.0}, "timeout_s"),
        ({"timeout_s": -1.0}, "timeout_s"),
        ({"timeout_s": float("nan")}, "timeout_s"),
        ({"plan_id": ""}, "plan_id"),
        ({"requirements": Requirements(min_gpu_memory_bytes=-1)}, "min_gpu_memory_bytes"),
    ],
)
def test_submit_problem_names_the_bad_field(fields: dict[str, Any], fragment: str) -> None:
    """An invalid submit is explained by naming the field at fault."""
    msg = Submit(**{"req_id": 1, "op": "echo", **fields})
    problem = submit_problem(msg)
    assert problem is not None and fragment in problem


def test_submit_problem_accepts_valid_submit() -> None:
    """A valid submit has no problem."""
    assert submit_problem(Submit(req_id=1, op="echo", timeout_s=5.0, max_attempts=1, plan_id="k")) is None


# ---------------------------------------------------------------- queue


def worker(wid: str, **kw: Any) -> WorkerRecord:
    capabilities = Capabilities(**{"ops": ["echo"], "max_concurrency": 1, **kw})
    return WorkerRecord(wid, capabilities)


def test_signature_normalises_tags() -> None:
    """Tag order and duplicates do not split a group."""
    a = Signature.of("echo", Requirements(tags=["b", "a", "a"]))
    b = Signature.of("echo", Requirements(tags=["a", "b"]))
    assert a == b and a.tags == ("a", "b")


def test_signature_of_sets_each_field_by_name() -> None:
    """Signature.of (built without the NamedTuple's __new__) gives each requirement its named field."""
    gpus = GpuNeed(count=1)
    needs = Requirements(tags=["t"], accelerator="gpu", model="m", min_gpu_memory_bytes=5, python_env="env")
    sig = Signature.of("echo", needs, avoid=["w2", "w1", "w2"], gpus=gpus)
    assert type(sig) is Signature
    assert sig == Signature(op="echo", tags=("t",), accelerator="gpu", model="m", min_gpu_memory_bytes=5,
                            python_env="env", avoid=("w1", "w2"), gpus=gpus)


def test_queue_orders_by_priority_then_age() -> None:
    """Within a signature the head is the highest priority, then the oldest."""
    queue = PlanQueue()
    sig = Signature.of("echo", Requirements())
    order = itertools.count(1)
    for plan_id, priority in (("low", 0), ("high-old", 5), ("high-new", 5), ("mid", 1)):
        queue.push(plan_id, sig, priority, next(order))
    assert queue.plans_in(sig) == ["high-old", "high-new", "mid", "low"]
    taken = []
    while (head := queue.best_for(lambda s: True)) is not None:
        taken.append(head)
        queue.discard(head)
    assert taken == ["high-old", "high-new", "mid", "low"]
    assert len(queue) == 0


def test_queue_lazy_deletion_and_requeue() -> None:
    """A discarded plan is skipped; pushed again, it takes only its new place."""
    queue = PlanQueue()
    sig = Signature.of("echo", Requirements())
    queue.push("a", sig, 0, 1)
    queue.push("b", sig, 0, 2)
    assert queue.discard("a") is True
    assert queue.discard("a") is False
    assert "a" not in queue and queue.best_for(lambda s: True) == "b"
    queue.push("a", sig, 0, 1)
    assert queue.plans_in(sig) == ["a", "b"]
    other = Signature.of("echo", Requirements(tags=["gpu"]))
    queue.push("a", other, 0, 1)  # moved: its old entry must not revive
    assert queue.plans_in(sig) == ["b"] and queue.signature_of("a") == other


def test_queue_best_for_only_admitted_signatures() -> None:
    """best_for compares the heads of the signatures the worker satisfies, never the others."""
    queue = PlanQueue()
    gpu = Signature.of("echo", Requirements(tags=["gpu"]))
    cpu = Signature.of("echo", Requirements())
    queue.push("gpu-urgent", gpu, 9, 1)
    queue.push("cpu-old", cpu, 0, 2)
    queue.push("cpu-urgent", cpu, 3, 3)
    plain = worker("w1")
    assert queue.best_for(lambda s: s.admits(plain)) == "cpu-urgent"
    assert queue.best_for(lambda s: s.admits(worker("w2", tags=["gpu"]))) == "gpu-urgent"
    queue.discard("gpu-urgent")
    assert queue.signatures() == [cpu]  # the empty group is dropped


def test_queue_forgive_moves_plans_keeping_their_place() -> None:
    """forgive() moves plans that avoided a worker into the group without it, priority and age kept."""
    queue = PlanQueue()
    plain = Signature.of("echo", Requirements())
    avoiding = Signature.of("echo", Requirements(), avoid=["w1", "w2"])
    queue.push("old", avoiding, 0, 1)
    queue.push("mid", plain, 0, 2)
    queue.push("urgent", avoiding, 5, 3)
    assert queue.forgive("w9") == []
    assert queue.forgive("w1") == ["urgent", "old"]
    only_w2 = Signature.of("echo", Requirements(), avoid=["w2"])
    assert queue.plans_in(only_w2) == ["urgent", "old"]
    assert queue.plans_in(avoiding) == [] and queue.plans_in(plain) == ["mid"]


def test_signature_admits_checks_every_requirement() -> None:
    """A worker is admitted only with the op, all tags, the accelerator, model, GPU memory and env."""
    req = Requirements(
        tags=["a"], accelerator="gpu", model="llama", min_gpu_memory_bytes=40_000_000_000, python_env="py311"
    )
    sig = Signature.of("gen", req)
    good: dict[str, Any] = {
        "ops": ["gen"],
        "tags": ["a", "b"],
        "accelerator": "gpu",
        "models": ["llama"],
        "gpus": [GpuInfo(name="A100", memory_bytes=80_000_000_000)],
        "python_envs": ["py311"],
    }
    assert sig.admits(worker("w", **good))
    assert sig.admits(worker("w", **{**good, "accelerator": "mixed"}))
    for key, bad in [
        ("ops", ["echo"]),
        ("tags", ["b"]),
        ("accelerator", "cpu"),
        ("models", []),
        ("gpus", [GpuInfo(name="T4", memory_bytes=16_000_000_000)]),
        ("python_envs", []),
    ]:
        assert not sig.admits(worker("w", **{**good, key: bad})), key
    assert not Signature.of("gen", req, avoid=["w"]).admits(worker("w", **good))


def test_explain_wait_names_the_first_unmet_requirement() -> None:
    """explain_wait says which requirement no alive worker meets, or that all are at capacity."""
    sig = Signature.of("x", Requirements(tags=["gpu"]))
    assert explain_wait(sig, []) == "no connected worker handles op 'x'"
    assert explain_wait(sig, [worker("w1", ops=["y"])]) == "no connected worker handles op 'x'"
    assert explain_wait(sig, [worker("w1", ops=["x"])]) == "no worker handling op 'x' has tags [gpu]"
    model_sig = Signature.of("x", Requirements(tags=["gpu"], model="m"))
    assert (
        explain_wait(model_sig, [worker("w1", ops=["x"], tags=["gpu"])])
        == "no worker handling op 'x' with tags [gpu] has model 'm'"
    )
    full = [worker(w, ops=["x"], tags=["gpu"]) for w in ("w1", "w2")]
    for record in full:
        record.leases.add("busy")
    assert explain_wait(sig, full) == "all matching workers are at capacity"
    assert explain_wait(sig, full[:1]) == "the only matching worker (w1) is at capacity"
    avoided = Signature.of("x", Requirements(tags=["gpu"]), avoid=["w1"])
    assert explain_wait(avoided, full[:1]) == "every matching worker rejected it (w1)"


# ---------------------------------------------------------------- subscriptions


def test_subscriptions_follow_and_forget() -> None:
    """Connections follow plans one by one or all of a principal's, and are forgotten on drop."""
    subs = Subscriptions()
    subs.add("p1", 1)
    subs.add("p1", 2)
    subs.add_all("alice", 2)
    assert set(subs.followers("p1")) == {1, 2}
    assert subs.all_followers("alice") == [2] and subs.follows_all(2)
    subs.remove("p1", 1)
    subs.remove("p1", 1)
    assert set(subs.followers("p1")) == {2}
    subs.drop(2)
    assert not subs.followers("p1") and subs.all_followers("alice") == [] and not subs.follows_all(2)
    assert subs.plans_of(2) == set()


# ---------------------------------------------------------------- errors


def test_error_tree_and_codes() -> None:
    """Coordinator errors descend from FleetwireError and carry structured fields and stable codes."""
    cases = [
        (UnknownWorker("w1"), errors.UNKNOWN_WORKER, {"worker_id": "w1"}),
        (PlanNotFound("p1"), errors.PLAN_NOT_FOUND, {"plan_id": "p1"}),
        (InvalidTransition("p1", "queued", "accept"), errors.INVALID_TRANSITION, {"state": "queued"}),
    ]
    for exc, code, fields in cases:
        assert isinstance(exc, CoordinatorError) and isinstance(exc, FleetwireError)
        assert exc.code == code
        for name, value in fields.items():
            assert getattr(exc, name) == value
    assert CoordinatorError("boom").code == errors.INTERNAL
