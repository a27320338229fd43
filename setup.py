"""The build, and its PEP 517 backend: the core's per-plan modules compiled with mypyc where a compiler is present,
pure Python the fallback (docs/OPERATIONS.md §The compiled core).

Everything about the package is in pyproject.toml; this file only adds the compiled modules. A non-editable build
(``pip install .``, ``pip wheel .``, ``python -m build``) compiles the modules of :data:`COMPILED` with mypyc (it
comes with mypy) into C extensions, which Python imports before the ``.py`` sources of the same name, when a C
compiler and Python's headers are present. Without them, or mypyc, or when the compile fails, the build prints one
warning line (``fleetwire build: warning: ...``; pip shows a build's output with ``-v``) and goes on pure Python, the
wheel then ``py3-none-any``. ``FLEETWIRE_MYPYC`` overrides the choice::

    pip install .                           # compiled where it can be, else pure Python and one warning line
    FLEETWIRE_MYPYC=0 pip install .         # pure Python, no compiler asked for (a wheel for any platform)
    FLEETWIRE_MYPYC=1 pip install .         # compiled, or the build fails saying why
    pip install --no-build-isolation .      # this environment's mypy (absent: pure Python, the warning line)
    python -m fleetwire.build_info          # afterwards: which build is installed

An editable install (``pip install -e .``, the README's commands) stays pure Python: extensions next to the sources
would shadow them for everyone working in the tree, so there ``FLEETWIRE_MYPYC=1`` is refused in a git checkout, and
``python tools/build_compiled.py DEST`` builds a compiled copy instead (CI does). :func:`decide` makes the choice.

mypy gets into an isolated build environment through this module's backend hooks (pyproject.toml's ``build-backend``
names this file; they are setuptools.build_meta's, :func:`get_requires_for_build_wheel` and
:func:`get_requires_for_build_editable` aside): a wheel build asks for mypy, and for the packages the compiled modules
import (mypyc type-checks against them), when it would compile; an editable one does not, so the README's
``pip install -e`` fetches no compiler tooling.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any, NamedTuple

from setuptools import setup
from setuptools.build_meta import (
    build_editable,
    build_sdist,
    build_wheel,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)
from setuptools.command.build_ext import build_ext
from setuptools.errors import BaseError, CCompilerError

#: The PEP 517 hooks (pyproject.toml's ``build-backend = "setup"``): setuptools.build_meta's, with the two that name
#: the build requirements asking for mypy where the build compiles.
__all__ = ["build_editable", "build_sdist", "build_wheel", "get_requires_for_build_editable",
           "get_requires_for_build_sdist", "get_requires_for_build_wheel", "prepare_metadata_for_build_editable",
           "prepare_metadata_for_build_wheel"]  # fmt: skip

ROOT = Path(__file__).resolve().parent
SWITCH = "FLEETWIRE_MYPYC"
MYPY = "mypy>=1.11"
#: Set by tools/build_compiled.py, which builds in place in a copy of the tree, never in the checkout: such a build
#: compiles as a non-editable one does.
INPLACE_OK = "FLEETWIRE_MYPYC_INPLACE"
#: The modules compiled: those the core runs for every plan (``python bench/core_per_plan.py --profile``:
#: each is called at least once per no-op plan), and those whose objects it reads on every plan (``sessions``,
#: ``state``: compiled, their classes are native, and a field read is a C struct read, not an attribute
#: lookup). The rest of the core is seldom on that path and stays pure, and so does ``coordinator/records.py``,
#: a per-plan module (compiled, its msgspec Structs' annotations read as ``type``, and the store's decoder then
#: refuses every optional field; its journal, which is per-plan, is journal.py). ``coordinator/mypyc_compat.py``
#: is never compiled. The span exporter children's OTLP packing (``wireio/otlp.py``; the child is wireio/span_export.py,
#: run as ``-m``: pure) compiles too, for ~12-20 % fewer instructions a span there (docs/PERFORMANCE.md §T32i). Past the
#: core, the per-plan modules of the other processes that compile and keep their behaviour (docs/PERFORMANCE.md §C29g):
#: the SDK's session, streams and submit batches, the worker's runner and outbox, the frames' write (wireio/wsmask.py).
#: Left pure, tried: the coordinator's driver (coordinator/io/frontdoor/core_driver.py: a test replaces a method of a
#: driver, which a native class refuses), the writer pipes and wire (compiled, the writer process's answers were
#: misread), sqlite_commit.py (SQLiteStore, pure, derives from its class), writer_child.py (a msgspec field default
#: that mypyc types), protocol/codec.py (a ``Union[...]`` made at run time), worker_agent/handlers.py (its decorator
#: marks functions), fleetwire/client.py (the SDK's driver; users may derive from Client) and wireio/wsbulk.py
#: (websockets derives its connection classes at run time); worker_agent/agent.py was not tried alone.
COMPILED = tuple(f"coordinator/{name}.py" for name in (  # noqa: RUF005  (a sum: tools/build_compiled.py reads it)
    "capacity", "carbon_holds", "client_session", "core", "effects", "journal", "ledger", "limits", "plan_graphs",
    "plans", "recovery", "registry", "retention", "scheduling", "sessions", "sharing", "state", "stats", "streams",
    "teams", "workers", "graphs/graph", "placement/fair_queue", "placement/fairshare", "placement/placer",
    "placement/plan_queue", "placement/shares", "worker_sessions/dispatch", "worker_sessions/leases",
)) + ("wireio/otlp.py",) + (
    # The SDK's per-plan path, then the worker's: a lone round trip reads the same with them pure (PERFORMANCE.md §C29i)
    "fleetwire/session.py", "fleetwire/stream.py", "fleetwire/submits.py",
    "worker_agent/runner.py", "worker_agent/outbox.py",
    "wireio/wsmask.py",  # every process's frame writes
    "coordinator/io/stores/pg_rows.py",  # a PostgreSQL coordinator's group rows (docs/PERFORMANCE.md §C29j)
)

#: The one mypyc group all of :data:`COMPILED` is built as: one extension, ``fleetwire__mypyc`` (top level), holds
#: their code and mypyc's runtime, and each module of COMPILED gets a small shim extension of its own name that
#: imports it. Built a module a group (``separate=True``, as before), each extension carried its own copy of the
#: runtime: 7.97 MB of code in all against 3.75 MB, and more L1i misses in every process (docs/PERFORMANCE.md §C29i).
GROUP = "fleetwire"

#: Added to the C flags of every compiled extension where the compiler is GCC's or Clang's on Linux
#: (:func:`layout_cflags`). Without them each call from one of the group's C files to a function of another (the
#: modules' code and mypyc's runtime are several files) and every call into libpython went through a PLT stub, and
#: every function of the group's code was exported: 62,486 PLT calls in the group's text. With them those calls are
#: direct (or through the GOT, into libpython) and only the modules' init functions are exported: text 3.75 -> 3.36 MB,
#: a lone round trip's coordinator -4.7 % instructions and -9 % L1i misses (docs/PERFORMANCE.md §C29m).
LAYOUT_CFLAGS = ("-fno-semantic-interposition", "-fvisibility=hidden", "-fno-plt")


def layout_cflags(compiler_type: str, platform: str | None = None) -> list[str]:
    """:data:`LAYOUT_CFLAGS` for a Unix compiler (GCC, Clang) on Linux (``platform``: ``sys.platform``'s); nothing
    elsewhere (MSVC has flags of its own, and Mach-O no PLT)."""
    linux = (platform or sys.platform).startswith("linux")
    return list(LAYOUT_CFLAGS) if compiler_type == "unix" and linux else []


def builds(argv: list[str]) -> bool:
    """Whether ``argv`` runs a build (not only metadata, which pip asks for first and needs no extension)."""
    return any(arg in ("build", "build_ext", "bdist_wheel", "install", "develop", "editable_wheel") for arg in argv[1:])


def builds_in_place(argv: list[str]) -> bool:
    """Whether the commands of ``argv`` put the extensions next to the sources (editable or ``--inplace``)."""
    return any(arg in ("--inplace", "-i", "develop", "editable_wheel") for arg in argv[1:])


def in_checkout() -> bool:
    """Whether this tree is a git checkout, where no extension may be built next to the sources (tools/build_compiled.py
    builds in a copy and says so)."""
    return (ROOT / ".git").exists() and not os.environ.get(INPLACE_OK)


def toolchain_missing(*, mypyc: bool = True) -> str | None:
    """Why this machine cannot compile the extensions (no C compiler, no Python.h, with ``mypyc`` no mypyc), or None."""
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]  # as build_ext takes it
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler!r} is not on PATH; Debian: apt-get install gcc)"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        return f"no Python headers ({include}/Python.h; Debian: apt-get install python3-dev)"
    if mypyc and importlib.util.find_spec("mypyc") is None:
        return (f"no mypyc, which comes with mypy (pip install '{MYPY}' setuptools wheel before --no-build-isolation; "
                f"or let pip build in isolation: drop the flag)")
    return None


class Decision(NamedTuple):
    """What a build does: compile or not, and what it says."""

    compile: bool
    #: One line for the build's output: a warning when a default build goes on pure Python, or, with ``fatal``, why
    #: the build stops. Empty: nothing to say.
    message: str = ""
    fatal: bool = False
    #: Whether a compile that fails goes on pure Python (the default) or fails the build (``FLEETWIRE_MYPYC=1``).
    fallback: bool = True


WARNING = "fleetwire build: warning: pure Python, not the compiled core"


def decide(switch: str, *, in_place: bool, checkout: bool, missing: str | None) -> Decision:
    """The build's choice, from ``FLEETWIRE_MYPYC`` (``switch``), whether the build is editable or ``--inplace``,
    whether the tree is a git checkout, and what the machine lacks to compile (:func:`toolchain_missing`).

    ======================  =========================================  =============================================
    ``FLEETWIRE_MYPYC``     non-editable build (pip install ., wheel)  editable / ``--inplace``
    ======================  =========================================  =============================================
    unset or empty          compiled; lacking a tool: pure + warning   pure
    ``0``                   pure                                       pure
    anything else (``1``)   compiled; lacking a tool: fails            in a git checkout: refused; else compiled
    ======================  =========================================  =============================================

    A compile that fails falls back to pure Python (with the warning) unless the switch forced it.
    """
    if switch == "0":
        return Decision(False, f"fleetwire build: pure Python ({SWITCH}=0)")
    forced = switch != ""
    if in_place and not forced:
        return Decision(False)  # development: pure, as the sources are
    if in_place and checkout:
        return Decision(False, f"{SWITCH}={switch}: refusing to build in place in the checkout {ROOT} (the extensions "
                               f"would shadow the sources for every test run there): `python tools/build_compiled.py "
                               f"DEST` builds a copy, `pip install .` (not -e) an install", fatal=True)
    if missing is not None:
        if forced:
            return Decision(False, f"{SWITCH}={switch} needs what this machine lacks: {missing}", fatal=True)
        return Decision(False, f"{WARNING}: {missing} ({SWITCH}=0 silences this, =1 makes it an error)")
    return Decision(True, fallback=not forced)


def typecheck_requires() -> list[str]:
    """pyproject.toml's dependencies and its ``otel`` extra: mypyc type-checks the packages, which import them
    (the tracing modules import OpenTelemetry when it is on), and a missing one is an error, so an isolated build
    environment needs them besides mypy (pip fetches the dependencies once for both)."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["otel"]]


def compile_requires(*, editable: bool) -> list[str]:
    """What an isolated build environment needs beyond setuptools: mypy and :func:`typecheck_requires` where this
    build compiles, else nothing (where a compiler or the headers are missing, mypy would not help)."""
    decision = decide(os.environ.get(SWITCH, ""), in_place=editable, checkout=in_checkout(),
                      missing=toolchain_missing(mypyc=False))  # fmt: skip
    return [MYPY, *typecheck_requires()] if decision.compile else []


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    """PEP 517: setuptools' build requirements, and mypy's where the wheel compiles (:func:`compile_requires`)."""
    from setuptools import build_meta

    return [*build_meta.get_requires_for_build_wheel(config_settings), *compile_requires(editable=False)]


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    """PEP 660: setuptools' build requirements (an editable install compiles only with ``FLEETWIRE_MYPYC=1``, outside
    a git checkout)."""
    from setuptools import build_meta

    return [*build_meta.get_requires_for_build_editable(config_settings), *compile_requires(editable=True)]


class BuildExt(build_ext):
    """build_ext compiling the modules' C files on every core unless told ``--parallel``; with :attr:`fallback`, a
    failed compile leaves the build pure Python, with the warning line, instead of failing it."""

    #: Set from :attr:`Decision.fallback` before setup() runs.
    fallback = False

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extension(self, ext: Any) -> None:
        ext.extra_compile_args = [*(ext.extra_compile_args or []), *layout_cflags(self.compiler.compiler_type)]
        super().build_extension(ext)

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, BaseError, OSError) as exc:
            if not self.fallback:
                raise
            self.fall_back(exc)

    def fall_back(self, exc: Exception) -> None:
        """Remove what the failed compile built (compiled modules import one another's extensions: a part of them
        would not import), and tag a wheel being built pure Python's (``py3-none-any``)."""
        for ext in self.extensions:
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
        wheel = self.distribution.command_obj.get("bdist_wheel")
        if wheel is not None:
            wheel.root_is_pure = True
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        first = first if len(first) <= 160 else f"{first[:160]}..."  # a compiler's command line runs long
        print(f"{WARNING}: the compile failed ({first}; {SWITCH}=1 makes this an error)", file=sys.stderr)


def ext_modules(argv: list[str]) -> tuple[list[Any], Decision]:
    """The compiled extensions of the build ``argv`` runs (none for a metadata command), and the decision."""
    if not builds(argv):
        return [], Decision(False)
    decision = decide(os.environ.get(SWITCH, ""), in_place=builds_in_place(argv), checkout=in_checkout(),
                      missing=toolchain_missing())  # fmt: skip
    if decision.fatal:
        sys.exit(decision.message)
    if decision.message:
        print(decision.message, file=sys.stderr)
    if not decision.compile:
        return [], decision
    from mypyc.build import mypycify

    os.chdir(ROOT)  # mypyc takes the paths and pyproject.toml's [tool.mypy] from the working directory
    try:
        # -O1: the same instructions per plan as mypyc's default -O3 (bench/core_per_plan.py), in less build time.
        # One group (:data:`GROUP`): one copy of mypyc's runtime, not one a module (docs/PERFORMANCE.md §C29i).
        extensions = mypycify(list(COMPILED), opt_level=os.environ.get("MYPYC_OPT_LEVEL", "1"), separate=False,
                              group_name=GROUP)  # fmt: skip
    except SystemExit as exc:  # mypyc's type check or its translation failed; it printed why
        if not decision.fallback:
            raise
        print(f"{WARNING}: mypyc failed (exit {exc.code}; {SWITCH}=1 makes this an error)", file=sys.stderr)
        return [], decision
    return list(extensions), decision


if __name__ == "__main__":
    extensions, chosen = ext_modules(sys.argv)
    BuildExt.fallback = chosen.fallback
    setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt} if extensions else {})
