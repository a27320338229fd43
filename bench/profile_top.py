"""Summarise a py-spy collapsed-stack profile (``--format raw``): where the samples went.

    python bench/profile_top.py /tmp/prof/coordinator.txt [--top 25] [--filter PATTERN]

Prints the functions with the most *self* samples (the frame on top of the stack) and with
the most *total* samples (anywhere on the stack), each as a share of all samples.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", help="a py-spy --format raw file")
    parser.add_argument("--top", type=int, default=25, help="rows per table (default 25)")
    parser.add_argument("--filter", help="only count stacks that contain this regex")
    ns = parser.parse_args(argv)
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    samples = 0
    pattern = re.compile(ns.filter) if ns.filter else None
    with open(ns.profile) as fh:
        for line in fh:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            if pattern is not None and not pattern.search(stack):
                continue
            count = int(count_text)
            frames = [_short(f) for f in stack.split(";")]
            samples += count
            own[frames[-1]] += count
            for frame in set(frames):
                total[frame] += count
    if not samples:
        print("no samples")
        return 1
    print(f"{samples} samples")
    for title, counter in (("self", own), ("total", total)):
        print(f"\n-- top {ns.top} by {title} samples")
        for frame, count in counter.most_common(ns.top):
            print(f"{100 * count / samples:6.1f}%  {frame}")
    return 0


def _short(frame: str) -> str:
    """``func (path/to/module.py:123)`` -> ``func (module.py)``: lines differ within one function."""
    m = re.match(r"(.*) \((.*?):?(\d+)?\)$", frame)
    if not m:
        return frame
    path = m.group(2)
    parts = path.replace("\\\\", "/").split("/")
    return f"{m.group(1)} ({'/'.join(parts[-2:])})"


if __name__ == "__main__":
    sys.exit(main())
