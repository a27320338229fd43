"""A shard's core told a rotation of the cluster's shared key (``DataPlane.set_shared``, the cluster host every round,
coordinator/io/cluster/shared_keys.py): its connected workers get ``data_keys`` with the new key and the previous one,
pulls are signed with the new one, and a key dropped after the overlap leaves the workers' keys."""

from __future__ import annotations

from coordinator.data_plane import MAX_KEPT_KEYS
from coordinator.graphs.lineage import Source
from coordinator.io.cluster.shared_keys import SharedKey, accepted
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
