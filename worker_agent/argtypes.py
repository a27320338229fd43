"""argparse value types shared by the ``fleetwire worker`` flags (main.py and telemetry.py)."""

from __future__ import annotations

import argparse


def non_negative_int(text: str) -> int:
    """An int >= 0 (0 is meaningful: e.g. no KV budget, no concurrency)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A float >= 0 (NaN is refused)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A float > 0 (NaN is refused)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value
