"""The cost model's pure parts (issue 17: findings 1, 3, 4, 5 and 11), with the core and a fake clock.

Listings are summaries and pages that stay under every frame limit; a large replay goes out in
slices with each plan's live events after its replayed ones; requests are charged work units;
waiting reasons stay short; connection shares and the workers' reserve.
"""

from __future__ import annotations

import msgspec
import pytest

from coordinator.limits import CostBuckets, Limits
from coordinator.operator_requests import PAGE_BYTES, PAGE_ROWS
from coordinator.streams import REPLAY_SLICE_EVENTS
from protocol.caps import MAX_TAG_BYTES, MAX_TAGS
from protocol.messages import (
    Accept,
    Done,
    Error,
    Event,
    ListPlans,
    Plans,
    Requirements,
    Submit,
    Subscribe,
    Subscribed,
)
from tests.unit.test_core import Harness, only

BIG_TAGS = [f"{i:03d}" + "t" * (MAX_TAG_BYTES - 3) for i in range(MAX_TAGS)]  # the most the caps allow


def test_listing_pages_stay_under_the_frame_limit_and_walk_every_plan_once() -> None:
    """Plans with the largest tag lists come in pages of about PAGE_BYTES with a cursor, each plan once."""
    h = Harness()
    alice = h.client()
    ids = h.submit_all(alice, ({"requirements": Requirements(tags=BIG_TAGS)} for _ in range(300)))
    h.take(alice)
    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        h.send(alice, ListPlans(req_id=1, limit=10_000, cursor=cursor))
        reply = only(h.take(alice), Plans)
        assert len(msgspec.msgpack.encode(reply)) < 2 * PAGE_BYTES  # far under a 1 MiB frame
        assert reply.total == 300 and reply.counts == {"queued": 300}
        seen += [p.id for p in reply.plans]
        pages += 1
        if not reply.next_cursor:
            break
        cursor = reply.next_cursor
    assert pages > 1
    assert seen == ids[::-1]  # newest first, every plan exactly once


def test_listing_rows_carry_result_sizes_not_results() -> None:
    """A listing row has no result body, only its size; get_plan still has the result."""
    h = Harness()
    h.worker("w1")
    alice = h.client()
    plan_id = h.submit(alice)
    h.send(1, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result="x" * 100_000))
    h.take(alice)
    h.send(alice, ListPlans(req_id=1))
    row = only(h.take(alice), Plans).plans[0]
    assert row.state == "succeeded" and row.result is None and row.result_bytes == 100_000


def test_a_bad_cursor_is_refused_with_invalid_argument() -> None:
    """A cursor the coordinator did not give is answered invalid_argument naming the cursor."""
    h = Harness()
    alice = h.client()
    h.send(alice, ListPlans(req_id=5, cursor="not-a-cursor"))
    error = h.take(alice)[0]
    assert error.code == "invalid_argument" and "cursor" in error.message


def test_requests_are_charged_the_rows_they_scan() -> None:
    """list_plans and subscribe(all) are charged at least a work unit per plan they look at."""
    h = Harness()
    alice = h.client()
    h.submit_all(alice, ({} for _ in range(500)))
    outbox = h.core.outbox
    before = outbox.work
    h.send(alice, ListPlans(req_id=1, limit=10))
    assert outbox.work - before >= 500
    before = outbox.work
    h.send(alice, Subscribe(req_id=2, all=True, from_seq=0))
    assert outbox.work - before >= 1000  # 500 plans scanned, 500 queued events to replay


def test_a_large_replay_goes_out_in_slices_and_live_events_follow_it() -> None:
    """subscribe(all, from_seq=0) over many events sends only `subscribed` at once; the pump sends the
    rest a slice at a time, and a plan's live event arrives after its replayed ones, never before."""
    h = Harness()
    w = h.worker("w1", max_concurrency=100)
    alice = h.client()
    ids = [h.submit(alice) for _ in range(40)]
    for plan_id in ids:
        h.send(w, Accept(plan_id=plan_id, attempt=1))
        for n in range(30):
            h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data=f"line {n}"))
    bob = h.client("alice")
    h.send(bob, Subscribe(req_id=1, all=True, from_seq=0))
    first = h.take(bob)
    assert isinstance(first[0], Subscribed) and sorted(first[0].plan_ids) == sorted(ids)
    assert not [m for m in first if isinstance(m, Event)]  # nothing replayed in the subscribe's own step
    assert h.core.streams.replaying
    got: list[Event] = []
    slices = 0
    while h.core.streams.replaying:
        sent = h.core.pump(REPLAY_SLICE_EVENTS)
        h._pump()
        assert 0 < sent <= REPLAY_SLICE_EVENTS + 1
        got += [m for m in h.take(bob) if isinstance(m, Event)]
        slices += 1
        if slices == 2:  # a live event mid-replay: after the replayed ones of its plan
            h.send(w, Event(plan_id=ids[-1], attempt=1, kind="log", data="live"))
    assert slices > 3
    for plan_id in ids:
        seqs = [e.seq for e in got if e.plan_id == plan_id]
        assert seqs == list(range(1, len(seqs) + 1)), plan_id  # in order, no gap, no repeat
    last_plan = [e.data for e in got if e.plan_id == ids[-1]]
    assert last_plan.count("live") == 1 and last_plan[-1] == "live"


def test_closing_a_subscriber_drops_its_replay() -> None:
    """A subscriber that leaves mid-replay costs nothing more: its replay is dropped."""
    h = Harness()
    w = h.worker("w1", max_concurrency=100)
    alice = h.client()
    for _ in range(20):
        plan_id = h.submit(alice)
        h.send(w, Accept(plan_id=plan_id, attempt=1))
        for n in range(40):
            h.send(w, Event(plan_id=plan_id, attempt=1, kind="log", data=n))
    bob = h.client("alice")
    h.send(bob, Subscribe(req_id=1, all=True, from_seq=0))
    assert h.core.streams.replaying
    h.close(bob)
    assert not h.core.streams.replaying


def test_a_submit_past_the_byte_limit_is_refused_naming_bytes() -> None:
    """A principal's unfinished plans are bounded by bytes too: the next is too_many_plans naming bytes."""
    h = Harness(max_bytes_per_client=100_000)
    alice = h.client()
    h.submit(alice, args="x" * 60_000)
    h.take(alice)
    h.send(alice, Submit(req_id=9, op="echo", args="y" * 60_000))
    error = h.take(alice)[0]
    assert error.code == "too_many_plans" and "bytes" in error.message and "--max-bytes-per-client" in error.message
    h.send(h.client("bob"), Submit(req_id=10, op="echo", args="y" * 60_000))  # another principal is not touched
    assert h.core.quota.held_bytes("bob") > 60_000


def test_a_listing_page_holds_at_most_page_rows_rows_however_small() -> None:
    """1,200 small plans with limit 10,000: pages of PAGE_ROWS rows (one request's work bounded), each plan once."""
    h = Harness()
    alice = h.client()
    ids = h.submit_all(alice, ({"priority": i % 3} for i in range(1_200)))  # the invariant checked once
    h.take(alice)
    seen: list[str] = []
    cursor = ""
    while True:
        h.send(alice, ListPlans(req_id=1, limit=10_000, cursor=cursor))
        reply = only(h.take(alice), Plans)
        assert len(reply.plans) <= PAGE_ROWS and reply.total == 1_200
        seen += [p.id for p in reply.plans]
        if not reply.next_cursor:
            break
        assert len(reply.plans) == PAGE_ROWS
        cursor = reply.next_cursor
    assert seen == ids[::-1]
    by_priority = [pid for _, _, pid in sorted((-(n % 3), n, pid) for n, pid in enumerate(ids))]  # priority, age
    assert reply.queue == by_priority[: len(reply.queue)]


def test_the_default_byte_budget_refuses_512_kib_args_past_64_mib() -> None:
    """Default limits: a principal queueing 512 KiB-args plans is refused too_many_plans at 64 MiB held."""
    h = Harness()
    alice = h.client()
    args = "x" * (512 << 10)
    for n in range(1, 200):
        h.send(alice, Submit(req_id=n, op="echo", args=args))
        errors = [m for m in h.take(alice) if isinstance(m, Error)]
        if errors:
            break
    [reply] = errors
    assert reply.code and reply.code == "too_many_plans" and "--max-bytes-per-client" in reply.message
    assert n <= 128 and h.core.quota.held_bytes("alice") <= 64 << 20


def test_waiting_reason_names_a_few_tags_not_all() -> None:
    """A plan with 64 long tags waits with a reason of a few hundred bytes, not the whole tag list."""
    h = Harness()
    h.worker("w1")
    alice = h.client()
    plan_id = h.submit(alice, requirements=Requirements(tags=BIG_TAGS))
    reason = h.core.plans[plan_id].waiting_reason
    assert reason is not None and "and 60 more" in reason and len(reason) < 1024


@pytest.mark.parametrize(
    ("role", "open_sessions", "held", "refused"),
    [
        ("client", 10, 24, None),
        ("client", 10, 25, "its share"),  # a quarter of 100
        ("worker", 10, 80, None),  # workers share a fleet token: no per-principal share
        ("client", 90, 0, "kept for workers"),  # the last tenth
        ("worker", 95, 0, None),
        ("worker", 100, 0, "limit of 100"),
    ],
)
def test_connection_shares_and_the_workers_reserve(
    role: str, open_sessions: int, held: int, refused: str | None
) -> None:
    """One client principal gets at most a quarter of the connections; workers keep the last tenth."""
    problem = Limits(max_connections=100).connection_refusal(role, "alice", open_sessions, held)  # type: ignore[arg-type]
    if refused is None:
        assert problem is None
    else:
        assert problem is not None and refused in problem


def test_a_principals_sessions_share_one_cost_bucket_and_the_table_is_bounded() -> None:
    """Two lookups of one principal give the same bucket; another principal its own; none when the limit is off;
    past the bound every bucket is forgotten and starts full again."""
    buckets = CostBuckets(Limits(cost_rate=10.0, cost_burst=20), max_principals=2)
    a = buckets.get("a", 0.0)
    assert a is not None and buckets.get("a", 1.0) is a and buckets.get("b", 1.0) is not a
    buckets.get("c", 1.0)
    buckets.get("d", 1.0)  # three held: over the bound, the table starts again
    assert buckets.get("a", 2.0) is not a
    assert CostBuckets(Limits(cost_rate=0.0)).get("a", 0.0) is None
