"""Bytecodes a no-op plan runs in the pure core, by function: where bench/core_per_plan.py's instructions go.

Callgrind (bench/core_per_plan.py) says how many instructions a plan costs, and that half of them are CPython's
eval loop, but not in which Python functions; cProfile's own times are mostly its own per-call cost. This
counts the bytecodes each function executes (``sys.settrace`` with opcode events) in ``core_per_plan.run_plans``,
the same echo loop, for two sizes (``--plans`` and a quarter of it) and prints the difference per plan, so the
core's building cancels out. The count is the same from run to run and does not move with machine load.

    python bench/core_opcodes.py                  # 2,000 plans (all placed at submit, as callgrind's runs)
    python bench/core_opcodes.py --plans 20000    # plans past the workers' 2,000 slots wait in the queue
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from types import FrameType
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from core_per_plan import run_plans  # noqa: E402  (bench/ is on the path when run as a script)

Key = tuple[str, int, str]


def opcodes(plans: int, batch: int) -> collections.Counter[Key]:
    """Bytecodes run by each function (file, first line, name) while ``plans`` echo plans go through a core."""
    counts: collections.Counter[Key] = collections.Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        if event == "opcode":
            code = frame.f_code
            counts[os.path.relpath(code.co_filename, ROOT), code.co_firstlineno, code.co_name] += 1
        return tracer

    sys.settrace(tracer)
    try:
        run_plans(plans, batch)
    finally:
        sys.settrace(None)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=2_000, help="plans in the larger run (default 2000)")
    parser.add_argument("--batch", type=int, default=500, help="messages between take_effects (default 500)")
    parser.add_argument("--top", type=int, default=40, help="functions listed (default 40)")
    ns = parser.parse_args(argv)
    run_plans(ns.batch, ns.batch)  # imports and first calls out of the way
    small, large = ns.plans // 4, ns.plans
    before, after = opcodes(small, ns.batch), opcodes(large, ns.batch)
    per_plan = {key: (after[key] - before[key]) / (large - small) for key in after.keys() | before.keys()}
    print(f"bytecodes a plan: {sum(per_plan.values()):,.0f} ({small:,} and {large:,} plans, differenced)")
    for (path, line, name), n in sorted(per_plan.items(), key=lambda item: -item[1])[: ns.top]:
        print(f"{n:8.1f}  {name} ({path}:{line})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
