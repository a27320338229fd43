"""A quarantined device takes no plan (core, fake clock): the worker's load says so, an operator releases it."""

from __future__ import annotations

import pytest

from protocol import errors
from protocol.messages import (
    Assign,
    DeviceHealth,
    Error,
    Heartbeat,
    ListWorkers,
    Load,
    Ok,
    ReleaseDevice,
    Workers,
)
from tests.unit.test_core import Harness, only
from tests.unit.test_gpu_placement import assigns, gpu_plan, gpu_worker


@pytest.fixture
def h() -> Harness:
    return Harness()


def health(*states: str) -> Load:
    reasons = {"ok": "", "degraded": "temperature 93 °C >= 90 °C", "quarantined": "fatal XID 79 (GPU has fallen off "
               "the bus)"}  # fmt: skip
    return Load(devices=[DeviceHealth(index=i, state=s, reason=reasons[s]) for i, s in enumerate(states)])  # type: ignore[arg-type]


def admin(h: Harness) -> int:
    conn = next(h._conns)
    h.core.open_session(conn, "client", h.now, principal="ops", admin=True)
    return conn


def test_a_quarantined_device_takes_no_plan_and_a_release_places_the_waiting_one(h: Harness) -> None:
    """Device 0 quarantined: the first plan gets device 1, the second waits; the worker's report of device 0
    released (ok again) places it there. A degraded device is still placed on."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    h.take(w)
    h.send(w, Heartbeat(load=health("quarantined", "degraded")))
    c = h.client()
    first = gpu_plan(h, c, 1)
    assert only(h.take(w), Assign).devices == [1]
    second = gpu_plan(h, c, 1)
    assert h.state(second) == "queued" and assigns(h, w) == []
    assert h.core.registry.get("w1").gpus_free() == 0
    h.send(w, Heartbeat(load=health("ok", "degraded")))
    again = only(h.take(w), Assign)
    assert (again.plan_id, again.devices) == (second, [0])
    assert h.state(first) == "leased"


def test_list_workers_shows_the_health_and_only_the_leases_in_gpu_use(h: Harness) -> None:
    """The worker row carries each device's health from its load; gpu_use counts leases, not the quarantine."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    h.send(w, Heartbeat(load=health("quarantined", "ok")))
    c = h.client()
    gpu_plan(h, c, 1)
    h.send(c, ListWorkers(req_id=7))
    row = only(h.take(c), Workers).workers[0]
    assert row.gpu_use == [0, 1]
    assert row.load is not None and [d.state for d in row.load.devices] == ["quarantined", "ok"]
    assert row.load.devices[0].reason == "fatal XID 79 (GPU has fallen off the bus)"


def test_release_device_goes_to_the_worker_for_an_admin_only(h: Harness) -> None:
    """An admin's release_device is passed to the worker and answered ok; a client's is forbidden; an unknown
    device or worker is an error naming it."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    h.take(w)
    a, c = admin(h), h.client()
    h.send(a, ReleaseDevice(req_id=1, worker_id="w1", device=1))
    assert only(h.take(a), Ok).req_id == 1
    assert only(h.take(w), ReleaseDevice).device == 1
    h.send(c, ReleaseDevice(req_id=2, worker_id="w1", device=1))
    assert only(h.take(c), Error).code == errors.FORBIDDEN
    h.send(a, ReleaseDevice(req_id=3, worker_id="w1", device=2))
    error = only(h.take(a), Error)
    assert error.code == errors.INVALID_ARGUMENT and "has no device 2 (its devices are 0..1)" in error.message
    h.send(a, ReleaseDevice(req_id=4, worker_id="w9", device=0))
    assert only(h.take(a), Error).code == errors.UNKNOWN_WORKER
    assert h.take(w) == []


def test_a_quarantine_survives_new_capabilities_recount(h: Harness) -> None:
    """A worker that registers again keeps its reported quarantine until its load says otherwise."""
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    h.send(w, Heartbeat(load=health("ok", "quarantined")))
    h.close(w)
    w = gpu_worker(h, "w1", [(80, "H100")] * 2)
    assert h.core.registry.get("w1").gpu_blocked == (1,)
    c = h.client()
    gpu_plan(h, c, 1)
    assert only(h.take(w), Assign).devices == [0]
    gpu_plan(h, c, 1)
    assert assigns(h, w) == []
