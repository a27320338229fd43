"""ruff and mypy are part of the test suite, so CI fails on lint or type errors."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def test_ruff_clean() -> None:
    """ruff reports nothing on the repository."""
    ruff = shutil.which("ruff") or pytest.fail("ruff is not installed; pip install -e '.[test]'")
    result = _run(ruff, "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean() -> None:
    """mypy (strict, configured in pyproject.toml) reports nothing on the packages."""
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr
