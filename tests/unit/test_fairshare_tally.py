"""Fair share's tallied leases (coordinator/placement/fairshare.py): one-slot leases counted late, as if at once."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.placement.fair_queue import FairQueue
from coordinator.placement.fairshare import SLOT, Account, Capacity, Demand, ShareBook
from coordinator.placement.plan_queue import Signature
from coordinator.teams import Member, Team, TeamBook
from protocol.messages import Requirements

PRINCIPALS = ("p0", "p1", "p2", "p3")
GPU = Demand(1.0, 1.0, 0.0)


def book_of(moved: bool = False) -> TeamBook:
    """p0 and p1 in team a (weights 1 and 2), p2 in team b of weight 3, p3 alone; ``moved``: p1 in b."""
    return TeamBook([Team("a", weight=1.0), Team("b", weight=3.0)],
                    {"p0": Member("a"), "p1": Member("b" if moved else "a", 2.0), "p2": Member("b")})


def close(x: float, y: float) -> bool:
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-9)


def same(a: Account, b: Account, now: float) -> bool:
    """Whether two accounts say the same (counts exactly, figures to rounding)."""
    return (a.running, a.waiting, a.active, a.slots, a.gpus) == (b.running, b.waiting, b.active, b.slots, b.gpus) \
        and close(a.service_at(now), b.service_at(now)) and close(a.rate, b.rate) \
        and all(close(x, y) for x, y in zip(a.key, b.key, strict=True))


def test_a_lone_principals_slot_leases_are_tallied_until_an_account_is_read() -> None:
    """SLOT leases of an active principal are tallied, not counted; reading its account counts them."""
    book = ShareBook(capacity=Capacity(0.0, 4.0, 0.0))
    book.queued("solo", 1)
    book.started("solo", SLOT, 1.0)
    book.started("solo", SLOT, 2.0)
    book.ended("solo", SLOT, 3.0)
    account = book.principal_accounts["solo"]
    assert (account.running, account.pending_n, account.pending) == (0, 1, True)
    assert book.principal_account("solo").running == 1  # read through the book: counted
    assert account.pending_n == 0 and book.team_account("solo").running == 1
    # From 1 s to 2 s one slot of 4, from 2 s to 3 s two, then one: 0.25 + 0.5 service by 3 s.
    assert math.isclose(account.service_at(3.0), 0.75) and math.isclose(account.rate, 0.25)


def test_a_heap_of_the_fair_queue_has_leases_counted_at_once() -> None:
    """Once two principals wait in one group (a heap of keys), a SLOT lease's end moves their keys at once."""
    queue = FairQueue(capacity=Capacity(0.0, 4.0, 0.0))
    signature = Signature.of("work", Requirements())
    for order in (1, 2, 3):
        queue.push(f"a{order}", signature, 0, order, "alice")
    for order in (1, 2):
        queue.discard(f"a{order}")
        queue.started("alice", SLOT, 1.0)  # alice still waits (a3): active and alone, her leases are tallied
    assert queue.shares.principal_accounts["alice"].pending
    queue.push("b1", signature, 0, 4, "bob")  # two teams in one group: it keeps a heap of their keys
    assert not queue.shares.principal_accounts["alice"].pending
    queue.discard("b1")
    queue.started("bob", SLOT, 2.0)
    queue.push("b2", signature, 0, 5, "bob")
    assert queue.best_for(lambda sig: True) == "b2"  # bob holds one slot, alice two
    queue.ended("alice", SLOT, 3.0)
    queue.ended("alice", SLOT, 3.0)  # alice holds none now: her key falls below bob's, and her plan heads the group
    assert queue.best_for(lambda sig: True) == "a3"


def test_heads_of_groups_of_one_team_each_compare_keys_with_tallied_leases_counted() -> None:
    """Two teams waiting in two groups (no heap): the heads are ordered by keys that count the tallied leases."""
    queue = FairQueue(capacity=Capacity(0.0, 4.0, 0.0))
    mine, theirs = (Signature.of("work", Requirements(tags=[tag])) for tag in ("x", "y"))
    for owner, signature, count in (("alice", mine, 3), ("bob", theirs, 2)):
        for order in range(count):
            queue.push(f"{owner}{order}", signature, 0, order, owner)
        for order in range(count - 1):
            queue.discard(f"{owner}{order}")
            queue.started(owner, SLOT, 1.0)  # the owner is active (it waits): tallied
    assert queue.best_for(lambda sig: True) == "bob1"  # alice holds two slots, bob one
    queue.ended("alice", SLOT, 2.0)
    queue.ended("alice", SLOT, 2.0)
    assert queue.best_for(lambda sig: True) == "alice2"


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(
    st.sampled_from(["start", "start", "start", "end", "end", "end", "gpu", "queue", "tick", "capacity", "keyed",
                     "read", "teams"]),
    st.integers(0, 3), st.integers(0, 4)), max_size=80))
def test_tallied_leases_leave_every_account_as_one_step_per_lease_does(ops: list[tuple[str, int, int]]) -> None:
    """Whatever the order of starts, ends, GPU leases, queueing, ticks, capacity, heaps and reloads: the accounts
    of a book that tallies SLOT leases read as those of a book that counts each at once."""
    late, eager = ShareBook(book_of(), Capacity(2.0, 4.0, 0.0)), ShareBook(book_of(), Capacity(2.0, 4.0, 0.0))
    copy = Demand(*SLOT)  # equal to SLOT, not it: always counted at once
    held: dict[str, list[Demand]] = {p: [] for p in PRINCIPALS}
    queued = dict.fromkeys(PRINCIPALS, 0)
    now, moved, keyed = 0.0, False, False
    for op, who, step in ops:
        now += step * 0.25
        principal = PRINCIPALS[who]
        if op in ("start", "gpu"):
            demand = GPU if op == "gpu" else SLOT
            held[principal].append(demand)
            late.started(principal, demand, now)
            eager.started(principal, copy if demand is SLOT else demand, now)
        elif op == "end" and held[principal]:
            demand = held[principal].pop(step % len(held[principal]))
            late.ended(principal, demand, now)
            eager.ended(principal, copy if demand is SLOT else demand, now)
        elif op == "queue":
            delta = -1 if queued[principal] else 1
            queued[principal] += delta
            late.queued(principal, delta)
            eager.queued(principal, delta)
        elif op == "tick":
            late.advance(now)
            eager.advance(now)
        elif op == "capacity":
            capacity = Capacity(2.0, 4.0 + step, 0.0)
            late.set_capacity(capacity, now)
            eager.set_capacity(capacity, now)
        elif op == "keyed":
            keyed = not keyed
            late.keyed(keyed)
        elif op == "teams":
            moved = not moved
            carried = {p: (list(held[p]), queued[p]) for p in PRINCIPALS}
            late.set_teams(book_of(moved), carried, now)
            eager.set_teams(book_of(moved), {p: ([copy if d is SLOT else d for d in ds], n)
                                             for p, (ds, n) in carried.items()}, now)
        elif op == "read":
            for name, account in eager.principals():
                assert same(late.principal_account(name), account, now), name
    late_teams, late_principals = dict(late.teams()), dict(late.principals())
    assert late_teams.keys() == dict(eager.teams()).keys() and late_principals.keys() == dict(eager.principals()).keys()
    for name, account in eager.teams():
        assert same(late_teams[name], account, now), name
    for name, account in eager.principals():
        assert same(late_principals[name], account, now), name
