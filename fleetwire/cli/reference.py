"""The configuration reference of docs/OPERATIONS.md, generated from the ``fleetwire`` parser.

    python -m fleetwire.cli.reference                          # print the generated section
    python -m fleetwire.cli.reference --write docs/OPERATIONS.md   # replace it in the file
    python -m fleetwire.cli.reference --check docs/OPERATIONS.md   # exit 1 when the file is stale

The section lies between :data:`BEGIN` and :data:`END`. Defaults are rendered with every
``FLEETWIRE_*`` variable unset, so the page shows the built-in defaults, never this machine's
environment (or its secrets).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final
from unittest import mock

__all__ = ["BEGIN", "END", "generate", "splice"]

BEGIN: Final = (
    "<!-- BEGIN GENERATED: configuration reference (python -m fleetwire.cli.reference --write docs/OPERATIONS.md) -->"
)
END: Final = "<!-- END GENERATED -->"


def _subcommands(
    parser: argparse.ArgumentParser, prefix: str = "fleetwire"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _subcommands(sub, f"{prefix} {name}")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return "off" if action.default is False else "on"
    value: Any = action.default
    if value is None or value == argparse.SUPPRESS:
        return "-"
    if isinstance(value, list) and not value:
        return "-"
    if isinstance(value, str) and not value:
        return '""'
    return f"`{value}`"


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{name}`" for name in action.option_strings)
    if action.option_strings and action.nargs != 0:
        metavar = action.metavar or (action.dest.upper() if not action.choices else None)
        if action.choices and not action.metavar:
            metavar = "{" + ",".join(map(str, action.choices)) + "}"
        names += f" {_cell(str(metavar))}"
    return names or f"`{action.metavar or action.dest}` (positional)"


def generate(parser: argparse.ArgumentParser | None = None) -> str:
    """The markdown of the reference section (without the markers)."""
    if parser is None:
        with mock.patch.dict(os.environ, {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")},
                             clear=True):
            from fleetwire.cli.main import build_parser

            parser = build_parser()
    out: list[str] = []
    for command, sub in _subcommands(parser):
        rows = [a for a in sub._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)
                and a.help != argparse.SUPPRESS]  # hidden aliases (e.g. submit --tag) stay out of the docs
        out.append(f"### `{command}`\n")
        if sub.description:
            out.append(_cell(sub.description) + "\n")
        if not rows:
            continue
        out.append("| Flag | Default | Meaning |")
        out.append("|---|---|---|")
        for action in rows:
            out.append(f"| {_flag(action)} | {_default(action)} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def splice(document: str, section: str) -> str:
    """``document`` with the text between :data:`BEGIN` and :data:`END` replaced by ``section``.

    Raises:
        ValueError: the markers are missing (the END looked for is the first after BEGIN: a document may hold
            other generated sections, tests/docgen.py's).
    """
    start = document.find(BEGIN)
    end = document.find(END, start)
    if start < 0 or end < 0:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} section")
    return document[: start + len(BEGIN)] + "\n\n" + section + "\n" + document[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fleetwire.cli.reference", description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="MD", help="replace the generated section of this file")
    group.add_argument("--check", metavar="MD", help="exit 1 if this file's generated section is stale")
    ns = parser.parse_args(argv)
    section = generate()
    path = Path(ns.write or ns.check or "")
    if ns.write:
        path.write_text(splice(path.read_text(), section))
    elif ns.check:
        if splice(path.read_text(), section) != path.read_text():
            print(f"{path}: the configuration reference is stale; run python -m fleetwire.cli.reference --write {path}",
                  file=sys.stderr)
            return 1
    else:
        print(section, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
