"""bench/tracing_per_plan.py drives traced plans through the core and its exporter's encoding, in-process."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import msgspec

from tests import bench_scripts


def _bench() -> ModuleType:
    return bench_scripts.load("tracing_per_plan.py", "tracing_per_plan_bench")


def test_every_traced_plan_leaves_its_three_coordinator_spans_and_the_exporter_encodes_them(tmp_path: Path) -> None:
    """1,200 traced plans end with a queue span and two commit spans each, which the exporter's path encodes."""
    bench = _bench()
    dump = tmp_path / "spans.msgpack"
    assert bench.coordinator(1_200, 1, str(dump)) > 0  # raises on a stuck run (a plan never assigned)
    assert bench.count(str(dump)) == 3 * 1_200  # the step records the loop noted, made into spans by the exporter
    assert len(msgspec.msgpack.decode(dump.read_bytes())) < 1_200 // 10  # one record a step, not one a span
    assert bench.exporter(str(dump), 1) > 0


def test_one_plan_in_a_hundred_traced_and_tracing_off() -> None:
    """--every 100 and --every 0 run every plan to its end too."""
    bench = _bench()
    assert bench.coordinator(1_000, 100) > 0
    assert bench.coordinator(1_000, 0) > 0


def test_ratio_0_traces_in_the_core_and_notes_nothing(tmp_path: Path) -> None:
    """--every -1: tracing on in the core, every plan carrying the unsampled decision: no record noted, and the
    command line's figure has no exporter part (no span to encode)."""
    bench = _bench()
    dump = tmp_path / "spans.msgpack"
    assert bench.coordinator(1_000, -1, str(dump)) > 0
    assert msgspec.msgpack.decode(dump.read_bytes()) == []
    assert bench.main(["--every", "-1", "--plans", "600", "--no-callgrind"]) == 0
