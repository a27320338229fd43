"""A shard's core told a rotation of the cluster's shared key (``DataPlane.set_shared``, the cluster host every round,
coordinator/io/cluster/shared_keys.py): its connected workers get ``data_keys`` with the new key and the previous one,
pulls are signed with the new one, and a key dropped after the overlap leaves the workers' keys."""

from __future__ import annotations

from itertools import pairwise

from coordinator.data_plane import MAX_KEPT_KEYS, key_rotation_problem
from coordinator.graphs.lineage import Source
from coordinator.io.cluster.shared_keys import SharedKey, accepted, overlap_s
from coordinator.placement.placer import PlacementConfig
from protocol.messages import DataKeys
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
    ttl, lease_ttl, scan = 700.0, 3.0, 0.5
    publish = 2 * scan + lease_ttl  # as host.py passes them
    keep = ttl + 2 * scan + lease_ttl
    overlap = overlap_s(lease_ttl, scan)
    assert overlap == publish + keep - ttl == 8.0

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
        "it signed (the TTL, plus 8 s while the next one is published and overlaps), and at most 8 keys are kept; "
        "give a rotation of at least 101.143 s ((TTL + 8) / 7) or a shorter TTL"
    )
