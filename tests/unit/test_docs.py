"""docs/OPERATIONS.md stays true: its configuration reference, environment variables and metrics match the code."""

from __future__ import annotations

import re
from pathlib import Path

from coordinator.io.metrics import METRIC_NAMES
from fleetwire.reference import BEGIN, END, generate, splice

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"


def test_configuration_reference_matches_the_parser() -> None:
    """The generated flag tables equal what the parser says now (regenerate: python -m fleetwire.reference --write)."""
    text = OPERATIONS.read_text()
    assert BEGIN in text and END in text
    assert splice(text, generate()) == text, (
        "docs/OPERATIONS.md is stale: run `python -m fleetwire.reference --write docs/OPERATIONS.md`"
    )


def test_every_environment_variable_in_the_code_is_documented() -> None:
    """Each FLEETWIRE_* variable the packages read has a row in the environment table."""
    used = set()
    for package in ("coordinator", "worker_agent", "fleetwire", "protocol"):
        for path in (ROOT / package).rglob("*.py"):
            used.update(re.findall(r"FLEETWIRE_[A-Z_]+[A-Z]", path.read_text()))
    documented = set(re.findall(r"^\| `(FLEETWIRE_[A-Z_]+)` \|", OPERATIONS.read_text(), re.MULTILINE))
    assert used <= documented, sorted(used - documented)


def test_every_metric_is_in_the_metrics_reference() -> None:
    """Each exported metric family has a row in the metrics table (counters under their _total name)."""
    text = OPERATIONS.read_text()
    missing = [name for name in METRIC_NAMES if f"`{name}`" not in text and f"`{name}_total`" not in text]
    assert not missing, missing
