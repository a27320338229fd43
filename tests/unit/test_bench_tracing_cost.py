"""bench/compare.py --tracing (bench/_tracing_cost.py): levels named twice, each round's order, paired changes."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest

from tests.bench_scripts import load

tc = load("_tracing_cost.py", "bench_tracing_cost")


class FakeSink:
    """The OTLP sink, without its HTTP server: no posts."""

    endpoint = "http://127.0.0.1:9"

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def spans(self, bodies: list[bytes] | None = None) -> int:
        return 0


def test_a_level_named_twice_runs_twice_under_its_own_label() -> None:
    """'off,off' is two levels, the second labelled "(again)"; off is added when not named; unknown keys refused."""
    assert [level.label for level in tc.chosen_levels("off,off")] == ["off", "off (again)"]
    assert [(level.label, level.ratio) for level in tc.chosen_levels("1")] == [("off", None), ("1 %", "0.01")]
    assert [level.base for level in tc.chosen_levels("off,1,1")] == ["off", "1 %", "1 %"]
    with pytest.raises(SystemExit):
        tc.chosen_levels("off,2")


def test_rotated_rounds_put_each_level_in_each_slot_alike() -> None:
    """Over len(levels) rounds each level runs once in every slot; 'fixed' keeps the table's order."""
    levels = tc.chosen_levels("off,1,100")
    orders = [[level.label for level in tc.round_order(levels, r)] for r in range(3)]
    for slot in range(3):
        assert sorted(order[slot] for order in orders) == sorted(level.label for level in levels)
    assert tc.round_order(levels, 1, "fixed") == list(levels)


def _fake_run(slot_penalty: float) -> tuple[Any, list[str | None]]:
    """A bench run whose throughput is 1,000 plans/s, less ``slot_penalty`` for the second level run in a round
    (a warm-up, the page cache: what the method does, not the code); the sampler ratio each run saw."""
    seen: list[str | None] = []

    def run(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
        if script == "latency.py":
            return {"p50_ms": 0.5}
        seen.append(os.environ.get("OTEL_TRACES_SAMPLER_ARG"))
        second = len(seen) % 2 == 0
        return {"plans_per_s": 1000.0 * (1 - slot_penalty if second else 1.0), "cpu_s": {"client": 0.5}}

    return run, seen


def _measure(monkeypatch: pytest.MonkeyPatch, levels: str, order: str, rounds: int = 4) -> tuple[dict, list]:
    monkeypatch.setattr(tc, "Sink", FakeSink)
    run, seen = _fake_run(0.03)
    ns = argparse.Namespace(plans=1000, samples=10, store="memory", timeout=5.0, rounds=rounds,
                            tracing_levels=levels, tracing_order=order)  # fmt: skip
    _, results = tc.measure(ns, run)
    return results, seen


def test_the_a_a_control_shows_a_second_slot_penalty_only_in_fixed_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """off against off, a run in the second slot 3 % slower: fixed order reads -3 % into the A/A (as the bench before
    the rotation read it into 1 %), rotated order's paired median is 0 with -3 % after off and +3 % before it."""
    fixed, _ = _measure(monkeypatch, "off,off", "fixed")
    assert fixed["levels"]["off (again)"]["paired_rate"]["median"] == pytest.approx(-3.0)
    rotated, _ = _measure(monkeypatch, "off,off", "rotate")
    paired = rotated["levels"]["off (again)"]["paired_rate"]
    assert paired["median"] == pytest.approx(0.0, abs=0.1)
    assert paired["after_base"] == pytest.approx(-3.0)
    assert paired["before_base"] == pytest.approx(100 / 97 * 100 - 100)
    assert (paired["rounds_after"], paired["rounds_before"]) == (2, 2)
    assert rotated["orders"] == [["off", "off (again)"], ["off (again)", "off"]] * 2


def test_each_level_runs_with_its_own_variables_in_the_rotated_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1 % level's runs see OTEL_TRACES_SAMPLER_ARG 0.01, off's none, in the order each round ran them; the
    variables are as before once it is done."""
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    results, seen = _measure(monkeypatch, "off,1", "rotate", rounds=3)
    assert seen == [None, "0.01", "0.01", None, None, "0.01"]
    assert results["levels"]["1 %"]["rates"] == [970.0, 1000.0, 970.0]
    assert "OTEL_TRACES_SAMPLER_ARG" not in os.environ


def test_the_table_says_the_paired_cpu_change_of_each_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines name each level's paired CPU-per-plan change against off (the steadier figure under load)."""
    monkeypatch.setattr(tc, "Sink", FakeSink)
    run, _ = _fake_run(0.0)
    ns = argparse.Namespace(plans=1000, samples=10, store="memory", timeout=5.0, rounds=2, tracing_levels="off,1",
                            tracing_order="rotate")  # fmt: skip
    lines, _ = tc.measure(ns, run)
    assert any(line.startswith("paired change a round against off") and "1 %: CPU +0.0 % [+0.0, +0.0]" in line
               for line in lines)  # fmt: skip


def test_ratio_0_runs_traced_with_nothing_sampled_and_splits_the_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """'0' is the ratio-0 level: the endpoint and a parent-based ratio sampler set, OTEL_TRACES_SAMPLER_ARG 0, so
    every process traces and nothing is sampled; the table reads 1 % against it as well as against off."""
    monkeypatch.setattr(tc, "Sink", FakeSink)
    monkeypatch.delenv("OTEL_TRACES_SAMPLER_ARG", raising=False)
    seen: list[tuple[str | None, str | None]] = []

    def run(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
        if script == "latency.py":
            return {"p50_ms": 0.5}
        ratio = os.environ.get("OTEL_TRACES_SAMPLER_ARG")
        seen.append((os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), ratio))
        cpu = {None: 0.050, "0": 0.051, "0.01": 0.052}[ratio]  # 50, 51, 52 µs a plan at 1,000 plans
        return {"plans_per_s": 1000.0, "cpu_s": {"client": cpu}}

    assert [(level.label, level.ratio) for level in tc.chosen_levels("off,0,1")] == [
        ("off", None), ("ratio 0", "0"), ("1 %", "0.01")]  # fmt: skip
    ns = argparse.Namespace(plans=1000, samples=10, store="memory", timeout=5.0, rounds=1, tracing_levels="1,0,off",
                            tracing_order="fixed")  # fmt: skip
    lines, results = tc.measure(ns, run)
    assert seen == [(None, None), (FakeSink.endpoint, "0"), (FakeSink.endpoint, "0.01")]
    assert results["levels"]["ratio 0"]["paired_cpu"]["median"] == pytest.approx(2.0)
    assert results["paired_cpu_against_ratio_0"]["1 %"]["median"] == pytest.approx(100 * (52 / 51 - 1))
    assert any(line.startswith("paired change a round against ratio 0") and "1 %: +2.0 %" in line for line in lines)
