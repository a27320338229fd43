"""bench/trace_gen.py: seeded synthetic traces in the Mooncake format (no clock, no I/O but the module load)."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from tests import bench_scripts


def _load() -> ModuleType:
    return bench_scripts.load("trace_gen.py", "trace_gen")


tg = _load()


def test_same_seed_same_rows_other_seed_other_rows() -> None:
    """A spec gives the same rows every time; another seed gives other rows."""
    spec = tg.TraceSpec("t", seed=7, duration_s=60, zipf_s=1.4, turns_mean=4.0, bursts=True)
    first = tg.generate(spec)
    assert first == tg.generate(spec) and len(first) > 50
    other = tg.generate(tg.TraceSpec("t", seed=8, duration_s=60, zipf_s=1.4, turns_mean=4.0, bursts=True))
    assert other != first


def test_rows_are_mooncake_rows_with_the_asked_sharing_depth() -> None:
    """Rows arrive in order, ceil(input/512) blocks each, and every prompt starts with its group's shared blocks."""
    spec = tg.TraceSpec("t", duration_s=120, shared_blocks=5, groups=10, turns_mean=3.0)
    rows = tg.generate(spec)
    stamps = [row["timestamp"] for row in rows]
    assert stamps == sorted(stamps) and stamps[-1] < 120_000
    heads = set()
    for row in rows:
        assert math.ceil(row["input_length"] / 512) == len(row["hash_ids"]) and row["output_length"] >= 1
        heads.add(tuple(row["hash_ids"][:5]))
    assert len(heads) <= 10  # one shared prefix per group
    # A later turn of a session extends an earlier prompt: some prompt is a strict prefix of another.
    prompts = {tuple(row["hash_ids"]) for row in rows}
    assert any(p[:-1] in prompts or p[:-2] in prompts or p[:-3] in prompts for p in prompts)


def test_skew_concentrates_sessions_on_the_top_group() -> None:
    """A higher Zipf exponent gives the most popular group a larger share of the requests."""

    def top_share(s: float) -> float:
        rows = tg.generate(tg.TraceSpec("t", duration_s=300, zipf_s=s, shared_blocks=2))
        heads = [tuple(row["hash_ids"][:2]) for row in rows]
        return max(heads.count(h) for h in set(heads)) / len(heads)

    assert top_share(1.4) > top_share(0.6) + 0.1


def test_named_grids_and_bad_specs_are_named_in_errors() -> None:
    """The default grid is 2 x 3 x 2 x 2 distinct traces; an unknown grid or a bad knob is a ValueError naming it."""
    specs = tg.grid("default")
    assert len(specs) == 24 and len({s.name for s in specs}) == 24
    assert [s.duration_s for s in tg.grid("tiny", scale=2)] == [2 * s.duration_s for s in tg.grid("tiny")]
    with pytest.raises(ValueError, match="nope"):
        tg.grid("nope")
    with pytest.raises(ValueError, match="zipf_s"):
        tg.generate(tg.TraceSpec("bad", zipf_s=-1))
