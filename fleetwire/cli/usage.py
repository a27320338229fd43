"""``fleetwire usage``: who used what of the fleet (the coordinator's usage ledger, docs/SEMANTICS.md §Usage ledger).

    fleetwire usage                      # by principal, all time: a table
    fleetwire usage --by team --since 24h
    fleetwire usage --json               # one JSON document: {"by", "since", "rows": [...]}
    fleetwire usage --csv > usage.csv    # one row per principal (or team), with a header

An admin token sees every principal's usage; a client token its own (``$FLEETWIRE_ADMIN_TOKEN``
when set, else ``$FLEETWIRE_TOKEN``, as ``fleetwire status``). ``--since`` counts whole hours: the
ledger keeps usage per hour, so ``--since 90m`` starts at the top of the hour 90 minutes ago.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, Final

import msgspec

from fleetwire.cli.console import EXIT_OK, EXIT_USAGE, connect, make_console, print_table
from protocol.messages import Usage, UsageTotals

__all__ = ["COLUMNS", "add_usage_command", "parse_since"]

Target = Callable[[argparse.Namespace], tuple[str, str | None]]

#: The rows' fields, in the order the table and the CSV show them.
COLUMNS: Final = (
    "name", "team", "succeeded", "failed", "cancelled", "slot_seconds", "gpu_seconds", "tokens", "joules", "co2e_g",
    "avoided_co2e_g", "preemptions",
)  # fmt: skip
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 7 * 86_400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")


def parse_since(value: str, now: float) -> float:
    """``--since``: a duration back from ``now`` (``24h``, ``90m``, ``7d``, ``3600``: seconds) as Unix seconds;
    ``all`` or ``0``: 0 (all time).

    Raises:
        ValueError: not a duration, naming the value.
    """
    if value.strip().lower() in ("all", "0"):
        return 0.0
    found = _DURATION.match(value)
    if found is None:
        raise ValueError(f"--since {value!r} is not a duration: give e.g. 24h, 90m, 7d or seconds (all: all time)")
    return max(0.0, now - float(found.group(1)) * _UNITS[found.group(2) or "s"])


def _row(row: UsageTotals) -> dict[str, Any]:
    return {name: getattr(row, name) for name in COLUMNS}


def print_usage(reply: Usage, *, as_json: bool, as_csv: bool) -> None:
    """Print a ``usage`` reply: a table, one JSON document, or CSV with a header."""
    if as_json:
        doc = {"by": reply.by, "since": reply.since, "rows": [_row(r) for r in reply.rows]}
        print(msgspec.json.encode(doc).decode(), flush=True)
        return
    columns = COLUMNS if reply.by == "principal" else tuple(c for c in COLUMNS if c != "team")
    if as_csv:
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        for r in reply.rows:
            row = _row(r)
            writer.writerow([row[c] for c in columns])
        return
    from rich.table import Table

    console = make_console()
    if not reply.rows:
        console.print("no usage recorded" + (" since then" if reply.since else ""), markup=False)
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    heads = {"name": reply.by.upper(), "slot_seconds": "SLOT-S", "gpu_seconds": "GPU-S", "co2e_g": "GCO2E",
             "avoided_co2e_g": "AVOIDED-G", "joules": "J", "preemptions": "PREEMPTED"}  # fmt: skip
    for column in columns:
        table.add_column(heads.get(column, column.upper()), justify="left" if column in ("name", "team") else "right")
    for r in reply.rows:
        row = _row(r)
        table.add_row(*(_cell(row[c]) for c in columns))
    print_table(console, table)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value) or "-"


async def _usage(ns: argparse.Namespace, target: Target) -> int:
    if ns.json and ns.csv:
        print("fleetwire: error: --json and --csv: give one of them", file=sys.stderr)
        return EXIT_USAGE
    try:
        since = parse_since(ns.since, time.time()) if ns.since else 0.0
    except ValueError as exc:
        print(f"fleetwire: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    url, token = target(ns)
    async with connect(url, token) as client:
        reply = await client.usage(by=ns.by, since=since)
    print_usage(reply, as_json=ns.json, as_csv=ns.csv)
    return EXIT_OK


def add_usage_command(
    sub: Any, *, common: argparse.ArgumentParser, admin_client: argparse.ArgumentParser, target: Target
) -> None:
    """Add ``usage`` to the ``fleetwire`` subparsers (``target`` reads the URL and ``--token`` from parsed flags)."""

    def admin_target(ns: argparse.Namespace) -> tuple[str, str | None]:
        url, token = target(ns)
        admin = os.environ.get("FLEETWIRE_ADMIN_TOKEN")
        return url, (token if ns.token or not admin else admin)

    p = sub.add_parser("usage", parents=[common, admin_client], help="who used what of the fleet (the usage ledger)",
                       description="Usage totals from the coordinator's ledger: plans by outcome, slot- and "
                                   "GPU-seconds, tokens, joules, gCO2e, gCO2e avoided by waiting for a greener hour "
                                   "and preemptions, by principal or team. An admin token sees everyone's, a client "
                                   "token its own. Uses $FLEETWIRE_ADMIN_TOKEN when set, else $FLEETWIRE_TOKEN.")
    p.add_argument("--by", choices=("principal", "team"), default="principal", help="rows per principal or team")
    p.add_argument("--since", default="", metavar="DURATION",
                   help="only usage from this long ago on, in whole hours: 24h, 90m, 7d (default: all time)")
    p.add_argument("--csv", action="store_true", help="print CSV with a header instead of a table")

    async def usage(ns: argparse.Namespace) -> int:
        return await _usage(ns, admin_target)

    p.set_defaults(func=usage)
