"""bench/tracing_per_plan.py drives traced plans through the core and its exporter's encoding, in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import msgspec

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("tracing_per_plan_bench", ROOT / "bench" / "tracing_per_plan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_every_traced_plan_leaves_its_three_coordinator_spans_and_the_exporter_encodes_them(tmp_path: Path) -> None:
    """1,200 traced plans end with a queue span and two commit spans each, which the exporter's path encodes."""
    bench = _bench()
    dump = tmp_path / "spans.msgpack"
    assert bench.coordinator(1_200, 1, str(dump)) > 0  # raises on a stuck run (a plan never assigned)
    spans = msgspec.msgpack.decode(dump.read_bytes())
    assert len(spans) == 3 * 1_200
    assert bench.exporter(str(dump), 1) > 0


def test_one_plan_in_a_hundred_traced_and_tracing_off() -> None:
    """--every 100 and --every 0 run every plan to its end too."""
    bench = _bench()
    assert bench.coordinator(1_000, 100) > 0
    assert bench.coordinator(1_000, 0) > 0
