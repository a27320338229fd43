"""The optional compiled core's build (setup.py, tools/build_compiled.py): off by default, never in place.

The compiled build itself is run by CI (.ci/run: ``tools/build_compiled.py --test``, about a minute);
these tests check its switches and lists without a compiler.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def setup_py() -> ModuleType:
    """setup.py as a module (its ``setup()`` call runs only as ``__main__``)."""
    return load(ROOT / "setup.py", "fleetwire_setup_under_test")


@pytest.fixture
def tool() -> ModuleType:
    return load(ROOT / "tools" / "build_compiled.py", "fleetwire_build_compiled_under_test")


@pytest.mark.parametrize("value", [None, "", "0"])
def test_without_the_switch_the_build_adds_no_extension_and_no_requirement(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    """FLEETWIRE_MYPYC unset, empty or 0: no extension modules, no extra build requirement, for any command."""
    if value is None:
        monkeypatch.delenv("FLEETWIRE_MYPYC", raising=False)
    else:
        monkeypatch.setenv("FLEETWIRE_MYPYC", value)
    for argv in (["setup.py", "egg_info"], ["setup.py", "bdist_wheel"], ["setup.py", "editable_wheel"]):
        assert setup_py.ext_modules(argv) == ([], [])


def test_an_in_place_compiled_build_in_a_checkout_is_refused(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With the switch, build_ext --inplace or an editable install in a git checkout exits naming the way out."""
    (tmp_path / ".git").mkdir()
    monkeypatch.setattr(setup_py, "ROOT", tmp_path)
    monkeypatch.setenv("FLEETWIRE_MYPYC", "1")
    monkeypatch.delenv("FLEETWIRE_MYPYC_INPLACE", raising=False)
    for argv in (["setup.py", "build_ext", "--inplace"], ["setup.py", "editable_wheel", "--dist-dir", "d"]):
        with pytest.raises(SystemExit, match=r"refusing to build in place.*tools/build_compiled\.py"):
            setup_py.ext_modules(argv)


def test_without_mypyc_the_metadata_step_asks_for_mypy_and_a_build_says_how_to_get_it(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No mypyc: egg_info (pip asking the build requirements) answers mypy; a wheel build exits with the command."""
    monkeypatch.setenv("FLEETWIRE_MYPYC", "1")
    monkeypatch.setitem(sys.modules, "mypyc", None)  # import mypyc raises ImportError
    monkeypatch.setitem(sys.modules, "mypyc.build", None)
    assert setup_py.ext_modules(["setup.py", "egg_info"]) == ([], [setup_py.MYPY])
    assert setup_py.ext_modules(["setup.py", "dist_info", "--output-dir", "x"]) == ([], [])
    with pytest.raises(SystemExit, match=r"needs mypyc.*--no-build-isolation"):
        setup_py.ext_modules(["setup.py", "bdist_wheel"])


#: Compiled past the core: the per-plan modules of the SDK and the worker, the frames' write (PERFORMANCE.md §C29g).
EDGE = {"fleetwire/session.py", "fleetwire/stream.py", "fleetwire/submits.py", "worker_agent/runner.py",
        "worker_agent/outbox.py", "wireio/wsmask.py"}  # fmt: skip


def test_the_compiled_modules_are_modules_of_the_pure_core(setup_py: ModuleType, tool: ModuleType) -> None:
    """Each compiled path is a module of coordinator/ outside coordinator/io/, the span exporters' OTLP packing
    (wireio/otlp.py, whose tests run against the build too) or one of the per-plan modules of the SDK and the worker
    (:data:`EDGE`), and the build script reads the list."""
    exporters = {"wireio/otlp.py"}
    assert setup_py.COMPILED, "nothing compiled"
    for path in setup_py.COMPILED:
        assert (ROOT / path).is_file(), path
        if path not in exporters | EDGE:
            assert path.startswith("coordinator/") and not path.startswith("coordinator/io/"), path
    assert exporters <= set(setup_py.COMPILED) and "wireio/span_export.py" not in setup_py.COMPILED  # run as -m
    assert {(ROOT / test).is_file() for test in tool.OTLP_TESTS} == {True}
    # pure on purpose (setup.py says why): compiled, records.py's Structs break; the compat shim is build-time only
    assert not {"coordinator/records.py", "coordinator/mypyc_compat.py"} & set(setup_py.COMPILED)
    assert tool.compiled_modules(ROOT) == [p.removesuffix(".py").replace("/", ".") for p in setup_py.COMPILED]


def test_the_tests_run_against_the_build_hold_those_of_each_module_compiled_past_the_core(tool: ModuleType) -> None:
    """``--test`` runs the core's tests, the OTLP packing's, and the unit tests of the SDK's and the worker's compiled
    modules and wsmask's socket tests."""
    tests = tool.test_files(ROOT)
    for test in ("tests/unit/test_core.py", "tests/unit/test_otlp_encode.py", "tests/unit/test_client_session.py",
                 "tests/unit/test_submits.py", "tests/unit/test_outbox.py", "tests/unit/test_runner_on_loop.py",
                 *tool.WSMASK_TESTS):  # fmt: skip
        assert test in tests and (ROOT / test).is_file(), test
    assert len(tests) == len(set(tests))


def test_the_core_tests_are_the_unit_tests_that_do_no_io(tool: ModuleType) -> None:
    """The list run against the compiled copy holds the core's tests and none that start the SDK or a loop."""
    tests = tool.core_tests(ROOT)
    assert "tests/unit/test_core.py" in tests and "tests/unit/test_read_policy.py" in tests
    assert "tests/unit/test_client_session.py" not in tests  # the SDK
    for path in tests:
        assert not {"asyncio", "fleetwire", "worker_agent"} & {n.split(".")[0] for n in tool.imports_of(ROOT / path)}


def test_without_mypy_extensions_the_compat_decorator_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pure install without mypy: coordinator/mypyc_compat.py's stand-in mypyc_attr leaves a class as it is."""
    monkeypatch.setitem(sys.modules, "mypy_extensions", None)  # import mypy_extensions raises ImportError
    compat = load(ROOT / "coordinator" / "mypyc_compat.py", "fleetwire_mypyc_compat_without_mypy")

    class Plain(list[int]):
        pass

    assert compat.mypyc_attr(native_class=False)(Plain) is Plain
