"""The build: pure Python by default; ``FLEETWIRE_MYPYC=1`` compiles the core's per-plan modules (and the span
exporter's OTLP packing) with mypyc.

Everything about the package is in pyproject.toml; this file only adds the optional compiled modules
(docs/OPERATIONS.md §The compiled core). Without ``FLEETWIRE_MYPYC=1`` (unset, empty or ``0``) it adds
nothing: the install is pure Python and needs no compiler, as before this file existed. With it, the
modules of :data:`COMPILED` are compiled by mypyc (it comes with mypy) into C extensions placed next
to their ``.py`` sources, and Python imports an extension before the source of the same name::

    FLEETWIRE_MYPYC=1 pip install .                    # pip puts mypy into its build environment
    FLEETWIRE_MYPYC=1 pip install --no-build-isolation .   # or uses this one's (mypy, setuptools, wheel)

A C compiler and Python's headers are needed then. An editable install or ``build_ext --inplace`` in a
git checkout is refused with the switch on: the extensions would shadow the sources for everyone
working in that tree. ``python tools/build_compiled.py DEST`` builds a copy instead (CI does).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
SWITCH = "FLEETWIRE_MYPYC"
MYPY = "mypy>=1.11"
#: Set by tools/build_compiled.py, which builds in place in a copy of the tree, never in the checkout.
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
    "fleetwire/session.py", "fleetwire/stream.py", "fleetwire/submits.py",  # the SDK's per-plan path
    "worker_agent/runner.py", "worker_agent/outbox.py",  # the worker's
    "wireio/wsmask.py",  # every process's frame writes
)


def switched_on() -> bool:
    """Whether this build compiles (``FLEETWIRE_MYPYC`` set, and not to ``0``)."""
    return os.environ.get(SWITCH, "") not in ("", "0")


def builds(argv: list[str]) -> bool:
    """Whether ``argv`` runs a build (not only metadata, which pip asks for first and needs no extension)."""
    return any(arg in ("build", "build_ext", "bdist_wheel", "install", "develop", "editable_wheel") for arg in argv[1:])


def builds_in_place(argv: list[str]) -> bool:
    """Whether the commands of ``argv`` put the extensions next to the sources (editable or ``--inplace``)."""
    return any(arg in ("--inplace", "-i", "develop", "editable_wheel") for arg in argv[1:])


class BuildExt(build_ext):
    """build_ext compiling the modules' C files on every core unless told ``--parallel``."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1


def ext_modules(argv: list[str]) -> tuple[list[object], list[str]]:
    """The compiled extensions and the extra build requirements, both empty without the switch."""
    if not switched_on():
        return [], []
    if not builds(argv):
        try:
            import mypyc  # noqa: F401
        except ImportError:  # setuptools.build_meta asking for the build requirements (egg_info): mypy is one
            return [], [MYPY] if "egg_info" in argv[1:] else []
        return [], []
    if builds_in_place(argv) and (ROOT / ".git").exists() and not os.environ.get(INPLACE_OK):
        sys.exit(f"{SWITCH}=1: refusing to build in place in the checkout {ROOT} (the extensions would shadow "
                 f"the sources for every test run there): `python tools/build_compiled.py DEST` builds a copy, "
                 f"`{SWITCH}=1 pip install .` (not -e) an install")
    try:
        from mypyc.build import mypycify
    except ImportError:
        sys.exit(f"{SWITCH}=1 needs mypyc, which comes with mypy: `pip install '{MYPY}' setuptools wheel`, then "
                 f"`{SWITCH}=1 pip install --no-build-isolation .` (or let pip build in isolation: drop the flag)")
    os.chdir(ROOT)  # mypyc takes the paths and pyproject.toml's [tool.mypy] from the working directory
    # -O1: the same instructions per plan as mypyc's default -O3 (bench/core_per_plan.py), in less build time.
    # separate: one extension per module, so their C files compile in parallel.
    return list(mypycify(list(COMPILED), opt_level=os.environ.get("MYPYC_OPT_LEVEL", "1"), separate=True)), []


if __name__ == "__main__":
    extensions, requires = ext_modules(sys.argv)
    setup(ext_modules=extensions, setup_requires=requires, cmdclass={"build_ext": BuildExt} if extensions else {})
