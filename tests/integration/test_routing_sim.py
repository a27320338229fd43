"""bench/routing_sim.py keeps working: a few hundred requests of each trace format through the real core."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "bench" / "routing_sim.py"

pytestmark = pytest.mark.timeout(60)


def _mooncake(path: Path, n: int) -> None:
    """Conversations of a few turns: each turn's prompt extends the previous one's blocks."""
    rng = random.Random(1)
    rows, next_hash, t = [], 1, 0
    conversations: list[list[int]] = []
    for _ in range(n):
        t += rng.randint(50, 400)
        if conversations and rng.random() < 0.6:
            blocks = rng.choice(conversations)
            blocks += list(range(next_hash, next_hash + 2))
        else:
            blocks = [0, *range(next_hash, next_hash + rng.randint(2, 8))]
            conversations.append(blocks)
        next_hash += 10
        rows.append({"timestamp": t, "input_length": 512 * len(blocks) - 100,
                     "output_length": rng.randint(5, 300), "hash_ids": list(blocks)})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _azure(path: Path, n: int) -> None:
    rng = random.Random(2)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        second = i * 0.2
        lines.append(f"2023-11-16 18:{15 + int(second) // 60:02d}:{second % 60:010.7f},{rng.randint(50, 3000)},"
                     f"{rng.randint(1, 500)}")
    path.write_text("\r\n".join(lines))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SIM), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_sim_replays_both_formats_and_reports_every_column(tmp_path: Path) -> None:
    """Both trace formats replay through the core; every policy row and the reference rows carry the columns."""
    mooncake, azure = tmp_path / "conv.jsonl", tmp_path / "azure.csv"
    _mooncake(mooncake, 300)
    _azure(azure, 300)
    done = _run("--trace", str(mooncake), "--trace", str(azure), "--json", "--jobs", "1")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    by = {(r["trace"], r["policy"]): r for r in rows}
    policies = ("round_robin", "least_busy", "latency_weighted", "joule_weighted", "carbon_weighted", "kv_aware")
    for trace in ("mooncake", "azure"):
        for policy in policies:
            row = by[(trace, policy)]
            assert row["requests"] == 300 and row["energy_kwh"] > 0 and row["e2e_p99_s"] >= row["e2e_p50_s"] > 0
    ceiling = by[("mooncake", "infinite cache (ceiling)")]["hit_rate"]
    assert 0 < by[("mooncake", "round_robin")]["hit_rate"] <= by[("mooncake", "kv_aware")]["hit_rate"] <= ceiling
    assert by[("azure", "kv_aware")]["hit_rate"] is None  # no prefix hashes in the Azure format


def test_sim_prints_tables_and_says_what_it_replayed(tmp_path: Path) -> None:
    """Without --json it prints a Markdown table per trace, headed by how many requests it replayed."""
    mooncake = tmp_path / "conv.jsonl"
    _mooncake(mooncake, 200)
    done = _run("--trace", str(mooncake), "--limit", "120", "--policies", "round_robin,kv_aware", "--jobs", "1")
    assert done.returncode == 0, done.stderr
    assert "120 of 200 requests replayed" in done.stdout
    assert "| kv_aware | 120 |" in done.stdout and "| infinite cache (ceiling) |" in done.stdout


def test_sim_skips_absent_traces_and_exits_zero(tmp_path: Path) -> None:
    """A missing trace is reported and skipped; with nothing to replay the script still exits 0."""
    done = _run("--trace", str(tmp_path / "missing.jsonl"))
    assert done.returncode == 0
    assert "absent" in done.stdout and "nothing measured" in done.stdout


def test_sim_refuses_a_file_that_is_no_trace(tmp_path: Path) -> None:
    """A file in neither format is an error that names the file, with exit status 2."""
    bogus = tmp_path / "bogus.txt"
    bogus.write_text("hello\n")
    done = _run("--trace", str(bogus))
    assert done.returncode == 2 and "bogus.txt" in done.stderr and "Mooncake" in done.stderr


def test_sim_runs_a_synthetic_grid_and_prints_it(tmp_path: Path) -> None:
    """--synthetic tiny replays each generated trace through the core and prints hit, ceiling and max/mean per trace."""
    done = _run("--synthetic", "tiny", "--jobs", "1", "--knob", "kv_load_bound=0.1")
    assert done.returncode == 0, done.stderr
    assert "synthetic grid 'tiny'" in done.stdout and "| tiny-deep-z1.4-long-burst | kv_aware |" in done.stdout
    assert "goal (hit >= 98% of the shared LRU" in done.stdout
    rows = [json.loads(line) for line in _run("--synthetic", "tiny", "--jobs", "1", "--json").stdout.splitlines()]
    by = {(r["trace"], r["policy"]): r for r in rows}
    for name in ("tiny-deep-z1.4-long-burst", "tiny-shallow-z0.6-short"):
        row, lru = by[(name, "kv_aware")], by[(name, "one shared LRU, fleet-sized")]
        assert row["requests"] > 50 and 0 < row["hit_rate"] and lru["hit_rate"] > 0 and row["max_over_mean"] >= 1
    assert _run("--synthetic", "nope").returncode == 2
