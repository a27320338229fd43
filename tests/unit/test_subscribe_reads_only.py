"""Subscribing never changes a plan (issue #25 part 1; docs/SEMANTICS.md §Recovery from clients and workers).

A ``subscribe`` only reads: whatever its ``from_seq`` (0, past the end, 2**53, the dashboard's
``Number.MAX_SAFE_INTEGER``, negative, 2**64-1), whoever sends it (the owner, another principal, an
admin), with plan ids or ``all``, no plan's numbering, held events or records change, and the next
event of a plan gets the seq it would have had. Driven through the pure core with a fake clock.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.plans import Plan
from protocol import Codec
from protocol.messages import Accept, Assign, Cancel, Event, FromClient, Resync, Subscribe, Subscribed
from tests.unit.test_core import only
from tests.unit.test_durability_core import Durable

MAX_SAFE_INTEGER = 2**53 - 1  # the dashboard's NO_REPLAY (coordinator/io/dashboard/app.js)


def _fleet() -> tuple[Durable, dict[str, int], dict[str, str]]:
    """Plans in every kind of state: alice's queued, running (with ephemeral tokens) and ended; bob's ended."""
    h = Durable()
    w = h.worker("w1")
    alice, bob = h.client("alice"), h.client("bob")
    ids = {"running": h.submit(alice, plan_id="run")}
    assign = only(h.take(w), Assign)
    h.send(w, Accept(plan_id="run", attempt=assign.attempt, seq=1))
    for n in range(3):
        h.send(w, Event(plan_id="run", attempt=assign.attempt, kind="token", data={"text": "x"}, ephemeral=True,
                        seq=2 + n))  # fmt: skip
    ids["ended"] = h.submit(alice, plan_id="done-a", op="nope")
    h.send(alice, _cancel("done-a"))
    ids["bob"] = h.submit(bob, plan_id="done-b", op="nope")
    h.send(bob, _cancel("done-b"))
    ids["queued"] = h.submit(alice, plan_id="wait", op="nope")  # no worker has op nope: stays queued
    admin = next(h._conns)
    h.core.open_session(admin, "client", h.now, principal="root", admin=True)
    return h, {"alice": alice, "bob": bob, "admin": admin, "worker": w}, ids


def _cancel(plan_id: str) -> Cancel:
    return Cancel(req_id=99, plan_id=plan_id)


def _snapshot(plans: dict[str, Plan]) -> dict[str, Any]:
    return {pid: (p.next_seq, p.seq_recorded, p.state, [(e.seq, e.kind) for e in p.events]) for pid, p in plans.items()}


from_seqs = st.one_of(
    st.sampled_from([0, 1, 3, 5, 99, MAX_SAFE_INTEGER, 2**53, 2**53 + 1, 2**63 - 1, -1]),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
)


subscribes = st.lists(
    st.tuples(
        st.sampled_from(["alice", "bob", "admin"]),
        st.sampled_from([(), ("run",), ("done-a",), ("wait", "run"), ("done-b",)]),
        st.booleans(),
        from_seqs,
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(subscribes=subscribes)
def test_no_subscribe_changes_any_plan_whatever_its_from_seq(
    subscribes: list[tuple[str, tuple[str, ...], bool, int]],
) -> None:
    """Any sequence of subscribes, by any session, named or all, from any from_seq: every plan's next seq,
    held events and state stay as they were, nothing is journaled, and the next event gets the next seq."""
    h, conns, _ = _fleet()
    before, records = _snapshot(h.core.plans), len(h.records)
    for who, plan_ids, every, from_seq in subscribes:
        h.send(conns[who], Subscribe(req_id=1, plan_ids=list(plan_ids), all=every, from_seq=from_seq))
        h.core.pump(10**6)  # a sliced replay sends the rest (the driver pumps it)
        h._pump()
    assert _snapshot(h.core.plans) == before and len(h.records) == records
    run = h.core.plans["run"]
    h.send(conns["worker"], Event(plan_id="run", attempt=run.attempt, kind="log", data="after", seq=9))
    assert run.events[-1].seq == before["run"][0]


def test_the_dashboards_exact_subscribe_leaves_every_plans_last_seq_untouched() -> None:
    """The dashboard's frame, as its JSON text, from an admin session: every plan's ``last_seq`` (get_plan,
    listings) stays, no event or resync is replayed, and the next event is numbered on from it."""
    h, conns, ids = _fleet()
    last = {pid: p.info().last_seq for pid, p in h.core.plans.items()}
    frame = json.dumps({"type": "subscribe", "all": True, "from_seq": MAX_SAFE_INTEGER, "req_id": 1})
    (msg,) = Codec("json", FromClient, role="client").decode(frame)
    h.send(conns["admin"], msg)
    replies = h.take(conns["admin"])
    assert set(only(replies, Subscribed).plan_ids) == set(ids.values())
    assert not [m for m in replies if isinstance(m, Event | Resync)]
    assert {pid: p.info().last_seq for pid, p in h.core.plans.items()} == last
    assert all(last_seq < 2**20 for last_seq in last.values())
