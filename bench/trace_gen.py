#!/usr/bin/env python3
"""Seeded synthetic LLM request traces in the Mooncake format, for ``bench/routing_sim.py --synthetic``.

A trace is a list of rows as the Mooncake conversation trace has them: ``timestamp`` (ms from
the start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (one id per
512-token prompt block; an id names its block *and every block before it*, so two requests
sharing their first k ids share a k x 512-token prefix). The workload it models:

* **groups**: ``groups`` shared prefixes (system prompts, documents, few-shot examples) of
  ``shared_blocks`` blocks each: the *prefix-sharing depth*;
* **popularity**: each session picks its group by a Zipf law of exponent ``zipf_s`` over the
  groups (0: uniform; 1.4: the top group takes about a third of the sessions);
* **sessions**: a multi-turn chat of a geometric number of turns (mean ``turns_mean``); its
  first prompt is the group's prefix plus ``first_blocks`` blocks of its own, and each later
  turn extends the previous prompt by ``turn_blocks`` blocks (the answer and the next
  message), arriving ``think_s`` (exponential mean, plus 2 s) after the previous turn;
* **arrivals**: sessions start as a Poisson process sized so that requests arrive at
  ``rate_per_s`` on average; with ``bursts`` the start rate is ``burst_factor`` times the
  base for ``burst_len_s`` of every ``burst_every_s`` (the mean rate unchanged).

Everything comes from one ``random.Random`` seeded with ``(seed, name)``, so a spec gives the
same rows on every run and machine. Named grids (:data:`GRIDS`): ``default`` is depth
{shallow, deep} x skew {0.6, 1.0, 1.4} x sessions {short, long} x bursts {off, on}, 24 traces of
10 minutes; ``tiny`` is two short traces for smoke tests.

Usage: ``python bench/trace_gen.py --grid default --out DIR`` writes one JSONL file per trace
(readable by ``routing_sim.py --trace``); ``--list`` prints the grid's specs.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import json
import math
import random
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["GRIDS", "TraceSpec", "generate", "grid"]

BLOCK_TOKENS = 512  # the Mooncake trace's block


@dataclass(frozen=True)
class TraceSpec:
    """The knobs of one synthetic trace (module doc)."""

    name: str
    seed: int = 1
    duration_s: float = 600.0
    rate_per_s: float = 4.0  # requests per second, on average
    groups: int = 100
    shared_blocks: int = 2  # prefix-sharing depth: leading blocks every request of a group shares
    zipf_s: float = 1.0  # popularity skew of the groups
    turns_mean: float = 1.5  # session length, geometric (1: single-turn)
    first_blocks: tuple[int, int] = (1, 6)  # a session's own blocks on its first turn (uniform range)
    turn_blocks: tuple[int, int] = (1, 3)  # blocks each later turn adds
    think_s: float = 30.0  # mean time between a session's turns (plus 2 s)
    output_mean: float = 300.0  # output tokens, exponential mean (at least 1)
    bursts: bool = False
    burst_factor: float = 6.0
    burst_every_s: float = 60.0
    burst_len_s: float = 10.0

    def check(self) -> None:
        """Raise ``ValueError`` naming the first knob that cannot work."""
        problems = [
            (self.duration_s <= 0, "duration_s must be > 0"),
            (self.rate_per_s <= 0, "rate_per_s must be > 0"),
            (self.groups < 1, "groups must be >= 1"),
            (self.shared_blocks < 0, "shared_blocks must be >= 0"),
            (self.zipf_s < 0, "zipf_s must be >= 0"),
            (self.turns_mean < 1, "turns_mean must be >= 1"),
            (not 0 <= self.first_blocks[0] <= self.first_blocks[1], "first_blocks must be (lo, hi), 0 <= lo <= hi"),
            (not 0 <= self.turn_blocks[0] <= self.turn_blocks[1], "turn_blocks must be (lo, hi), 0 <= lo <= hi"),
            (self.shared_blocks + self.first_blocks[0] < 1, "a prompt needs at least one block"),
            (self.bursts and not 0 < self.burst_len_s < self.burst_every_s, "burst_len_s must be in (0, every)"),
            (self.bursts and self.burst_factor < 1, "burst_factor must be >= 1"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(f"trace spec {self.name!r}: {message}")


def _starts(spec: TraceSpec, rng: random.Random) -> list[float]:
    """Session start times: Poisson, with the rate raised during bursts (the mean kept)."""
    session_rate = spec.rate_per_s / spec.turns_mean
    if spec.bursts:
        share = spec.burst_len_s / spec.burst_every_s
        base = session_rate / (1 - share + share * spec.burst_factor)
        peak = base * spec.burst_factor
    else:
        base = peak = session_rate
    starts, t = [], 0.0
    while True:  # thinning: candidates at the peak rate, kept with probability rate(t) / peak
        t += rng.expovariate(peak)
        if t >= spec.duration_s:
            return starts
        in_burst = spec.bursts and (t % spec.burst_every_s) < spec.burst_len_s
        if in_burst or rng.random() < base / peak:
            starts.append(t)


def generate(spec: TraceSpec) -> list[dict[str, Any]]:
    """The trace's rows, in arrival order (Mooncake JSONL fields), deterministic for the spec."""
    spec.check()
    rng = random.Random(f"{spec.seed}:{spec.name}")
    ids = itertools.count()
    prefixes = [[next(ids) for _ in range(spec.shared_blocks)] for _ in range(spec.groups)]
    cumulative = list(itertools.accumulate(1.0 / (rank**spec.zipf_s) for rank in range(1, spec.groups + 1)))
    stop_p = 1.0 / spec.turns_mean  # geometric number of turns with this mean
    # (arrival, tie, blocks) of every turn still to come, earliest first.
    pending: list[tuple[float, int, list[int]]] = []
    order = itertools.count()
    for start in _starts(spec, rng):
        group = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        blocks = prefixes[min(group, spec.groups - 1)] + [next(ids) for _ in range(rng.randint(*spec.first_blocks))]
        t = start
        while t < spec.duration_s:
            heapq.heappush(pending, (t, next(order), list(blocks)))
            if rng.random() < stop_p:
                break
            t += 2.0 + rng.expovariate(1.0 / spec.think_s)
            blocks += [next(ids) for _ in range(rng.randint(*spec.turn_blocks))]
    rows = []
    while pending:
        t, _, blocks = heapq.heappop(pending)
        # The last block is partly filled, as ceil(input_length / 512) == len(hash_ids) in the real trace.
        tokens = BLOCK_TOKENS * (len(blocks) - 1) + rng.randint(1, BLOCK_TOKENS)
        output = max(1, round(rng.expovariate(1.0 / spec.output_mean)))
        rows.append({"timestamp": int(t * 1000), "input_length": tokens, "output_length": output, "hash_ids": blocks})
    return rows


_DEPTHS = {"shallow": 2, "deep": 16}
_SKEWS = (0.6, 1.0, 1.4)
_SESSIONS = {"short": 1.5, "long": 6.0}


def _default_grid(seed: int) -> list[TraceSpec]:
    specs = []
    for (depth, blocks), skew, (length, turns), burst in itertools.product(
        _DEPTHS.items(), _SKEWS, _SESSIONS.items(), (False, True)
    ):
        name = f"{depth}-z{skew}-{length}-{'burst' if burst else 'steady'}"
        specs.append(TraceSpec(name, seed=seed, shared_blocks=blocks, zipf_s=skew, turns_mean=turns, bursts=burst))
    return specs


def _tiny_grid(seed: int) -> list[TraceSpec]:
    return [
        TraceSpec("tiny-deep-z1.4-long-burst", seed=seed, duration_s=60, shared_blocks=16, zipf_s=1.4,
                  turns_mean=6.0, think_s=10.0, bursts=True, burst_every_s=20, burst_len_s=4),
        TraceSpec("tiny-shallow-z0.6-short", seed=seed, duration_s=60, zipf_s=0.6),
    ]


GRIDS = {"default": _default_grid, "tiny": _tiny_grid}


def grid(name: str, seed: int = 1, scale: float = 1.0) -> list[TraceSpec]:
    """The named grid's specs; ``scale`` multiplies every trace's duration (so its request count)."""
    make = GRIDS.get(name)
    if make is None:
        raise ValueError(f"unknown synthetic grid {name!r}; choose one of {', '.join(GRIDS)}")
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"the grid's scale must be a positive number, got {scale}")
    return [replace(spec, duration_s=spec.duration_s * scale) for spec in make(seed)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--grid", default="default", help=f"one of {', '.join(GRIDS)} (default: default)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every trace's duration")
    parser.add_argument("--out", type=Path, metavar="DIR", help="write DIR/<name>.jsonl per trace")
    parser.add_argument("--list", action="store_true", help="print the grid's specs as JSON lines")
    ns = parser.parse_args(argv)
    try:
        specs = grid(ns.grid, ns.seed, ns.scale)
    except ValueError as exc:
        print(f"trace_gen: error: {exc}", file=sys.stderr)
        return 2
    if ns.list or ns.out is None:
        for spec in specs:
            print(json.dumps(asdict(spec)))
    if ns.out is not None:
        ns.out.mkdir(parents=True, exist_ok=True)
        for spec in specs:
            rows = generate(spec)
            (ns.out / f"{spec.name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            print(f"{ns.out / (spec.name + '.jsonl')}: {len(rows)} requests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
