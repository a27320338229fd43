"""Build the compiled core (``FLEETWIRE_MYPYC=1``, setup.py) in a copy of this tree, and test it there.

The extensions go next to the copy's sources, never the checkout's: an in-place build there would
shadow the pure modules for every test run in the tree. In the copy, Python imports each compiled
module's extension before its source, so the copy is a compiled tree, and this tree stays pure::

    python tools/build_compiled.py /tmp/fw-compiled           # copy + build (prints the build's seconds)
    python tools/build_compiled.py --test                     # ... in a temporary copy, then the core's tests
    python bench/core_per_plan.py --compare /tmp/fw-compiled  # this tree (pure) against the compiled copy

``--test`` runs the unit tests of the pure core against the compiled copy (:func:`core_tests`: the
files of tests/unit that import the core and nothing that does I/O), those of wireio/otlp.py
(:data:`OTLP_TESTS`), those of the other compiled modules (:func:`edge_tests`: the unit test files that
import one) and wireio/wsmask.py's (:data:`WSMASK_TESTS`), after checking that each module
of setup.py's ``COMPILED`` is imported from its extension. ``--if-compiler``: without a C compiler or
Python's headers, say so and exit 0 (CI on a machine that cannot build). Exit status: 0 when built
(and passed), 1 when the build, the check or a test failed.

``--wheel`` builds the copy the way an install does (CI does): ``pip wheel --no-deps`` with ``FLEETWIRE_MYPYC``
unset, in an isolated build environment (``--no-build-isolation``: this one's setuptools, wheel and mypy), which
compiles by default where a compiler is present (setup.py). The build must not have fallen back to pure Python and
the wheel must hold an extension for each module of ``COMPILED``; its extensions are unpacked next to the copy's
sources, which are then checked and tested as above. One compile, the install's own::

    python tools/build_compiled.py --wheel --test --if-compiler   # .ci/run
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Iterable
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: What the copy holds: the build's inputs, the packages, and what the tests read.
COPIED = ("pyproject.toml", "setup.py", "README.md", "protocol", "wireio", "coordinator", "worker_agent", "fleetwire",
          "tests", "bench", "examples", "docs", "tools")
#: setup.py's INPLACE_OK: this in-place build is in a copy, not the checkout.
INPLACE = "FLEETWIRE_MYPYC_INPLACE"
IGNORED = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", ".mypy_cache", ".pytest_cache", "build")
#: Imports that make a test file more than the core's: I/O being done (an event loop, sockets, processes),
#: the SDK, the worker. (The core's tests that read a MemoryStore or render metrics count: they stay sans-I/O.)
#: Run against the compiled copy too: the tests of wireio/otlp.py (compiled, though wireio/ is not the core), among
#: them the one that compares its bytes with the pure module's.
OTLP_TESTS = ("tests/unit/test_otlp_encode.py", "tests/unit/test_worker_live_spans.py",
              "tests/unit/test_otlp_compiled.py")  # fmt: skip
#: Run against the compiled copy too: the tests of wireio/wsmask.py (compiled), which open sockets (tests/integration).
WSMASK_TESTS = ("tests/integration/test_wsmask.py", "tests/integration/test_wsmask_server.py")
NOT_CORE = ("asyncio", "socket", "subprocess", "websockets", "httpx", "wireio", "worker_agent", "fleetwire",
            "coordinator.io.frontdoor", "coordinator.io.cluster", "tests.waiting")


def _paths(node: ast.expr) -> list[str]:
    """The paths of ``COMPILED``'s expression: ``tuple(f"coordinator/{name}.py" for name in (...))``, a tuple of
    paths, or their sum."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _paths(node.left) + _paths(node.right)
    if isinstance(node, ast.Tuple):
        return list(ast.literal_eval(node))
    assert isinstance(node, ast.Call) and isinstance(node.args[0], ast.GeneratorExp)
    generator = node.args[0]
    assert isinstance(generator.elt, ast.JoinedStr) and isinstance(generator.elt.values[0], ast.Constant)
    prefix = generator.elt.values[0].value  # "coordinator/"
    return [f"{prefix}{name}.py" for name in ast.literal_eval(generator.generators[0].iter)]


def compiled_modules(root: Path = ROOT) -> list[str]:
    """setup.py's ``COMPILED``, as dotted module names (setup.py is read, not run)."""
    tree = ast.parse((root / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "COMPILED" for t in node.targets):
            return [path.removesuffix(".py").replace("/", ".") for path in _paths(node.value)]
    raise SystemExit(f"{root / 'setup.py'}: no COMPILED")


def group_library(root: Path = ROOT) -> str:
    """The module name of the extension holding the compiled code and mypyc's runtime: setup.py's ``GROUP`` and
    mypyc's suffix (one group: each module of ``COMPILED`` is a shim that imports it)."""
    for node in ast.parse((root / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "GROUP" for t in node.targets):
            return f"{ast.literal_eval(node.value)}__mypyc"
    raise SystemExit(f"{root / 'setup.py'}: no GROUP")


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def core_tests(root: Path = ROOT) -> list[str]:
    """The unit tests of the core: files of tests/unit that import ``coordinator`` and, themselves or through
    the test modules they import, none of :data:`NOT_CORE`."""
    cache: dict[Path, set[str]] = {}

    def closure(path: Path, seen: set[Path]) -> set[str]:
        if path not in cache:
            cache[path] = imports_of(path)
        names = set(cache[path])
        for name in cache[path]:
            if name.startswith("tests."):
                helper = root / (name.replace(".", "/") + ".py")
                if helper.is_file() and helper not in seen:
                    names |= closure(helper, seen | {helper})
        return names

    selected = []
    for path in sorted((root / "tests" / "unit").glob("test_*.py")):
        names = closure(path, {path})
        core = any(n == "coordinator" or n.startswith("coordinator.") for n in names)
        if core and not any(n == bad or n.startswith(bad + ".") for n in names for bad in NOT_CORE):
            selected.append(str(path.relative_to(root)))
    return selected


def edge_tests(root: Path = ROOT) -> list[str]:
    """The unit tests of the compiled modules outside the core (:func:`core_tests`) and the OTLP packing
    (:data:`OTLP_TESTS`): the files of tests/unit that import one of them (``COMPILED``'s modules of
    ``coordinator.io``, ``fleetwire``, ``worker_agent``, ``protocol`` and ``wireio``), by module or by a name
    imported from it."""
    edge = [name for name in compiled_modules(root) if name != "wireio.otlp"
            and (name.startswith(("coordinator.io.", "fleetwire.", "worker_agent.", "protocol.", "wireio.")))]
    selected = []
    for path in sorted((root / "tests" / "unit").glob("test_*.py")):
        names = imports_of(path)
        if any(n == module or n.startswith(module + ".") for n in names for module in edge):
            selected.append(str(path.relative_to(root)))
    return selected


def test_files(root: Path = ROOT) -> list[str]:
    """What ``--test`` runs: the core's tests, the OTLP packing's and those of the other compiled modules."""
    return list(dict.fromkeys([*core_tests(root), *OTLP_TESTS, *edge_tests(root), *WSMASK_TESTS]))


def can_compile() -> str | None:
    """Why this machine cannot build the extensions (no C compiler, no Python.h), or None."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler!r} is not on PATH; Debian: apt-get install gcc)"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return f"no Python headers ({include}/Python.h; Debian: apt-get install python3-dev)"
    try:
        import mypyc  # noqa: F401
    except ImportError:
        return "no mypyc (it comes with mypy: pip install -e '.[test]')"
    return None


def copy_tree(dest: Path, parts: Iterable[str] = COPIED) -> None:
    """Copy this tree's sources (no caches, no extensions) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for part in parts:
        src = ROOT / part
        if src.is_dir():
            shutil.copytree(src, dest / part, ignore=IGNORED, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dest / part)


def build(dest: Path) -> float:
    """Compile ``dest`` in place (setup.py with the switch on); the seconds it took."""
    env = {**os.environ, "FLEETWIRE_MYPYC": "1", INPLACE: "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "setup.py", "--quiet", "build_ext", "--inplace"], cwd=dest, env=env,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
        raise SystemExit(f"build_compiled: the build in {dest} failed (exit {proc.returncode})")
    return time.perf_counter() - start


def build_wheel(dest: Path, *, isolated: bool = True) -> float:
    """Build ``dest``'s wheel as ``pip wheel .`` does with the switch unset, check that it compiled, and unpack its
    extensions next to ``dest``'s sources; the seconds it took."""
    env = {name: value for name, value in os.environ.items() if name not in ("FLEETWIRE_MYPYC", INPLACE)}
    out = dest / "dist"
    argv = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out), str(dest)]
    start = time.perf_counter()
    proc = subprocess.run([*argv, *([] if isolated else ["--no-build-isolation"])], cwd=dest, env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    seconds = time.perf_counter() - start
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        sys.stderr.write(output[-8000:])
        raise SystemExit(f"build_compiled: `pip wheel` of {dest} failed (exit {proc.returncode})")
    warnings = [line.strip() for line in output.splitlines() if "fleetwire build: warning" in line]
    wheels = sorted(out.glob("fleetwire-*.whl"))
    if warnings or len(wheels) != 1:
        sys.stderr.write(output[-8000:])
        raise SystemExit(f"build_compiled: the wheel of {dest} is not compiled: {warnings or wheels}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        extensions = [name for name in wheel.namelist() if name.endswith(tuple(EXTENSION_SUFFIXES))]
        wheel.extractall(dest, extensions)
    for info in dest.glob("*.egg-info"):  # the build's metadata: the tests' importlib.metadata would find it
        shutil.rmtree(info)
    lacking = sorted({*compiled_modules(dest), group_library(dest)} - {name.split(".")[0].replace("/", ".")
                                                                        for name in extensions})  # fmt: skip
    if lacking or wheels[0].name.endswith("-py3-none-any.whl"):
        raise SystemExit(f"build_compiled: {wheels[0].name} lacks the extensions of {lacking}")
    print(f"build_compiled: {wheels[0].name} built by `pip wheel` ({len(extensions)} extension files: a shim a module "
          f"and {group_library(dest)}, the group's code and mypyc's runtime)")
    return seconds


def _env(dest: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(dest)}


def check(dest: Path) -> list[str]:
    """The modules of ``COMPILED`` that the copy imports from their source instead of an extension, and the group's
    library if it is not the copy's."""
    modules = [*compiled_modules(dest), group_library(dest)]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    path = importlib.import_module(name).__file__ or ''\n"
            "    if path.endswith('.py') or not path.startswith(sys.argv[1]): print(name, path)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(dest)], cwd=dest, env=_env(dest), capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"build_compiled: importing the compiled modules failed:\n{proc.stderr[-3000:]}")
    return proc.stdout.splitlines()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", nargs="?", help="where to copy and build (default: a temporary directory)")
    parser.add_argument("--test", action="store_true", help="run the pure core's unit tests against the build")
    parser.add_argument("--if-compiler", action="store_true", help="exit 0 with a message when nothing can build")
    parser.add_argument("--list-tests", action="store_true", help="print the core's test files and exit")
    parser.add_argument("--wheel", action="store_true", help="build as `pip wheel .` does by default, and unpack it")
    parser.add_argument("--no-build-isolation", action="store_true", help="with --wheel: this environment's tools")
    parser.add_argument("pytest_args", nargs="*", default=[], help="after --: more pytest arguments")
    ns = parser.parse_args(argv)
    if ns.list_tests:
        print("\n".join(test_files()))
        return 0
    why = can_compile()
    if why is not None:
        print(f"build_compiled: cannot build the compiled core here: {why}", file=sys.stderr)
        return 0 if ns.if_compiler else 1
    with tempfile.TemporaryDirectory(prefix="fleetwire-compiled-") as tmp:
        dest = Path(ns.dest).resolve() if ns.dest else Path(tmp)
        copy_tree(dest)
        seconds = build_wheel(dest, isolated=not ns.no_build_isolation) if ns.wheel else build(dest)
        print(f"build_compiled: {len(compiled_modules(dest))} modules compiled in {dest} in {seconds:.1f} s")
        pure = check(dest)
        if pure:
            print("build_compiled: imported from source, not compiled:\n  " + "\n  ".join(pure), file=sys.stderr)
            return 1
        if not ns.test:
            return 0
        tests = test_files(dest)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, *ns.pytest_args],
                              cwd=dest, env=_env(dest), check=False)
        seconds = time.perf_counter() - start
        print(f"build_compiled: {len(tests)} test files against the compiled core in {seconds:.1f} s "
              f"(exit {proc.returncode})")
        return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
