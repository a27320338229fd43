"""How a handler's child process finds the worker script's handlers (worker_agent/handler_child.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from worker_agent import handler_child

SCRIPT = """
import sys, types

def first(ctx, args):
    sys.modules["__mp_main__"] = types.ModuleType("a_library")  # what importing torch did on a GPU host
    return 1

def second(ctx, args):
    return 2
"""


def test_a_script_handler_is_found_after_a_library_took_the_mp_main_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second handler of the worker script resolves in the same child even after the first one imported a
    library that put its own module in sys.modules["__mp_main__"] (seen on an H100 host with torch)."""
    script = tmp_path / "worker_script.py"
    script.write_text(SCRIPT)
    monkeypatch.delitem(sys.modules, "__mp_main__", raising=False)
    assert handler_child._resolve("__main__:first", str(script))(None, None) == 1
    assert handler_child._resolve("__main__:second", str(script))(None, None) == 2
