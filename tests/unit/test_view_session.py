"""A view session's decisions driven directly (coordinator/views.py): rows in, messages out, no PostgreSQL."""

from __future__ import annotations

import pytest

from coordinator.auth import Principal
from coordinator.plans import Plan
from coordinator.views import ALL_PER_RING, MAX_ALL, MAX_WATCHED, Listing, ViewSession, Watched
from protocol import errors as codes
from protocol.messages import (
    Accepted,
    Capabilities,
    Error,
    Event,
    GetPlan,
    ListPlans,
    ListWorkers,
    PlanReply,
    Resync,
    Submit,
    Subscribe,
    Unsubscribe,
    WorkerInfo,
)

ALICE = Principal("alice", "client")
ADMIN = Principal("root", "admin")


def plan(key: str, owner: str = "alice", *, op: str = "echo", seqs: tuple[int, ...] = (), state: str = "running",
         next_seq: int = 0) -> Plan:  # fmt: skip
    made = Plan.from_submit(Submit(req_id=1, op=op, plan_id=key), key, owner, 1)
    made.events = [Event(plan_id=key, kind="progress", seq=seq) for seq in seqs]
    made.state = state  # type: ignore[assignment]
    made.next_seq = next_seq or (seqs[-1] + 1 if seqs else 1)
    return made


def test_a_client_gets_only_its_own_plan_and_another_principals_answers_as_unused() -> None:
    """get_plan: the newest visible plan found; one of another principal is plan_not_found, as an unused id."""
    view = ViewSession(ALICE)
    reply = view.plan_reply(GetPlan(req_id=3, plan_id="p"), [plan("p"), plan("p", op="newer")])
    assert isinstance(reply, PlanReply) and reply.req_id == 3 and reply.plan.op == "newer"
    refused = view.plan_reply(GetPlan(req_id=4, plan_id="q"), [plan("q", owner="bob")])
    assert refused == view.not_found("q", 4) and isinstance(refused, Error)
    assert refused.code == codes.PLAN_NOT_FOUND and "no plan with id 'q' in any shard" in refused.message
    assert isinstance(ViewSession(ADMIN).plan_reply(GetPlan(req_id=5, plan_id="q"), [plan("q", owner="bob")]),
                      PlanReply)  # fmt: skip


def test_a_listing_is_checked_as_a_cores_and_a_client_lists_only_its_own() -> None:
    """A bad limit is invalid_argument, another owner forbidden for a client; an admin's owner filter counted apart."""
    client, admin = ViewSession(ALICE), ViewSession(ADMIN)
    bad = client.listing(ListPlans(req_id=1, limit=0))
    assert isinstance(bad, Error) and bad.code == codes.INVALID_ARGUMENT and "limit must be" in bad.message
    other = client.listing(ListPlans(req_id=2, owner="bob"))
    assert isinstance(other, Error) and other.code == codes.FORBIDDEN and "only its own plans" in other.message
    own = client.listing(ListPlans(req_id=3, limit=5, states=["queued"]))
    assert own == Listing(["queued"], 6, "alice", None, "", "", False, False)
    by_owner = admin.listing(ListPlans(req_id=4, owner="bob", cursor="17"))
    assert isinstance(by_owner, Listing) and by_owner.owner == "bob" and by_owner.before == 17
    assert by_owner.admin and by_owner.counted_apart


def test_a_page_takes_the_limit_and_names_the_next_cursor_and_charges_its_rows() -> None:
    """Rows past the limit give next_cursor (the last key listed); the rows scanned, read and built are charged."""
    view = ViewSession(ALICE)
    msg = ListPlans(req_id=1, limit=2)
    listing = view.listing(msg)
    assert isinstance(listing, Listing)
    rows = [(30, plan("c")), (20, plan("b")), (10, plan("a"))]
    page = view.plans_page(msg, listing, rows, {"running": 3, "queued": 1}, scanned=4, matching=0)
    assert [p.id for p in page.plans] == ["c", "b"] and page.next_cursor == "20" and page.total == 4
    assert view.take_work() == 4 + 3 + 4 * 2 and view.take_work() == 0


def test_an_op_filter_skips_rows_whose_args_merely_held_its_marker() -> None:
    """A row read for the op's marker but of another op is not listed; the total is the filtered count."""
    view = ViewSession(ALICE)
    msg = ListPlans(req_id=1, limit=5, op="echo")
    listing = view.listing(msg)
    assert isinstance(listing, Listing) and listing.counted_apart
    page = view.plans_page(msg, listing, [(2, plan("b", op="sleep")), (1, plan("a"))], {}, scanned=0, matching=1)
    assert [p.id for p in page.plans] == ["a"] and page.total == 1 and page.next_cursor == ""


def test_workers_are_listed_in_shard_order_and_a_drain_finds_the_workers_shard() -> None:
    """list_workers merges the registries by shard; a worker in none of them is unknown_worker."""
    view = ViewSession(ADMIN)
    registries = {1: [WorkerInfo("w2", Capabilities(cpu_cores=2), alive=True)],
                  0: [WorkerInfo("w1", Capabilities(cpu_cores=4), alive=True)]}  # fmt: skip
    reply = view.workers_reply(ListWorkers(req_id=1), registries, "1.2")
    assert [w.id for w in reply.workers] == ["w1", "w2"] and reply.summary.startswith("2 workers (6 CPUs")
    assert view.take_work() == 2 + 2
    assert view.worker_shard("w2", 7, registries) == 1
    missing = view.worker_shard("w9", 8, registries)
    assert isinstance(missing, Error) and missing.code == codes.UNKNOWN_WORKER and missing.req_id == 8


def test_a_subscribe_with_an_unseen_id_subscribes_nothing() -> None:
    """One id the session cannot see (absent, or another principal's) and the subscribe is plan_not_found."""
    view = ViewSession(ALICE)
    refused = view.subscribe(Subscribe(req_id=1, plan_ids=["a", "b"]), [(0, "alice", 10), (1, "bob", 11)])
    assert isinstance(refused, Error) and refused.plan_id == "b" and view.watched == {}
    fresh = view.subscribe(Subscribe(req_id=2, plan_ids=["a"], from_seq=3), [(0, "alice", 10)])
    assert fresh == [Watched(10, "a", 0, 4)]
    assert view.watch(fresh, shards=4) == {0} and view.following and view.take_work() == 3


def test_a_session_follows_at_most_max_watched_plans_by_id() -> None:
    """Past MAX_WATCHED plans by id the subscribe is refused naming the limit."""
    view = ViewSession(ADMIN)
    view.watch([Watched(k, f"p{k}", 0, 1) for k in range(MAX_WATCHED)], shards=1)
    refused = view.subscribe(Subscribe(req_id=1, plan_ids=["x"]), [(0, "root", MAX_WATCHED)])
    assert isinstance(refused, Error) and f"at most {MAX_WATCHED} plans" in refused.message


def test_a_subscribe_to_all_follows_new_plans_named_as_the_session_knows_them() -> None:
    """Discovered plans: a client's by the id it submitted, others' left out; past MAX_ALL skipped and counted."""
    view = ViewSession(ALICE)
    assert view.wants_tips(Subscribe(req_id=1, all=True))
    view.follow_all({0: 5, 1: -1})
    assert view.watch([], shards=2) == {0, 1} and not view.wants_tips(Subscribe(req_id=2, all=True))
    rows = [(6, "k6", 0, "alice", "mine"), (7, "k7", 0, "bob", None), (0, "k0", 1, "alice", None)]
    more, skipped = view.discover(rows)
    assert (more, skipped) == (False, 0) and view.tips == {0: 7, 1: 0}
    assert {k: w.plan_id for k, w in view.watched.items()} == {6: "mine", 0: "k0"}
    view.from_all.update(range(100, 100 + MAX_ALL))
    more, skipped = view.discover([(100 + MAX_ALL + n, f"n{n}", 1, "alice", None) for n in range(ALL_PER_RING)])
    assert more and skipped == ALL_PER_RING


def test_caught_up_sends_new_events_with_resyncs_and_stops_following_what_ended() -> None:
    """Events from the next seq, a resync for a gap; an ended plan sent whole and a vanished one of all are dropped."""
    view = ViewSession(ADMIN)
    view.watch([Watched(1, "a", 0, 1), Watched(2, "b", 0, 1), Watched(3, "c", 0, 1)], shards=1)
    view.from_all.add(3)
    out = view.caught_up({1: plan("a", seqs=(1, 3)), 2: plan("b", seqs=(1,), state="succeeded", next_seq=2)})
    assert [(type(m).__name__, m.plan_id) for m in out] == [
        ("Event", "a"), ("Resync", "a"), ("Event", "a"), ("Event", "b")]  # fmt: skip
    assert isinstance(out[1], Resync) and (out[1].first_seq, out[1].last_seq) == (2, 2)
    assert sorted(view.watched) == [1] and view.from_all == set()
    assert view.caught_up({1: plan("a", seqs=(1, 3))}) == []  # read again: nothing new


def test_unsubscribe_all_stops_everything_and_a_browser_submit_is_followed_when_accepted() -> None:
    """unsubscribe all clears the followed plans and the subscribe to all; an accepted browser submit is watched."""
    view = ViewSession(ALICE, browser=True)
    view.follow_all({0: 1})
    view.watch([Watched(1, "a", 0, 1)], shards=1)
    assert view.unsubscribe(Unsubscribe(req_id=9, all=True)).req_id == 9
    assert not view.following and view.tips is None
    assert view.accepted(Accepted(req_id=1, plan_id="p"), (2, "alice", 40)) == [Watched(40, "p", 2, 1)]
    assert view.accepted(Error(code="x", message="y"), (2, "alice", 40)) == []


@pytest.mark.parametrize(("principal", "owner"), [(ALICE, "alice"), (ADMIN, None)])
def test_a_client_sees_its_own_plans_and_an_admin_everyones(principal: Principal, owner: str | None) -> None:
    """owner: the principal's name for a client, None (everyone) for an admin."""
    view = ViewSession(principal)
    assert view.owner == owner and view.visible("alice") and view.visible("bob") is (owner is None)
