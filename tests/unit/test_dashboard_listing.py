"""What the dashboard asks of ``list_plans`` (coordinator/operator_requests.py): filters, pages, the queue's reasons.

The core with a fake clock: a page narrowed by op, owner and a part of the id (and their total),
paged by cursor without repeats, a client refused another principal's plans, and the queue sent
with why each plan in it waits.
"""

from __future__ import annotations

from typing import Any

from protocol import errors
from protocol.messages import Error, ListPlans, Plans
from tests.unit.test_core import Harness, only
from tests.unit.test_operator import admin


def listing(h: Harness, conn: int, **kw: Any) -> Plans:
    h.send(conn, ListPlans(req_id=5, **kw))
    return only(h.take(conn), Plans)


def refused(h: Harness, conn: int, **kw: Any) -> Error:
    h.send(conn, ListPlans(req_id=6, **kw))
    return only(h.take(conn), Error)


def test_op_owner_and_id_filters_narrow_rows_and_total_but_not_counts() -> None:
    """op, owner and id_contains keep only matching rows and count them in total; counts stay everyone's."""
    h = Harness()
    alice, bob = h.client("alice"), h.client("bob")
    a_train = [h.submit(alice, op="train", plan_id=f"a-train-{i}") for i in range(3)]
    h.submit(alice, op="eval", plan_id="a-eval-0")
    b_train = h.submit(bob, op="train", plan_id="b-train-0")
    root = admin(h)
    reply = listing(h, root, op="train")
    assert [p.id for p in reply.plans] == [b_train, *a_train[::-1]] and reply.total == 4
    assert reply.counts == {"queued": 5}  # the header's counts: every visible plan
    reply = listing(h, root, op="train", owner="bob")
    assert [p.id for p in reply.plans] == [b_train] and reply.total == 1
    reply = listing(h, root, id_contains="train-2")
    assert [p.id for p in reply.plans] == ["a-train-2"] and reply.total == 1
    assert listing(h, root, id_contains="TRAIN").plans == []  # case-sensitive
    # A client's narrowed listing counts its own matching plans (a walk: its tally cannot say).
    reply = listing(h, alice, op="train", limit=2)
    assert [p.id for p in reply.plans] == a_train[:0:-1] and reply.total == 3 and reply.next_cursor
    reply = listing(h, alice, owner="alice", states=["queued"], id_contains="eval")
    assert [p.id for p in reply.plans] == ["a-eval-0"] and reply.total == 1


def test_pages_of_a_filtered_listing_follow_each_other_without_repeats() -> None:
    """Paging a filtered listing by next_cursor visits every matching plan once, newest first."""
    h = Harness()
    c = h.client()
    wanted = []
    for i in range(23):
        wanted.append(h.submit(c, op="train", plan_id=f"t{i}"))
        h.submit(c, op="eval", plan_id=f"e{i}")
    seen: list[str] = []
    cursor = ""
    while True:
        reply = listing(h, c, op="train", limit=5, cursor=cursor)
        assert reply.total == 23 and len(reply.plans) <= 5
        seen += [p.id for p in reply.plans]
        cursor = reply.next_cursor
        if not cursor:
            break
    assert seen == wanted[::-1]


def test_a_client_naming_another_owner_is_refused_and_long_filters_are_invalid() -> None:
    """A client token naming another principal gets forbidden; a filter over 256 characters, invalid_argument."""
    h = Harness()
    alice = h.client("alice")
    h.submit(alice, op="train")
    error = refused(h, alice, owner="bob")
    assert error.code == errors.FORBIDDEN and "only its own plans" in error.message and error.req_id == 6
    error = refused(h, alice, op="x" * 257)
    assert error.code == errors.INVALID_ARGUMENT and "op is 257 characters" in error.message


def test_the_queue_comes_with_each_plans_waiting_reason() -> None:
    """Every plan id in queue has its waiting reason in waiting, including plans past the listed page."""
    h = Harness()
    c = h.client()
    ids = [h.submit(c, op="train") for _ in range(3)]
    reply = listing(h, c, limit=3, states=["succeeded"])  # no rows listed: the queue alone says why
    assert reply.plans == [] and reply.queue == ids
    assert reply.waiting == {i: "no connected worker handles op 'train'" for i in ids}
