"""The compiled core's build (setup.py, tools/build_compiled.py): compiled by default where a compiler is present,
pure Python the fallback, never in place in a checkout.

The compiled build itself is run by CI (.ci/run: ``tools/build_compiled.py --wheel --test``, `pip wheel` as an
install runs it, about a minute and a half); these tests check its choices and lists without a compiler.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

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


#: decide()'s table (setup.py): (FLEETWIRE_MYPYC, editable or --inplace, in a git checkout, what the machine lacks)
#: -> (compiles, stops the build, says a warning, a failed compile falls back to pure Python).
DECISIONS = [
    ("", False, True, None, (True, False, False, True)),  # pip install . / pip wheel . with a compiler: compiled
    ("", False, False, "no C compiler", (False, False, True, True)),  # ... without: pure, one warning line
    ("", False, False, "no mypyc", (False, False, True, True)),  # --no-build-isolation without mypy: the same
    ("", True, True, None, (False, False, False, True)),  # pip install -e . (the README's): pure, silently
    ("", True, False, "no C compiler", (False, False, False, True)),
    ("0", False, False, None, (False, False, False, True)),  # forced pure
    ("0", True, True, None, (False, False, False, True)),
    ("1", False, True, None, (True, False, False, False)),  # forced compiled: a failed compile fails the build
    ("1", False, False, "no C compiler", (False, True, False, True)),  # ... and a missing tool stops it
    ("1", True, True, None, (False, True, False, True)),  # editable in a checkout: refused
    ("1", True, False, None, (True, False, False, False)),  # in place outside a checkout (build_compiled's copy)
]


@pytest.mark.parametrize(("switch", "in_place", "checkout", "missing", "expected"), DECISIONS)
def test_the_build_compiles_by_default_where_it_can_and_falls_back_to_pure_python(
    setup_py: ModuleType,
    switch: str,
    in_place: bool,
    checkout: bool,
    missing: str | None,
    expected: tuple[bool, bool, bool, bool],
) -> None:
    """decide(): a non-editable build compiles unless FLEETWIRE_MYPYC=0 or a tool is missing (then pure, with a
    warning); =1 makes a missing tool or a failed compile an error; an editable build stays pure."""
    decision = setup_py.decide(switch, in_place=in_place, checkout=checkout, missing=missing)
    warns = decision.message.startswith(setup_py.WARNING) and not decision.fatal
    assert (decision.compile, decision.fatal, warns, decision.fallback) == expected
    if missing is not None and (warns or decision.fatal):
        assert missing in decision.message


#: The options each call of the stand-in mypycify (:func:`fake_mypyc`) was given.
OPTIONS: list[dict[str, object]] = []


@pytest.fixture
def fake_mypyc(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A stand-in mypyc.build: mypycify records the paths it was given (and its options in :data:`OPTIONS`) and
    returns one "extension" per path (no real compile in a unit test)."""
    calls: list[list[str]] = []
    OPTIONS.clear()
    build = ModuleType("mypyc.build")

    def mypycify(paths: list[str], **options: object) -> list[str]:
        calls.append(paths)
        OPTIONS.append(options)
        return [f"ext:{path}" for path in paths]

    build.mypycify = mypycify  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mypyc.build", build)
    return calls


def _machine(setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, switch: str | None, missing: str | None) -> None:
    if switch is None:
        monkeypatch.delenv("FLEETWIRE_MYPYC", raising=False)
    else:
        monkeypatch.setenv("FLEETWIRE_MYPYC", switch)
    monkeypatch.delenv("FLEETWIRE_MYPYC_INPLACE", raising=False)
    monkeypatch.setattr(setup_py, "toolchain_missing", lambda mypyc=True: missing)
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("switch", [None, ""])
def test_a_wheel_build_compiles_without_the_switch_and_an_editable_one_does_not(
    setup_py: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    fake_mypyc: list[list[str]],
    switch: str | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Switch unset or empty, a compiler present: bdist_wheel gets COMPILED's extensions; an editable install (in
    this git checkout) gets none and says nothing; the metadata step compiles nothing."""
    _machine(setup_py, monkeypatch, switch, None)
    extensions, decision = setup_py.ext_modules(["setup.py", "bdist_wheel", "--dist-dir", "d"])
    assert extensions == [f"ext:{path}" for path in setup_py.COMPILED] and decision.fallback
    assert setup_py.ext_modules(["setup.py", "editable_wheel", "--dist-dir", "d"])[0] == []
    assert setup_py.ext_modules(["setup.py", "egg_info"])[0] == []
    assert fake_mypyc == [list(setup_py.COMPILED)] and capsys.readouterr().err == ""


def test_the_compiled_modules_build_as_one_mypyc_group(
    setup_py: ModuleType, tool: ModuleType, monkeypatch: pytest.MonkeyPatch, fake_mypyc: list[list[str]]
) -> None:
    """All of COMPILED is one mypyc group named GROUP (one extension with the code and mypyc's runtime, a shim a
    module), not an extension a module each with its own copy of the runtime (docs/PERFORMANCE.md §C29i); the build
    script checks the wheel and the copy for the group's library by the name mypyc gives it."""
    _machine(setup_py, monkeypatch, None, None)
    setup_py.ext_modules(["setup.py", "bdist_wheel"])
    (options,) = OPTIONS
    assert (options["separate"], options["group_name"]) == (False, setup_py.GROUP)
    assert tool.group_library(ROOT) == f"{setup_py.GROUP}__mypyc" == "fleetwire__mypyc"
    if importlib.util.find_spec("mypyc") is not None:
        from mypyc.common import shared_lib_name

        assert shared_lib_name(setup_py.GROUP) == tool.group_library(ROOT)


@pytest.mark.parametrize(
    ("compiler_type", "platform", "added"),
    [("unix", "linux", True), ("unix", "darwin", False), ("msvc", "win32", False)],
)
def test_each_extension_is_compiled_with_the_layout_flags_on_linux(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, compiler_type: str, platform: str, added: bool
) -> None:
    """build_ext compiles every extension (the group's library and each shim) with mypyc's flags followed by
    LAYOUT_CFLAGS (no semantic interposition, hidden visibility, no PLT: calls within the group direct,
    docs/PERFORMANCE.md §C29m) where GCC or Clang builds for Linux, and adds nothing elsewhere."""
    from setuptools import Distribution, Extension

    compiled: list[list[str]] = []
    monkeypatch.setattr(setup_py.build_ext, "build_extension", lambda _, ext: compiled.append(ext.extra_compile_args))
    monkeypatch.setattr(setup_py.sys, "platform", platform)
    command = setup_py.BuildExt(Distribution())
    command.compiler = SimpleNamespace(compiler_type=compiler_type)
    command.build_extension(Extension("fleetwire__mypyc", ["build/__native_fleetwire.c"], extra_compile_args=["-O1"]))
    expected = ["-O1", "-fno-semantic-interposition", "-fvisibility=hidden", "-fno-plt"] if added else ["-O1"]
    assert compiled == [expected]


@pytest.mark.parametrize("missing", ["no C compiler ('cc' is not on PATH)", "no Python headers", "no mypyc"])
def test_without_a_tool_a_wheel_build_is_pure_python_with_one_warning_line(
    setup_py: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    fake_mypyc: list[list[str]],
    missing: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No compiler, no headers or no mypyc: the default build goes on with no extension and prints one warning
    line naming what is missing; FLEETWIRE_MYPYC=1 stops the build with it instead."""
    _machine(setup_py, monkeypatch, None, missing)
    assert setup_py.ext_modules(["setup.py", "bdist_wheel"])[0] == []
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fleetwire build: warning: pure Python") and missing in line
    monkeypatch.setenv("FLEETWIRE_MYPYC", "1")
    with pytest.raises(SystemExit, match=r"FLEETWIRE_MYPYC=1 needs what this machine lacks"):
        setup_py.ext_modules(["setup.py", "bdist_wheel"])
    assert fake_mypyc == []


def test_switch_0_builds_pure_python_even_with_a_compiler(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, fake_mypyc: list[list[str]]
) -> None:
    """FLEETWIRE_MYPYC=0: no extension for any command, and mypy is not asked into the build environment."""
    _machine(setup_py, monkeypatch, "0", None)
    for argv in (["setup.py", "egg_info"], ["setup.py", "bdist_wheel"], ["setup.py", "editable_wheel"]):
        assert setup_py.ext_modules(argv)[0] == []
    assert setup_py.compile_requires(editable=False) == [] and fake_mypyc == []


def test_a_failed_mypyc_run_falls_back_by_default_and_fails_when_forced(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """mypyc exiting (a type error, say) leaves a default build pure with a warning; with FLEETWIRE_MYPYC=1 the
    build fails."""
    build = ModuleType("mypyc.build")

    def mypycify(paths: list[str], **_: object) -> list[str]:
        raise SystemExit(1)

    build.mypycify = mypycify  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mypyc.build", build)
    _machine(setup_py, monkeypatch, None, None)
    assert setup_py.ext_modules(["setup.py", "bdist_wheel"])[0] == []
    assert "fleetwire build: warning: pure Python, not the compiled core: mypyc failed" in capsys.readouterr().err
    monkeypatch.setenv("FLEETWIRE_MYPYC", "1")
    with pytest.raises(SystemExit):
        setup_py.ext_modules(["setup.py", "bdist_wheel"])


@pytest.mark.parametrize("fallback", [True, False])
def test_a_failed_c_compile_leaves_a_pure_wheel_unless_forced(
    setup_py: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    fallback: bool,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The C compile failing: by default the extensions built so far are removed, a wheel being built is tagged pure
    (py3-none-any) and one warning line says so; with FLEETWIRE_MYPYC=1 the error ends the build."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext
    from setuptools.errors import CompileError

    dist = Distribution({"name": "x", "ext_modules": [Extension("pkg.mod", ["pkg/mod.c"])]})
    wheel = type("Wheel", (), {"root_is_pure": False})()
    dist.command_obj["bdist_wheel"] = wheel
    command = setup_py.BuildExt(dist)
    command.fallback = fallback
    command.build_lib = str(tmp_path)
    command.ensure_finalized()
    built = Path(command.get_ext_fullpath("pkg.mod"))
    built.parent.mkdir(parents=True)

    def compile_half(self: object) -> None:
        built.write_bytes(b"half")
        raise CompileError("command 'gcc' failed: No such file or directory")

    monkeypatch.setattr(build_ext, "run", compile_half)
    if not fallback:
        with pytest.raises(CompileError):
            command.run()
        return
    command.run()
    assert not built.exists() and wheel.root_is_pure
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("fleetwire build: warning: pure Python") and "command 'gcc' failed" in line


def test_mypy_joins_an_isolated_build_only_where_the_wheel_compiles(
    setup_py: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend's requirements: mypy and the packages mypyc type-checks against for a wheel where a compiler is
    present; nothing more for an editable install or without a compiler (the README's `pip install -e` fetches no
    mypy)."""
    _machine(setup_py, monkeypatch, None, None)
    requires = setup_py.compile_requires(editable=False)
    assert requires[0] == setup_py.MYPY and {"msgspec>=0.19", "opentelemetry-sdk>=1.30"} <= set(requires)
    assert setup_py.compile_requires(editable=True) == []
    monkeypatch.setattr(setup_py, "toolchain_missing", lambda mypyc=True: "no C compiler")
    assert setup_py.compile_requires(editable=False) == []
    monkeypatch.setenv("FLEETWIRE_MYPYC", "1")  # forced but lacking a compiler: the build says so, mypy or not
    assert setup_py.compile_requires(editable=False) == []


def test_pyproject_builds_through_setup_py_s_hooks(setup_py: ModuleType) -> None:
    """pyproject.toml's backend is setup.py (in the tree), which has every PEP 517/660 hook setuptools has."""
    import tomllib

    from setuptools import build_meta

    system = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert (system["build-backend"], system["backend-path"]) == ("setup", ["."])
    hooks = [name for name in ("build_wheel", "build_sdist", "build_editable", "get_requires_for_build_wheel",
                               "get_requires_for_build_sdist", "get_requires_for_build_editable",
                               "prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable")
             if hasattr(build_meta, name)]  # fmt: skip
    assert len(hooks) == 8 and all(callable(getattr(setup_py, name)) for name in hooks)
    assert set(hooks) == set(setup_py.__all__)


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


def test_build_info_tells_a_compiled_install_from_a_pure_one(tmp_path: Path) -> None:
    """`python -m fleetwire.build_info` counts the modules imported from an extension (not mypyc's runtimes, not an
    extension of another Python); this checkout is pure."""
    from importlib.machinery import EXTENSION_SUFFIXES

    from fleetwire import build_info

    suffix = EXTENSION_SUFFIXES[0]
    (tmp_path / "coordinator" / "placement").mkdir(parents=True)
    for name in ("core", "core__mypyc", "placement/placer", "journal.cpython-39-x86_64-linux-gnu"):
        (tmp_path / "coordinator" / f"{name}{suffix if '.' not in name else '.so'}").write_bytes(b"")
    (tmp_path / "coordinator" / "plans.py").write_text("")
    modules = build_info.compiled_modules([("coordinator", tmp_path / "coordinator")])
    assert list(modules) == ["coordinator.core", "coordinator.placement.placer"]
    assert "compiled core, 2 modules" in build_info.describe(modules)
    assert build_info.compiled_modules() == {}
    done = subprocess.run([sys.executable, "-m", "fleetwire.build_info"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.startswith("fleetwire ") and "pure Python (no compiled modules)" in done.stdout


#: Compiled past the core: the per-plan modules of the SDK and the worker, the frames' write (PERFORMANCE.md §C29g),
#: a PostgreSQL coordinator's group rows (§C29j).
EDGE = {"fleetwire/session.py", "fleetwire/stream.py", "fleetwire/submits.py", "worker_agent/runner.py",
        "worker_agent/outbox.py", "wireio/wsmask.py", "coordinator/io/stores/pg_rows.py"}  # fmt: skip


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
