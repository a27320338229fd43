"""A core's own ticket key is published before it signs (coordinator/data_plane.py): after a rotation the ``data_keys``
that tells a holder of the new key goes on the holder's connection, while a consumer placed at once fetches from the
holder's data endpoint on the strength of its assign's pull ticket; nothing orders the two, and a holder whose session
closed hears of the key only in its next ``welcome``. So the consumer's ticket must verify with the keys the holder
had before the rotation, until the new key is published (:func:`publish_s` later)."""

from __future__ import annotations

from coordinator.data_plane import publish_s
from coordinator.graphs.lineage import Source
from protocol.messages import DataKeys, Requirements
from protocol.tickets import verify
from tests.unit.test_core import Harness
from tests.unit.test_graph_core import assign_of, finish, ref


def holder_and_consumer(h: Harness) -> tuple[int, int, int, str]:
    """w1 holds plan a's output y; w2 (tag big) is where a consumer of it must go. Keys: k1 since 0."""
    holder = h.worker("w1")
    other = h.worker("w2", tags=["big"])
    h.core.data.rotate("k1", b"s" * 32, h.now)
    for conn in (holder, other):
        h.take(conn)
    client = h.client()
    a = h.submit(client, plan_id="a", outputs=["y"])
    finish(h, holder, a, outputs={"y": 10})
    h.take(other)
    return holder, other, client, a


def known_to(h: Harness, worker_id: str) -> dict[str, bytes]:
    return {key.kid: key.key for key in h.core.data.worker_keys(worker_id)}


def pull_verifies(ticket: str, keys: dict[str, bytes], wall: float) -> None:
    verify(ticket, keys, wall=wall, worker="w1", plan="a", attempt=1, direction="get", name="y")


def test_a_consumer_placed_right_after_a_rotation_gets_a_ticket_its_holder_already_verifies() -> None:
    """The rotation's data_keys to the holder is queued, not yet read: the consumer's pull ticket, and the
    data_ready tickets of a plan placed then, are signed with the key before (which the holder has); the new key
    signs from publish_s on. Without the publish delay the ticket was signed with k2, unknown to the holder."""
    h = Harness()
    holder, other, client, _ = holder_and_consumer(h)
    before = known_to(h, "w1")  # what the holder verifies with until it reads the next frame
    h.now = 10.0
    h.core.data.rotate("k2", b"n" * 32, h.now)
    h.submit(client, plan_id="b", inputs=[ref("a")], requirements=Requirements(tags=["big"]))
    [pull] = assign_of(h, other).pulls
    assert pull.ticket.startswith("fw1.k1.")
    pull_verifies(pull.ticket, before, h.now)
    told = [m for m in h.take(holder) if isinstance(m, DataKeys)]
    assert [key.kid for key in told[-1].keys] == ["k2", "k1"]  # accepted at once: the workers are told
    source = Source("a", 1, "w1", "y", 10, "")
    wait = publish_s(h.core.registry.reconnect_grace_s)
    assert h.core.data.pull_ticket(source, h.now + wait - 0.01).startswith("fw1.k1.")
    assert h.core.data.pull_ticket(source, h.now + wait).startswith("fw1.k2.")


def test_a_holder_in_its_reconnect_grace_is_not_handed_tickets_of_a_key_it_was_never_told() -> None:
    """The holder's session closed (its process and data endpoint still up); a rotation tells only connected
    workers. Until the grace is over (it registers again and its welcome has the key, or it is reaped), pulls from
    it are signed with a key it has."""
    h = Harness(worker_reconnect_grace_s=5.0)
    holder, *_ = holder_and_consumer(h)
    before = known_to(h, "w1")
    h.now = 10.0
    h.close(holder)
    h.core.data.rotate("k2", b"n" * 32, h.now)
    h.now = 14.9  # within the grace
    source = Source("a", 1, "w1", "y", 10, "")
    ticket = h.core.data.pull_ticket(source, h.now)
    pull_verifies(ticket, before, h.now)
    assert ticket.startswith("fw1.k1.")


def test_a_first_key_signs_at_once() -> None:
    """Nothing older to sign with: a core's first key signs from its making (as a cluster's first shared key)."""
    h = Harness()
    h.core.data.rotate("k1", b"s" * 32, h.now)
    assert h.core.data.pull_ticket(Source("a", 1, "w1", "y", 10, ""), h.now).startswith("fw1.k1.")
