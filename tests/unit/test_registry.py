"""WorkerRegistry: the seed's registry semantics (docs/SEMANTICS.md §Registry), with a fake clock."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from coordinator import WorkerRegistry
from coordinator.errors import CoordinatorError, UnknownWorker
from protocol import errors
from protocol.messages import Capabilities, GpuInfo, Load


def caps(
    *, tags: tuple[str, ...] = (), max_concurrency: int = 1, cpu: int = 8, ram: int = 16_000_000_000, gpus: int = 0
) -> Capabilities:
    return Capabilities(
        cpu_cores=cpu,
        ram_bytes=ram,
        gpus=[GpuInfo(name="H100", memory_bytes=80_000_000_000) for _ in range(gpus)],
        ops=["echo"],
        tags=list(tags),
        max_concurrency=max_concurrency,
    )


@pytest.fixture
def reg() -> WorkerRegistry:
    return WorkerRegistry(heartbeat_timeout_s=30.0)


def test_register_and_query(reg: WorkerRegistry) -> None:
    """A registered worker is known, connected, alive, and has no load until its first beat."""
    record = reg.register("w1", caps(), 0.0, address="10.0.0.1:5000", conn_id=7)
    assert reg.get("w1") is record
    assert "w1" in reg and len(reg) == 1
    assert record.connected and record.conn_id == 7 and record.address == "10.0.0.1:5000"
    assert record.load is None
    assert reg.is_alive("w1", 0.0)
    assert [r.id for r in reg.alive(0.0)] == ["w1"]


def test_heartbeat_records_load_and_beat(reg: WorkerRegistry) -> None:
    """A heartbeat stores the load and moves the last beat forward."""
    reg.register("w1", caps(), 0.0)
    reg.heartbeat("w1", Load(in_flight=2), 25.0)
    assert reg.get("w1").load == Load(in_flight=2)
    assert reg.is_alive("w1", 50.0)


def test_alive_boundary_is_inclusive(reg: WorkerRegistry) -> None:
    """A worker is alive at exactly the timeout after its beat and dead just past it."""
    reg.register("w1", caps(), 0.0)
    assert reg.is_alive("w1", 30.0)
    assert not reg.is_alive("w1", 30.001)


def test_find_by_tags_needs_every_tag(reg: WorkerRegistry) -> None:
    """find() returns alive workers that have all the required tags, in id order."""
    reg.register("b", caps(tags=("gpu", "a100")), 0.0)
    reg.register("a", caps(tags=("gpu",)), 0.0)
    reg.register("c", caps(tags=("cpu",)), 0.0)
    assert [r.id for r in reg.find(["gpu"], 0.0)] == ["a", "b"]
    assert [r.id for r in reg.find(["gpu", "a100"], 0.0)] == ["b"]
    assert [r.id for r in reg.find([], 0.0)] == ["a", "b", "c"]
    assert reg.find(["tpu"], 0.0) == []


def test_find_skips_dead_workers(reg: WorkerRegistry) -> None:
    """find() leaves out workers whose beat is past the timeout."""
    reg.register("old", caps(tags=("gpu",)), 0.0)
    reg.register("new", caps(tags=("gpu",)), 20.0)
    assert [r.id for r in reg.find(["gpu"], 40.0)] == ["new"]


def test_disconnected_worker_is_never_alive(reg: WorkerRegistry) -> None:
    """A disconnected worker is not alive, however fresh its beat."""
    reg.register("w1", caps(), 0.0)
    reg.heartbeat("w1", Load(), 1.0)
    reg.disconnect("w1")
    assert not reg.is_alive("w1", 1.0)
    assert reg.alive(1.0) == [] and reg.find([], 1.0) == []
    assert reg.get("w1").conn_id is None


def test_reregister_reconnects_and_keeps_leases(reg: WorkerRegistry) -> None:
    """Registering a known id again reconnects it, refreshes its beat and keeps its leases."""
    reg.register("w1", caps(max_concurrency=2), 0.0, conn_id=1)
    reg.claim("w1", "p1")
    reg.disconnect("w1")
    record = reg.register("w1", caps(max_concurrency=4), 25.0, conn_id=2)
    assert record.connected and record.conn_id == 2
    assert record.leases == {"p1"}
    assert record.capabilities.max_concurrency == 4
    assert reg.is_alive("w1", 50.0)


def test_silent_worker_is_reaped_and_beating_one_is_not(reg: WorkerRegistry) -> None:
    """The reaper drops a worker silent past the timeout and keeps one that beats."""
    reg.register("silent", caps(), 0.0)
    reg.register("beating", caps(), 0.0)
    for t in (10.0, 20.0, 30.0):
        reg.heartbeat("beating", Load(), t)
    assert reg.reap(30.0) == []
    assert reg.reap(31.0) == ["silent"]
    assert "silent" not in reg and "beating" in reg


def test_reap_drops_disconnected_workers_and_sorts_ids(reg: WorkerRegistry) -> None:
    """Disconnected workers keep their leases until the reaper drops them; ids come back sorted."""
    for wid in ("w3", "w1", "w2"):
        reg.register(wid, caps(), 0.0)
    reg.claim("w1", "p1")
    reg.disconnect("w1")
    assert reg.get("w1").leases == {"p1"}
    assert [r.id for r in reg.stale(31.0)] == ["w1", "w2", "w3"]
    assert reg.reap(31.0) == ["w1", "w2", "w3"]
    assert len(reg) == 0


def test_reap_logs_dropped_ids(reg: WorkerRegistry) -> None:
    """Reaping logs a warning that names the dropped workers."""
    reg.register("w1", caps(), 0.0)
    with capture_logs() as logs:
        reg.reap(100.0)
    assert logs == [
        {"event": "workers reaped", "log_level": "warning", "worker_ids": ["w1"], "heartbeat_timeout_s": 30.0,
         "reconnect_grace_s": None}
    ]


def test_claim_is_idempotent(reg: WorkerRegistry) -> None:
    """Claiming the same plan twice holds one lease."""
    reg.register("w1", caps(max_concurrency=2), 0.0)
    assert reg.claim("w1", "p1") is True
    assert reg.claim("w1", "p1") is False
    assert reg.get("w1").leases == {"p1"}
    assert reg.has_capacity("w1")


def test_release_frees_and_is_idempotent(reg: WorkerRegistry) -> None:
    """Release frees a lease; releasing one not held changes nothing."""
    reg.register("w1", caps(), 0.0)
    reg.claim("w1", "p1")
    assert not reg.has_capacity("w1")
    assert reg.release("w1", "p1") is True
    assert reg.release("w1", "p1") is False
    assert reg.has_capacity("w1")


def test_capacity_zero_never_has_room(reg: WorkerRegistry) -> None:
    """A worker with max_concurrency 0 never has capacity."""
    reg.register("w0", caps(max_concurrency=0), 0.0)
    assert not reg.has_capacity("w0")


def test_capacity_one_is_full_after_one_claim(reg: WorkerRegistry) -> None:
    """A worker with max_concurrency 1 has room for exactly one lease."""
    reg.register("w1", caps(max_concurrency=1), 0.0)
    assert reg.has_capacity("w1")
    reg.claim("w1", "p1")
    assert not reg.has_capacity("w1")


@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.get("ghost"),
        lambda r: r.heartbeat("ghost", Load(), 0.0),
        lambda r: r.disconnect("ghost"),
        lambda r: r.claim("ghost", "p1"),
        lambda r: r.release("ghost", "p1"),
        lambda r: r.has_capacity("ghost"),
        lambda r: r.info("ghost", 0.0),
    ],
    ids=["get", "heartbeat", "disconnect", "claim", "release", "has_capacity", "info"],
)
def test_unknown_worker_is_reported(reg: WorkerRegistry, call: object) -> None:
    """Operations on an unknown worker raise UnknownWorker carrying the id and its wire code."""
    with pytest.raises(UnknownWorker) as info:
        call(reg)  # type: ignore[operator]
    assert info.value.worker_id == "ghost"
    assert info.value.code == errors.UNKNOWN_WORKER
    assert isinstance(info.value, CoordinatorError)


def test_unknown_worker_is_not_alive(reg: WorkerRegistry) -> None:
    """is_alive() answers False for an id never registered."""
    assert reg.is_alive("ghost", 0.0) is False


def test_least_loaded_prefers_fewest_leases(reg: WorkerRegistry) -> None:
    """least_loaded picks the fewest leases, then the least recently assigned, then the lowest id."""
    for wid in ("a", "b", "c"):
        reg.register(wid, caps(max_concurrency=4), 0.0)
    reg.claim("a", "p1")
    reg.claim("b", "p2")
    # c has no lease: it wins outright.
    assert reg.least_loaded(reg.alive(0.0)).id == "c"  # type: ignore[union-attr]
    reg.claim("c", "p3")
    # All hold one; a was assigned longest ago.
    assert reg.least_loaded(reg.alive(0.0)).id == "a"  # type: ignore[union-attr]
    assert reg.least_loaded([]) is None


def test_least_loaded_ties_never_assigned_by_id(reg: WorkerRegistry) -> None:
    """Among workers never assigned and equally loaded, the lowest id wins."""
    reg.register("z", caps(), 0.0)
    reg.register("m", caps(), 0.0)
    assert reg.least_loaded(reg.alive(0.0)).id == "m"  # type: ignore[union-attr]


def test_summary_counts_alive_workers(reg: WorkerRegistry) -> None:
    """summary() reads 'N workers (C CPUs, G GPUs, R GB RAM)' over alive workers, GB = 10^9 bytes."""
    reg.register("a", caps(cpu=8, ram=15_600_000_000), 0.0)
    reg.register("b", caps(cpu=8, ram=15_600_000_000), 0.0)
    reg.register("gone", caps(cpu=64, gpus=8), 0.0)
    reg.disconnect("gone")
    assert reg.summary(0.0) == "2 workers (16 CPUs, 0 GPUs, 31.2 GB RAM)"
    reg.register("gone", caps(cpu=64, ram=0, gpus=8), 0.0)
    assert reg.summary(0.0) == "3 workers (80 CPUs, 8 GPUs, 31.2 GB RAM)"
    assert reg.summary(100.0) == "0 workers (0 CPUs, 0 GPUs, 0.0 GB RAM)"


def test_info_reports_beat_age_and_leases(reg: WorkerRegistry) -> None:
    """info() is the list_workers row: leases, liveness and the age of the last beat."""
    reg.register("w1", caps(max_concurrency=2), 0.0, address="h:1")
    reg.claim("w1", "p1")
    row = reg.info("w1", 12.5)
    assert (row.id, row.leases, row.connected, row.alive, row.address) == ("w1", 1, True, True, "h:1")
    assert row.last_beat_age_s == 12.5


def test_matching_is_cached_until_membership_changes(reg: WorkerRegistry) -> None:
    """matching() answers from its cache until a worker registers, disconnects or is reaped."""
    calls: list[str] = []

    def meets(record: object) -> bool:
        calls.append(getattr(record, "id", ""))
        return True

    reg.register("a", caps(), 0.0)
    assert [r.id for r in reg.matching("k", meets)] == ["a"]
    assert [r.id for r in reg.matching("k", meets)] == ["a"]
    assert calls == ["a"]
    reg.register("b", caps(), 0.0)
    assert sorted(r.id for r in reg.matching("k", meets)) == ["a", "b"]
    reg.disconnect("a")
    assert [r.id for r in reg.matching("k", meets)] == ["b"]
    reg.reap(100.0)
    assert reg.matching("k", meets) == []
