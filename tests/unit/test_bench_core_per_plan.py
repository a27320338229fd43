"""bench/core_per_plan.py runs at its default size, past the core's per-client plan limit; so do its other sides."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest

from tests import bench_scripts


def _bench() -> ModuleType:
    return bench_scripts.load("core_per_plan.py", "core_per_plan_bench")


def test_default_run_drives_more_plans_than_the_per_client_limit_to_their_end() -> None:
    """All 20,000 plans of the default run finish (one client held 10,000 unfinished, the default limit, and stuck)."""
    from coordinator import CoreConfig

    bench = _bench()
    plans = 20_000
    assert plans > CoreConfig().max_plans_per_client
    assert bench.run_plans(plans, 500) > 0  # raises "stuck after N of M plans" or names a refused submit


def test_client_side_runs_every_plan_to_its_result() -> None:
    """The client side submits its plans through a socketless Client and awaits each one's result."""
    assert _bench().run_client(600, 250) > 0  # a plan without its result would wait for ever: the loop would stall


def test_worker_side_runs_every_plan_and_gets_each_message_acked() -> None:
    """The worker side runs its assigns through a socketless Agent to their done, every message acked."""
    assert _bench().run_worker(600, 250) > 0  # raises when messages are left unacked


def test_cg_dir_keeps_each_trees_callgrind_outputs_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--cg-dir``: each run's callgrind output is kept in a folder a tree, the ``--setup-only`` runs' apart."""

    bench = _bench()
    outs: list[str] = []

    def fake_total(tree: str, args: list[str], out: str) -> tuple[int, int]:
        outs.append(out)
        return 1000 * int(args[args.index("--plans") + 1]), 0

    monkeypatch.setattr(bench, "_python", lambda tree, args, valgrind_out=None: "")
    monkeypatch.setattr(bench, "_callgrind_total", fake_total)
    ns = argparse.Namespace(side="worker", batch=500, cg_dir=str(tmp_path))
    assert bench._instructions("/tmp/tree-a", 500, 2000, ns) == (0.0, 0.0)  # the setup's difference taken off
    folder = tmp_path / "tmp_tree-a"
    assert outs == [str(folder / name) for name in ("cg.500", "cg.2000", "cg.500.setup", "cg.2000.setup")]
    assert folder.is_dir()
