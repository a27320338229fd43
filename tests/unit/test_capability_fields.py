"""Capability fields no code read are gone; old workers sending them still register; p99 latency is exported."""

from __future__ import annotations

import json

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.io.ops.metrics import build_registry, render
from protocol.codec import Codec
from protocol.messages import Capabilities, FromWorker, Heartbeat, Hello, Load, Welcome
from tests.unit.test_core import Harness

OLD_HELLO = {
    "type": "hello", "worker_id": "old-1", "version": "0.0.9",
    "capabilities": {"ops": ["generate"], "max_concurrency": 2, "continuous_batching": True, "paged_kv": True},
}  # fmt: skip


def test_removed_fields_are_not_in_capabilities() -> None:
    """continuous_batching and paged_kv are no longer protocol fields (nothing read them)."""
    assert not {"continuous_batching", "paged_kv"} & set(Capabilities.__struct_fields__)


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_an_old_worker_sending_the_removed_fields_still_registers(encoding: str) -> None:
    """A hello carrying continuous_batching/paged_kv decodes (unknown fields ignored) and the worker is welcomed."""
    codec = Codec(encoding, FromWorker, "worker")  # type: ignore[arg-type]
    frame = json.dumps(OLD_HELLO) if encoding == "json" else msgspec.msgpack.encode(OLD_HELLO)
    [hello] = codec.decode(frame)
    assert isinstance(hello, Hello) and hello.capabilities.ops == ["generate"]
    h = Harness()
    conn = 1
    h.core.open_session(conn, "worker", h.now)
    h.send(conn, hello)
    assert any(isinstance(m, Welcome) for m in h.inbox[conn])
    assert h.core.registry.get("old-1").capabilities.max_concurrency == 2


def test_reported_p50_and_p99_latency_are_exported_per_worker() -> None:
    """A worker's Load.latency_p50_ms/p99_ms become fleetwire_worker_latency_seconds{quantile} samples."""
    h = Harness()
    w = h.worker("w1")
    h.worker("quiet")  # reports no latency: no sample
    h.send(w, Heartbeat(load=Load(latency_p50_ms=120.0, latency_p99_ms=900.0)))
    registry = build_registry(h.core, clock=lambda: h.now, process=False)
    family = next(f for f in text_string_to_metric_families(render(registry).decode())
                  if f.name == "fleetwire_worker_latency_seconds")  # fmt: skip
    assert {(s.labels["worker"], s.labels["quantile"]): s.value for s in family.samples} == {
        ("w1", "0.5"): 0.12, ("w1", "0.99"): 0.9}
