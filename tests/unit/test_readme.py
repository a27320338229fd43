"""The README's Python blocks are whole scripts: each compiles and names nothing it does not define or import."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(path: Path = ROOT / "README.md") -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown file, each with the line its code starts on."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, re.S | re.M)]  # fmt: skip


BLOCKS = python_blocks()


def test_readme_has_python_blocks() -> None:
    """The extraction finds the README's Python examples (an empty list would make the checks below vacuous)."""
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_compiles(line: int, code: str) -> None:
    """A README Python block pasted into a file is valid Python (no top-level await or async with)."""
    compile(code, f"README.md:{line}", "exec")


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_defines_every_name(line: int, code: str) -> None:
    """A README Python block uses only names it defines or imports (pyflakes' checks, through ruff)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--isolated", "--select", "F",
         "--output-format", "concise", "--stdin-filename", f"README_{line}.py", "-"],
        input=code, capture_output=True, text=True, cwd=ROOT, check=False, timeout=60,
    )
    assert proc.returncode == 0, f"README.md:{line}:\n{proc.stdout}{proc.stderr}"
