"""The architecture, checked: where I/O may live, no import cycles, no reaching into other modules' privates.

The rules (docs/SEMANTICS.md §Layers):

* **Pure core.** A module of ``coordinator/`` outside ``coordinator/io/`` imports none of
  asyncio, socket, time, random, sqlite3, threading, ssl or websockets, and not
  ``coordinator.io``: time and randomness come in as arguments, I/O is the driver's.
* **No cycles.** The import graph of ``protocol/``, ``coordinator/``, ``fleetwire/`` and
  ``worker_agent/`` is a DAG. Every import counts: module level, inside a function, and under
  ``if TYPE_CHECKING:`` (a module that names another's type depends on it). ``from pkg import
  name`` depends on ``pkg.name`` when that is a module, else on the package's ``__init__``.
  Importing ``a.b.c`` is not counted as depending on ``a`` and ``a.b`` (their ``__init__`` run,
  but they only re-export).
* **SDK apart.** The SDK modules of ``fleetwire/`` (all but the CLI, which starts servers:
  ``fleetwire/cli/`` and ``__main__.py``) import neither ``coordinator`` nor ``worker_agent``.
* **Own your privates.** No module reads or writes an underscore member (``obj._x``,
  ``self._x`` from a base class, ``from m import _x``) that another of our modules defines and it
  does not.

Each rule is a function over a source tree, so the tests below also plant a violation in a
scratch tree and show that the check catches it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "wireio", "coordinator", "fleetwire", "worker_agent")
IO_FREE_FORBIDDEN = frozenset({"asyncio", "socket", "time", "random", "sqlite3", "threading", "ssl", "websockets"})
CLI_MODULES = frozenset({"fleetwire.cli", "fleetwire.__main__"})


def is_cli(name: str) -> bool:
    """The CLI, which starts coordinators and workers: the fleetwire.cli package and __main__."""
    return name in CLI_MODULES or name.startswith("fleetwire.cli.")


@dataclass
class Module:
    """One parsed module: its dotted name, path, AST and the modules/names it imports."""

    name: str
    path: Path
    tree: ast.Module
    imports: list[tuple[str, int]] = field(default_factory=list)  # (dotted target as written, line)
    from_names: list[tuple[str, str, int]] = field(default_factory=list)  # (module, imported name, line)
    from_bases: set[tuple[str, int]] = field(default_factory=set)  # the ``from X import`` entries of ``imports``

    @property
    def is_package(self) -> bool:
        return self.path.name == "__init__.py"


def load_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Module]:
    """Parse every module of ``packages`` under ``root``; relative imports are resolved."""
    modules: dict[str, Module] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            module = Module(name, path, ast.parse(path.read_text(), str(path)))
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Import):
                    module.imports.extend((alias.name, node.lineno) for alias in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = _absolute(module, node)
                    module.imports.append((base, node.lineno))
                    module.from_bases.add((base, node.lineno))
                    module.from_names.extend((base, alias.name, node.lineno) for alias in node.names)
            modules[name] = module
    return modules


def _absolute(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def dependencies(module: Module, modules: dict[str, Module]) -> Iterator[tuple[str, int]]:
    """The modules of ours that ``module`` depends on, with the line of each import."""
    for target, line in module.imports:
        if target in modules and (target, line) not in module.from_bases:
            yield target, line
    for base, name, line in module.from_names:
        if f"{base}.{name}" in modules:
            yield f"{base}.{name}", line
        elif base in modules:  # a name the package (or module) defines or re-exports
            yield base, line


def io_violations(modules: dict[str, Module]) -> list[str]:
    """Pure-core modules that import an I/O module or ``coordinator.io``."""
    found = []
    for module in modules.values():
        if not module.name.startswith("coordinator") or module.name.startswith("coordinator.io"):
            continue
        for target, line in module.imports:
            root = target.split(".")[0]
            if root in IO_FREE_FORBIDDEN or target == "coordinator.io" or target.startswith("coordinator.io."):
                found.append(f"{module.name}:{line}: imports {target}")
        for base, name, line in module.from_names:
            if base == "coordinator" and name == "io":  # ``from coordinator import io``
                found.append(f"{module.name}:{line}: imports coordinator.io")
    return found


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    graph = {name: sorted({dep for dep, _ in dependencies(m, modules)}) for name, m in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:  # iterative Tarjan: no recursion limit on big graphs
        nonlocal counter
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return found


def sdk_violations(modules: dict[str, Module]) -> list[str]:
    """SDK modules (fleetwire/ but the CLI entry points) that import the coordinator or the agent."""
    found = []
    for module in modules.values():
        if not module.name.startswith("fleetwire") or is_cli(module.name):
            continue
        for target, line in module.imports:
            if target.split(".")[0] in ("coordinator", "worker_agent"):
                found.append(f"{module.name}:{line}: imports {target}")
    return found


def _own_names(tree: ast.Module) -> set[str]:
    """Names a module defines: functions, classes, assigned names, attributes set on self/cls, parameters."""
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.alias) and node.asname:
            own.add(node.asname)
    return own


def private_violations(modules: dict[str, Module]) -> list[str]:
    """Uses of an underscore member that another module of ours defines and this one does not."""
    own = {name: _own_names(m.tree) for name, m in modules.items()}
    defined_somewhere: dict[str, set[str]] = {}
    for name, names in own.items():
        for member in names:
            if member.startswith("_") and not member.startswith("__"):
                defined_somewhere.setdefault(member, set()).add(name)
    found = []
    for name, module in modules.items():
        for base, imported, line in module.from_names:
            if imported.startswith("_") and not imported.startswith("__") and base.split(".")[0] in PACKAGES:
                found.append(f"{name}:{line}: imports {base}.{imported}")
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Attribute):
                continue
            member = node.attr
            if not member.startswith("_") or member.startswith("__") or member in own[name]:
                continue
            owners = defined_somewhere.get(member, set()) - {name}
            if owners:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)} (defined in {', '.join(sorted(owners))})")
    return found


@pytest.fixture(scope="module")
def repo() -> dict[str, Module]:
    return load_modules(ROOT)


def test_pure_core_imports_no_io(repo: dict[str, Module]) -> None:
    """No coordinator module outside coordinator/io/ imports an I/O module or coordinator.io."""
    assert io_violations(repo) == []


def test_no_import_cycles(repo: dict[str, Module]) -> None:
    """The import graph of protocol, coordinator, fleetwire and worker_agent has no cycle (TYPE_CHECKING counts)."""
    assert cycles(repo) == []


def test_sdk_imports_neither_coordinator_nor_agent(repo: dict[str, Module]) -> None:
    """The SDK modules (fleetwire/ but the CLI entry points) import only protocol and fleetwire."""
    assert sdk_violations(repo) == []


def test_no_module_touches_another_modules_privates(repo: dict[str, Module]) -> None:
    """No module reads or writes an underscore member defined by another module of ours."""
    assert private_violations(repo) == []


def test_layout_has_io_and_placement_folders(repo: dict[str, Module]) -> None:
    """I/O and placement have their own folders, and no module is named like a standard-library module.

    A module named ``queue.py`` or ``http.py`` shadows the standard one for any script run from its
    folder and misleads a reader of ``import queue`` next to it. The folder ``coordinator/io/`` is a
    package, which nobody imports as ``io``, so only modules (files) are checked.
    """
    assert {
        "coordinator.io.frontdoor.server", "coordinator.io.stores.store", "coordinator.placement.placer",
    } <= repo.keys()
    shadowing = [
        name for name, module in repo.items()
        if not module.is_package and name.rsplit(".", 1)[-1] in sys.stdlib_module_names
    ]
    assert shadowing == []


# ---------------------------------------------------------------- the checks can fail


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in PACKAGES:
        (tmp_path / package).mkdir(exist_ok=True)
        init = tmp_path / package / "__init__.py"
        if not init.exists():
            init.write_text("")
    return load_modules(tmp_path)


def test_planted_io_import_is_caught(tmp_path: Path) -> None:
    """A core module importing time, or coordinator.io, is reported; the same import under io/ is not."""
    modules = _plant(tmp_path, {
        "coordinator/io/__init__.py": "",
        "coordinator/io/frontdoor/server.py": "import asyncio\nimport time\n",
        "coordinator/core.py": "import time\nfrom coordinator.io import server\n",
    })
    assert io_violations(modules) == [
        "coordinator.core:1: imports time",
        "coordinator.core:2: imports coordinator.io",
    ]


def test_planted_cycle_is_caught_even_under_type_checking(tmp_path: Path) -> None:
    """Two modules importing each other, one of them only for typing, form a reported cycle."""
    modules = _plant(tmp_path, {
        "coordinator/a.py": "from coordinator.b import B\n",
        "coordinator/b.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from coordinator import a\nclass B: ...\n"
        ),
        "coordinator/c.py": "from coordinator.a import *\n",
    })
    assert cycles(modules) == [["coordinator.a", "coordinator.b"]]


def test_planted_sdk_import_of_the_coordinator_is_caught(tmp_path: Path) -> None:
    """An SDK module importing the coordinator is reported; the CLI entry point may."""
    modules = _plant(tmp_path, {
        "fleetwire/client.py": "def f():\n    from coordinator.core import Coordinator\n",
        "fleetwire/cli/main.py": "from coordinator.io.frontdoor.server import serve\nimport worker_agent.main\n",
    })
    assert sdk_violations(modules) == ["fleetwire.client:2: imports coordinator.core"]


def test_planted_private_access_is_caught(tmp_path: Path) -> None:
    """Reading another module's ``_member`` (or importing ``_name``) is reported; a module's own is not."""
    modules = _plant(tmp_path, {
        "coordinator/core.py": (
            "class Core:\n    def __init__(self):\n        self._send = []\n        self._send.append(1)\n"
        ),
        "coordinator/session.py": (
            "from coordinator.core import Core, _helper\n"
            "def on(core: Core):\n    core._send.append(2)\n"
        ),
    })
    found = private_violations(modules)
    assert found == [
        "coordinator.session:1: imports coordinator.core._helper",
        "coordinator.session:3: core._send (defined in coordinator.core)",
    ]
