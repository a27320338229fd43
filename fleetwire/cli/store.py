"""``fleetwire store check | backup | restore`` and the ``--accept-store-loss`` flag of the daemons.

Exit status: 0 done (the store or the backup is sound), 2 usage (no such store, a coordinator
holds it, the destination exists), 3 damage found (:data:`EXIT_STORE_DAMAGED`, also what
``fleetwire coordinator`` exits with when it refuses a damaged store). docs/OPERATIONS.md
§Store integrity, backup and restore has the drill. The coordinator's modules are imported by
the functions that run, so building the parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["EXIT_STORE_DAMAGED", "add_store_command", "add_store_loss_argument", "store_exit_code"]

EXIT_STORE_DAMAGED = 3  # the same as coordinator.io.stores.integrity.EXIT_STORE_DAMAGED (a unit test keeps them equal)
_EXIT_USAGE = 2


def store_exit_code(exc: BaseException) -> int:
    """The exit status for an error that stopped a coordinator's start: 3 for a damaged store, else 2."""
    from coordinator.io.stores.integrity import StoreDamaged

    return EXIT_STORE_DAMAGED if isinstance(exc, StoreDamaged) else _EXIT_USAGE


def add_store_loss_argument(p: argparse.ArgumentParser) -> None:
    """``--accept-store-loss`` for ``coordinator`` and ``up``."""
    p.add_argument("--accept-store-loss", action="store_true",
                   help="start even when the store is damaged, from what is readable; what is dropped is logged "
                        "and counted in fleetwire_store_loss_accepted_total (default: refuse to start, exit 3)")


def add_store_command(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
    """Register ``fleetwire store`` and its subcommands on ``sub`` (the top-level subparsers)."""
    p = sub.add_parser("store", parents=parents, help="check, back up and restore the coordinator's sqlite store",
                       description="Check, back up and restore the coordinator's sqlite store. Exit status: 0 sound, "
                                   "2 usage error, 3 damage found.")
    ssub = p.add_subparsers(dest="store_command", required=True, metavar="SUBCOMMAND")
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--data-dir", default=None, metavar="DIR",
                       help="the coordinator's --data-dir (default: $FLEETWIRE_DATA_DIR, else "
                            "$XDG_STATE_HOME/fleetwire or ~/.local/state/fleetwire)")
    where.add_argument("--store", default=None, metavar="SPEC", help="the coordinator's --store (sqlite:PATH)")
    where.add_argument("--json", action="store_true", help="print the report as one JSON object")
    s = ssub.add_parser("check", parents=[where], help="integrity, checksums, generation and counts (read-only)")
    s.add_argument("--full", action="store_true", help="PRAGMA integrity_check (every page and index) instead of "
                                                       "quick_check")
    s.set_defaults(func=_check)
    s = ssub.add_parser("backup", parents=[where], help="write a consistent copy while the coordinator runs")
    s.add_argument("dest", type=Path, help="the new backup file")
    s.set_defaults(func=_backup)
    s = ssub.add_parser("restore", parents=[where],
                        help="put a backup in place of the store (the coordinator must be stopped)")
    s.add_argument("src", type=Path, help="a file written by `fleetwire store backup`")
    s.set_defaults(func=_restore)


def _path(ns: argparse.Namespace) -> Path:
    from coordinator.io.stores.store import store_path

    path = store_path(ns.store or "sqlite", ns.data_dir)
    if path is None:
        raise ValueError("the memory store keeps nothing on disk")
    return path


def _print(report: Any, ns: argparse.Namespace, action: str) -> int:
    if ns.json:
        print(json.dumps({"action": action, "path": str(report.path), "sound": report.sound,
                          "problems": report.problems, "notes": report.notes, "version": report.version,
                          "generation": report.generation, "acknowledged": report.acknowledged,
                          "plans": report.plans, "event_rows": report.event_rows}))  # fmt: skip
    else:
        total = sum(report.plans.values())
        states = ", ".join(f"{n} {state}" for state, n in sorted(report.plans.items())) or "none"
        print(f"{action}: {report.path} (schema {report.version}, {report.generation} commits): "
              f"{total} plans ({states}), {report.event_rows} event rows")  # fmt: skip
        for note in report.notes:
            print(f"  note: {note}")
        for problem in report.problems:
            print(f"  DAMAGED: {problem}")
        print("  sound" if report.sound else f"  {len(report.problems)} problem(s) found")
    return 0 if report.sound else EXIT_STORE_DAMAGED


async def _check(ns: argparse.Namespace) -> int:
    from coordinator.io.stores.admin import check_store

    try:
        return _print(check_store(_path(ns), full=ns.full), ns, "check")
    except ValueError as exc:
        return _fail(str(exc))


async def _backup(ns: argparse.Namespace) -> int:
    from coordinator.io.stores.admin import backup_store

    try:
        return _print(backup_store(_path(ns), ns.dest), ns, "backup")
    except ValueError as exc:
        return _fail(str(exc))


async def _restore(ns: argparse.Namespace) -> int:
    from coordinator.io.stores.admin import restore_store

    try:
        report, aside = restore_store(ns.src, _path(ns))
    except ValueError as exc:
        return _fail(str(exc))
    if aside is not None and not ns.json:
        print(f"the previous store was moved to {aside} (with its -wal and -shm)")
    return _print(report, ns, "restore")


def _fail(message: str) -> int:
    print(f"fleetwire: error: {message}", file=sys.stderr)
    return _EXIT_USAGE
