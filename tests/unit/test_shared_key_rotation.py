"""A shard's core told a rotation of the cluster's shared key (``DataPlane.set_shared``, the cluster host every round,
coordinator/io/cluster/shared_keys.py): its connected workers get ``data_keys`` with the new key and the previous one,
pulls are signed with the new one, and a key dropped after the overlap leaves the workers' keys."""

from __future__ import annotations

from itertools import pairwise

from coordinator.data_plane import MAX_KEPT_KEYS, PUBLISH_MARGIN_S, key_rotation_problem
from coordinator.graphs.lineage import Source
from coordinator.io.cluster.shared_keys import SharedKey, accepted, key_times, overlap_s
from coordinator.placement.placer import PlacementConfig
from coordinator.shards import ClusterConfig
from protocol.messages import DataKeys, Welcome
from protocol.tickets import verify
from tests.unit.test_core import Harness
from tests.unit.test_graph_core import fleet

OLD = ("c-old", b"o" * 32)
NEW = ("c-new", b"n" * 32)


def test_workers_learn_each_change_of_the_shared_keys_once_and_pulls_sign_with_the_newest() -> None:
    h = Harness(placement=PlacementConfig(cluster=True))
    h.core.data.set_shared([OLD])
    h.core.data.rotate("k1", b"s" * 32, h.now)
    conns = fleet(h, "w1")
    h.take(conns["w1"])
    source = Source("p", 1, "w1", "y", 1, "")
    assert h.core.data.pull_ticket(source, h.now, shared=True).startswith("fw1.c-old.")

    def sent() -> list[list[str]]:
        h._pump()  # the core's effects, as the driver's flush takes them
        return [[key.kid for key in m.keys] for m in h.take(conns["w1"]) if isinstance(m, DataKeys)]

    h.core.data.set_shared([NEW, OLD])  # a rotation: the previous one stays for the tickets it signed
    assert sent() == [["k1", "c-new", "c-old"]]
    assert h.core.data.pull_ticket(source, h.now, shared=True).startswith("fw1.c-new.")
    h.core.data.set_shared([NEW, OLD])  # the same keys read again: nothing sent
    assert sent() == []
    h.core.data.set_shared([NEW])  # past the overlap
    assert sent() == [["k1", "c-new"]]
    assert [key.kid for key in h.core.data.worker_keys("w1")] == ["k1", "c-new"]


def test_the_shared_keys_kept_are_capped_newest_first() -> None:
    """However many keys the row names within their overlap, a core accepts (and sends its workers) at most
    MAX_KEPT_KEYS, the newest."""
    keys = [SharedKey(f"c{i}", "ab" * 32, 1000.0 - i, "") for i in range(3 * MAX_KEPT_KEYS)]  # newest first
    kept = accepted(keys, None, 1000.0, keep_s=10_000.0)
    assert [kid for kid, _ in kept] == [f"c{i}" for i in range(MAX_KEPT_KEYS)]


def test_a_new_shared_key_is_accepted_at_once_and_signs_only_once_published() -> None:
    """``accepted`` with ``publish_s``: a key made less than ``publish_s`` ago is handed to the workers but the one
    before it signs (it comes first); from ``publish_s`` on the new one signs; the previous one stays accepted until
    ``publish_s + keep_s`` after the new one's making. A cluster's first key (nothing older) signs at once."""
    old, new = SharedKey("c-old", "aa" * 32, 0.0, ""), SharedKey("c-new", "bb" * 32, 100.0, "")

    def kids(wall: float) -> list[str]:
        return [kid for kid, _ in accepted([new, old], None, wall, keep_s=50.0, publish_s=4.0)]

    assert kids(100.0) == kids(103.9) == ["c-old", "c-new"]
    assert kids(104.0) == kids(153.9) == ["c-new", "c-old"]
    assert kids(154.0) == ["c-new"]
    assert [kid for kid, _ in accepted([new], None, 100.0, keep_s=50.0, publish_s=4.0)] == ["c-new"]
    assert [kid for kid, _ in accepted([new, old], None, 100.0, keep_s=50.0)] == ["c-new", "c-old"]  # publish_s 0


def test_at_the_shortest_rotation_the_start_allows_the_cap_never_drops_a_shared_key_a_live_ticket_needs() -> None:
    """The cluster host keeps a shared key ``publish_s + keep_s`` (the TTL plus :func:`overlap_s`) after the next
    one's making. The start check counts that overlap: at the shortest rotation it allows, every key within it is
    still among the MAX_KEPT_KEYS kept at every moment. At TTL / 7 (the check before the overlap was counted) one
    needed key was past the cap, and that rotation is now refused, naming the numbers."""
    ttl, lease_ttl, scan, grace = 700.0, 3.0, 0.5, 5.0
    times = key_times(ticket_ttl_s=ttl, lease_ttl_s=lease_ttl, scan_s=scan, reconnect_grace_s=grace)  # host.py's
    publish, keep = times.publish_s, times.keep_s
    assert (publish, keep) == (2 * scan + lease_ttl + grace + PUBLISH_MARGIN_S, ttl + 2 * scan + lease_ttl)
    overlap = overlap_s(lease_ttl, scan, grace)
    assert overlap == publish + keep - ttl == 14.0

    def dropped_early(rotation_s: float) -> list[float]:
        made = [index * rotation_s for index in range(40)]
        found = []
        for step in range(int(made[-1] * 2)):  # every half second
            wall = step / 2
            keys = [SharedKey(f"c{at:g}", "ab" * 32, at, "") for at in reversed(made) if at <= wall]
            needed = keys[:1] + [key for newer, key in pairwise(keys) if wall < newer.made_at + publish + keep]
            if len(accepted(keys, None, wall, keep, publish)) < len(needed):
                found.append(wall)
        return found

    shortest = (ttl + overlap) / (MAX_KEPT_KEYS - 1)
    assert key_rotation_problem(ttl, shortest, overlap) is None
    assert dropped_early(shortest) == []
    assert dropped_early(ttl / (MAX_KEPT_KEYS - 1))  # what the check let through before
    problem = key_rotation_problem(ttl, ttl / (MAX_KEPT_KEYS - 1), overlap)
    assert problem == (
        "--data-key-rotation 100 is too short for --data-ticket-ttl 700: a key stays accepted as long as the tickets "
        "it signed (the TTL, plus 14 s while the next one is published and overlaps), and at most 8 keys are kept; "
        "give a rotation of at least 102 s ((TTL + 14) / 7) or a shorter TTL"
    )


def test_a_holder_in_its_reconnect_grace_on_another_core_is_never_handed_a_shared_key_ticket_it_cannot_verify() -> None:
    """Core A makes a new shared key at 100. The holder's core B reads it as late as a core still serving may (2
    rounds and --lease-ttl later) and tells its connected workers; the holder's session closed just before, so it
    learns the key only in its next ``welcome``, up to --worker-reconnect-grace-s later (after that it is reaped:
    its outputs lost, not refused). Until then A signs pulls from it with a key it has; its welcome has the new one.
    Without the grace in the shared key's publish delay A signed with the new key from 104 on (unknown ticket key)."""
    cluster, grace = ClusterConfig(), 5.0
    times = key_times(ticket_ttl_s=300.0, lease_ttl_s=cluster.lease_ttl_s, scan_s=cluster.scan_s,
                      reconnect_grace_s=grace)  # fmt: skip
    old, new = SharedKey("c-old", "aa" * 32, 0.0, ""), SharedKey("c-new", "bb" * 32, 100.0, "")

    def shared(keys: list[SharedKey], wall: float) -> list[tuple[str, bytes]]:
        return accepted(keys, None, wall, times.keep_s, times.publish_s)  # as ClusterHost.sync_shared_keys

    b = Harness(placement=PlacementConfig(cluster=True), worker_reconnect_grace_s=grace)
    b.core.data.set_shared(shared([old], 50.0))
    holder, other = b.worker("w1"), b.worker("w2")
    before = {key.kid: key.key for key in b.core.data.worker_keys("w1")}  # what the holder verifies with
    read_at = new.made_at + 2 * cluster.scan_s + cluster.lease_ttl_s  # B's last round before it would stop
    b.now = read_at - 0.01
    b.close(holder)
    b.now = read_at
    b.core.data.set_shared(shared([new, old], read_at))
    b._pump()
    assert [{key.kid for key in m.keys} for m in b.take(other) if isinstance(m, DataKeys)] == [{"c-old", "c-new"}]
    assert not [m for m in b.take(holder) if isinstance(m, DataKeys)]  # closed: not told

    a = Harness(placement=PlacementConfig(cluster=True), worker_reconnect_grace_s=grace)
    source = Source("a", 1, "w1", "y", 10, "")
    back_by = b.now - 0.01 + grace + PUBLISH_MARGIN_S  # registered again, or reaped at the reaper's next tick
    for step in range(int((back_by - new.made_at) * 10)):
        wall = new.made_at + step / 10
        a.core.data.set_shared(shared([new, old], wall))
        ticket = a.core.data.pull_ticket(source, a.now, shared=True)
        assert ticket.split(".")[1] in before, wall
        verify(ticket, before, wall=a.now, worker="w1", plan="a", attempt=1, direction="get", name="y")
    a.core.data.set_shared(shared([new, old], new.made_at + times.publish_s))
    assert a.core.data.pull_ticket(source, a.now, shared=True).startswith("fw1.c-new.")  # published: it signs

    b.now = read_at - 0.01 + grace - 0.1  # the holder registers again within its grace
    back = b.worker("w1")
    [welcome] = [m for m in b.take(back) if isinstance(m, Welcome)]
    assert "c-new" in [key.kid for key in welcome.data_keys]
