"""A script of bench/ loaded as a module, for the tests that drive its functions in-process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(script: str, name: str) -> ModuleType:
    """bench/``script`` as the module ``name``, executed once (registered first: dataclasses look their module up),
    with bench/ on ``sys.path`` for the modules it imports from beside it."""
    if (loaded := sys.modules.get(name)) is not None:
        return loaded
    if str(BENCH) not in sys.path:  # its sibling modules (bench/_echo_core.py...), as when it runs as a script
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
