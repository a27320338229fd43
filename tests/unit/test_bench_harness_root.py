"""bench/_harness.py: a benchmark run in a copy of the tree (a worktree, a compiled copy) times that copy's client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_a_copys_bench_imports_the_copys_sdk(tmp_path: Path) -> None:
    """A script of a copy's bench/ that imports _harness resolves ``fleetwire`` to the copy, not to the checkout the
    venv's editable install names (latency.py's client was the checkout's in every copy)."""
    (tmp_path / "bench").mkdir()
    shutil.copy(BENCH / "_harness.py", tmp_path / "bench" / "_harness.py")
    (tmp_path / "fleetwire").mkdir()
    (tmp_path / "fleetwire" / "__init__.py").write_text("")
    probe = tmp_path / "bench" / "probe.py"
    probe.write_text("import _harness\nimport fleetwire\nprint(fleetwire.__file__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(probe)], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True, timeout=60)  # fmt: skip
    assert Path(out.stdout.strip()) == tmp_path / "fleetwire" / "__init__.py"
