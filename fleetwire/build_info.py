"""Which build of fleetwire is installed: the compiled core (mypyc's C extensions beside the sources) or pure Python.

A non-editable install compiles the core's per-plan modules where a C compiler is present and falls back to pure
Python where it is not (setup.py; docs/OPERATIONS.md §The compiled core). An operator tells which one a host runs::

    python -m fleetwire.build_info       # fleetwire 0.1.0: compiled core, 37 modules from C extensions (mypyc)
    python -m fleetwire.build_info -v    # ... and each module with its file

It looks for extension files in the packages' directories (Python imports an extension before the ``.py`` source of
the same name); it imports none of the packages it looks at.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Iterable
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

#: fleetwire's top-level packages (pyproject.toml's packages).
PACKAGES = ("protocol", "wireio", "coordinator", "worker_agent", "fleetwire")


def package_dirs(packages: Iterable[str] = PACKAGES) -> list[tuple[str, Path]]:
    """Each package's name and directory, as the import system finds them (found, not imported)."""
    found = []
    for package in packages:
        spec = importlib.util.find_spec(package)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            found.append((package, Path(location)))
    return found


def compiled_modules(dirs: Iterable[tuple[str, Path]] | None = None) -> dict[str, Path]:
    """The modules imported from a C extension, by dotted name, with the extension's path. mypyc's per-module runtime
    libraries (``NAME__mypyc.*.so``) are no module of the package and are not counted."""
    found: dict[str, Path] = {}
    for package, root in package_dirs() if dirs is None else dirs:
        for path in sorted(root.rglob("*")):
            suffix = next((s for s in EXTENSION_SUFFIXES if path.name.endswith(s)), None)
            if suffix is None or not path.is_file():
                continue
            stem = path.name.removesuffix(suffix)
            if stem.endswith("__mypyc") or "." in stem:
                continue
            parts = path.parent.relative_to(root).parts
            found[".".join((package, *parts, stem))] = path
    return dict(sorted(found.items()))


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("fleetwire")
    except PackageNotFoundError:
        return "0+unknown"


def describe(modules: dict[str, Path]) -> str:
    """One line: the version and the build."""
    if not modules:
        return f"fleetwire {version()}: pure Python (no compiled modules)"
    return f"fleetwire {version()}: compiled core, {len(modules)} modules from C extensions (mypyc)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fleetwire.build_info",
        description="Which build of fleetwire is installed: compiled or pure Python.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="list the compiled modules and their files")
    ns = parser.parse_args(argv)
    modules = compiled_modules()
    print(describe(modules))
    if ns.verbose:
        for name, path in modules.items():
            print(f"  {name}  {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
