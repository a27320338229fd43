"""The architecture, checked: where I/O may live, which way imports run, no cycles, no reaching into privates.

The rules (docs/SEMANTICS.md §Roles of code):

* **Layers.** protocol < wireio < {coordinator, worker_agent, the SDK} < the CLI: ``protocol``
  imports only itself; ``wireio`` (shared low-level I/O) only ``protocol``; the coordinator, the
  worker agent and the SDK (``fleetwire/`` but the CLI) each import ``protocol``, ``wireio`` and
  themselves, never one another; the CLI (``fleetwire/cli/``, ``fleetwire/__main__.py``) may
  import everything. No import runs up or across.
* **Pure core.** A module of ``coordinator/`` outside ``coordinator/io/`` imports none of
  asyncio, socket, time, random, sqlite3, threading, ssl or websockets, and neither
  ``coordinator.io`` nor ``wireio``: time and randomness come in as arguments, I/O is the driver's.
* **Pure protocol.** ``protocol/`` imports none of those I/O modules either, but ``random``
  (``protocol/backoff.py`` takes a ``random.Random`` its caller seeds).
* **Placement is one layer.** No module outside ``coordinator/placement/`` both imports a module
  of it (directly or not) and is imported by one: the registry and the pools sit below it.
* **No cycles.** The import graph of ``protocol/``, ``wireio/``, ``coordinator/``, ``fleetwire/``
  and ``worker_agent/`` is a DAG. Every import counts: module level, inside a function, and under
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
import functools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "wireio", "coordinator", "fleetwire", "worker_agent")
IO_FREE_FORBIDDEN = frozenset({"asyncio", "socket", "time", "random", "sqlite3", "threading", "ssl", "websockets"})
PROTOCOL_FORBIDDEN = IO_FREE_FORBIDDEN - {"random"}  # protocol/backoff.py takes a random.Random, seeded by its caller
CLI_MODULES = frozenset({"fleetwire.cli", "fleetwire.__main__"})
PLACEMENT = "coordinator.placement"
#: Which layers a layer may import (its own included); the CLI may import every one.
LAYERS_ALLOWED = {
    "protocol": frozenset({"protocol"}),
    "wireio": frozenset({"protocol", "wireio"}),
    "coordinator": frozenset({"protocol", "wireio", "coordinator"}),  # wireio from coordinator/io/ only: io_violations
    "worker_agent": frozenset({"protocol", "wireio", "worker_agent"}),
    "sdk": frozenset({"protocol", "wireio", "sdk"}),
    "cli": frozenset({"protocol", "wireio", "coordinator", "worker_agent", "sdk", "cli"}),
}


def is_cli(name: str) -> bool:
    """The CLI, which starts coordinators and workers: the fleetwire.cli package and __main__."""
    return name in CLI_MODULES or name.startswith("fleetwire.cli.")


def layer(name: str) -> str:
    """The layer of a module: its top package, with fleetwire/ split into the SDK and the CLI."""
    top = name.split(".")[0]
    if top == "fleetwire":
        return "cli" if is_cli(name) else "sdk"
    return top


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
    """Pure-core modules that import an I/O module, ``coordinator.io`` or ``wireio``."""
    found = []
    for module in modules.values():
        if not module.name.startswith("coordinator") or module.name.startswith("coordinator.io"):
            continue
        for target, line in module.imports:
            root = target.split(".")[0]
            if (root in IO_FREE_FORBIDDEN or root == "wireio" or target == "coordinator.io"
                    or target.startswith("coordinator.io.")):
                found.append(f"{module.name}:{line}: imports {target}")
        for base, name, line in module.from_names:
            if base == "coordinator" and name == "io":  # ``from coordinator import io``
                found.append(f"{module.name}:{line}: imports coordinator.io")
    return found


def protocol_io_violations(modules: dict[str, Module]) -> list[str]:
    """Modules of ``protocol/`` that import an I/O module (``random`` apart: backoff takes a seeded one)."""
    return [
        f"{module.name}:{line}: imports {target}"
        for module in modules.values() if module.name.split(".")[0] == "protocol"
        for target, line in module.imports if target.split(".")[0] in PROTOCOL_FORBIDDEN
    ]


def up_arrows(modules: dict[str, Module]) -> list[str]:
    """Imports that run up or across between the layers (``LAYERS_ALLOWED``), with their lines."""
    found = []
    for module in modules.values():
        source = layer(module.name)
        for target, line in dependencies(module, modules):
            if layer(target) not in LAYERS_ALLOWED[source]:
                found.append(f"{module.name}:{line}: {source} imports {layer(target)} ({target})")
    return sorted(set(found), key=found.index)


def _in_placement(name: str) -> bool:
    return name == PLACEMENT or name.startswith(PLACEMENT + ".")


def placement_sandwiches(modules: dict[str, Module]) -> list[str]:
    """Modules outside ``coordinator/placement/`` that a placement module reaches and that reach one."""
    graph = {name: {dep for dep, _ in dependencies(m, modules)} for name, m in modules.items()}

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    below = set().union(*(reach(name) for name in graph if _in_placement(name)))
    return sorted(name for name in below if not _in_placement(name) and any(map(_in_placement, reach(name))))


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


@functools.cache
def repo_modules() -> dict[str, Module]:
    """This repository's modules, parsed once per session (this file and test_architecture.py read them)."""
    return load_modules(ROOT)


@pytest.fixture(scope="module")
def repo() -> dict[str, Module]:
    return repo_modules()


def test_pure_core_imports_no_io(repo: dict[str, Module]) -> None:
    """No coordinator module outside coordinator/io/ imports an I/O module or coordinator.io."""
    assert io_violations(repo) == []


def test_no_import_cycles(repo: dict[str, Module]) -> None:
    """The import graph of our five packages (protocol ... worker_agent) has no cycle (TYPE_CHECKING counts)."""
    assert cycles(repo) == []


def test_sdk_imports_neither_coordinator_nor_agent(repo: dict[str, Module]) -> None:
    """The SDK modules (fleetwire/ but the CLI) import only protocol, wireio and fleetwire."""
    assert sdk_violations(repo) == []


def test_no_import_runs_up_between_layers(repo: dict[str, Module]) -> None:
    """protocol < wireio < coordinator, worker_agent, SDK < CLI: no import runs up, none across the middle."""
    assert up_arrows(repo) == []


def test_protocol_imports_no_io(repo: dict[str, Module]) -> None:
    """protocol/ imports no asyncio, socket, time, sqlite3, threading, ssl or websockets."""
    assert protocol_io_violations(repo) == []


def test_placement_is_one_layer(repo: dict[str, Module]) -> None:
    """No module outside coordinator/placement/ sits between two of its modules in the import graph."""
    assert placement_sandwiches(repo) == []


def test_no_module_touches_another_modules_privates(repo: dict[str, Module]) -> None:
    """No module reads or writes an underscore member defined by another module of ours."""
    assert private_violations(repo) == []


def test_layout_has_io_and_placement_folders(repo: dict[str, Module]) -> None:
    """I/O's subsystems, placement, wireio and the CLI have their own folders; no module is named like a stdlib one.

    A module named ``queue.py`` or ``http.py`` shadows the standard one for any script run from its
    folder and misleads a reader of ``import queue`` next to it. The folder ``coordinator/io/`` is a
    package, which nobody imports as ``io``, so only modules (files) are checked.
    """
    assert {
        "coordinator.io.frontdoor.server", "coordinator.io.stores.store", "coordinator.io.cluster.host",
        "coordinator.io.ops.metrics", "coordinator.io.dashboard.assets", "coordinator.placement.placer",
        "fleetwire.cli.main", "wireio.writeback",
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


def test_planted_wireio_import_in_the_core_is_caught(tmp_path: Path) -> None:
    """A pure-core module importing wireio is reported; coordinator/io/ may import it."""
    modules = _plant(tmp_path, {
        "wireio/wsbulk.py": "import asyncio\n",
        "coordinator/io/__init__.py": "",
        "coordinator/io/connection.py": "from wireio.wsbulk import send_frame\n",
        "coordinator/relay.py": "import wireio.wsbulk\n",
    })
    assert io_violations(modules) == ["coordinator.relay:1: imports wireio.wsbulk"]


def test_planted_up_arrows_are_caught(tmp_path: Path) -> None:
    """The worker importing the SDK, protocol importing wireio, wireio the SDK are reported; the CLI may import all."""
    modules = _plant(tmp_path, {
        "fleetwire/writeback.py": "import os\n",
        "fleetwire/cli/__init__.py": "from fleetwire.cli.main import main\n",
        "fleetwire/cli/main.py": (
            "import worker_agent.spool\nfrom coordinator.io.server import serve\nfrom wireio import chunkwrite\n"
            "def main(): ...\n"
        ),
        "coordinator/io/__init__.py": "",
        "coordinator/io/server.py": "from wireio.chunkwrite import ChunkWriter\n",
        "worker_agent/spool.py": "from fleetwire.writeback import WriteBehind\n",
        "protocol/codec.py": "from wireio import chunkwrite\n",
        "wireio/chunkwrite.py": "import protocol.codec\nfrom fleetwire import writeback\n",
    })
    assert up_arrows(modules) == [
        "protocol.codec:1: protocol imports wireio (wireio.chunkwrite)",
        "wireio.chunkwrite:2: wireio imports sdk (fleetwire.writeback)",
        "worker_agent.spool:1: worker_agent imports sdk (fleetwire.writeback)",
    ]


def test_planted_io_import_in_protocol_is_caught(tmp_path: Path) -> None:
    """A protocol module importing asyncio or websockets is reported; random (seeded by the caller) is not."""
    modules = _plant(tmp_path, {
        "protocol/backoff.py": "import random\n",
        "protocol/wsbulk.py": "import asyncio\nfrom websockets.frames import Frame\n",
    })
    assert protocol_io_violations(modules) == [
        "protocol.wsbulk:1: imports asyncio",
        "protocol.wsbulk:2: imports websockets.frames",
    ]


def test_planted_placement_sandwich_is_caught(tmp_path: Path) -> None:
    """The registry between placement's capacity and placer is reported; with capacity below it, nothing is."""
    sandwich = {
        "coordinator/workers.py": "class WorkerRecord: ...\n",
        "coordinator/placement/__init__.py": "",
        "coordinator/placement/capacity.py": "from coordinator.workers import WorkerRecord\n",
        "coordinator/registry.py": "from coordinator.placement.capacity import Pool\n",
        "coordinator/placement/placer.py": "from coordinator.registry import WorkerRegistry\n",
    }
    assert placement_sandwiches(_plant(tmp_path / "before", sandwich)) == ["coordinator.registry"]
    layered = {**sandwich, "coordinator/capacity.py": sandwich["coordinator/placement/capacity.py"],
               "coordinator/registry.py": "from coordinator.capacity import Pool\n"}
    del layered["coordinator/placement/capacity.py"]
    assert placement_sandwiches(_plant(tmp_path / "after", layered)) == []
