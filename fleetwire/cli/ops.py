"""CLI commands and helpers for operators' day to day (docs/OPERATIONS.md §CLI).

* ``fleetwire status``: the coordinator's URL and version, workers alive, the queue, plans by state.
* ``fleetwire cancel ID [ID ...]`` and ``fleetwire cancel --all [--state STATE ...]``.
* :func:`follow_submitted`: ``submit`` waiting for its plan, where Ctrl-C says the plan keeps
  running and prints the commands to watch or cancel it (or, with ``--cancel-on-interrupt``,
  cancels it), and a plan waiting because no connected worker offers its op gets a hint: the ops
  the workers offer and the closest one (``difflib``), and ``--allow-shell`` for ``shell``.
* :func:`tag_list`: ``--tags A,B`` (repeatable) as a list; ``--tags`` is the one spelling, ``--tag``
  a hidden alias kept for old scripts.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Final

import msgspec

from fleetwire.cli.console import EXIT_FAILED, EXIT_OK, EXIT_USAGE, WaitingHook, connect, finish, make_console
from protocol.errors import RequestError
from protocol.messages import WorkerInfo

if TYPE_CHECKING:
    from fleetwire.client import Client, Plan

__all__ = [
    "EXIT_INTERRUPTED",
    "NO_WORKER_FOR_OP",
    "add_ops_commands",
    "follow_submitted",
    "interrupted_text",
    "op_hint",
    "tag_list",
]

EXIT_INTERRUPTED: Final = 130  # 128 + SIGINT, as shells report Ctrl-C
NO_WORKER_FOR_OP: Final = "no connected worker handles op "  # the start of the coordinator's waiting reason
UNFINISHED: Final = ("queued", "leased", "running")
PLAN_STATES: Final = ("queued", "leased", "running", "succeeded", "failed", "cancelled")

Target = Callable[[argparse.Namespace], tuple[str, str | None]]


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def tag_list(values: Iterable[str] | None) -> list[str]:
    """``["gpu,a100", "llm"]`` -> ``["gpu", "a100", "llm"]`` (blanks dropped, order kept, no repeats)."""
    tags: list[str] = []
    for value in values or ():
        for tag in value.split(","):
            if tag.strip() and tag.strip() not in tags:
                tags.append(tag.strip())
    return tags


# ---------------------------------------------------------------------------- op hints


def op_hint(op: str, workers: Iterable[WorkerInfo]) -> str:
    """What to tell a person whose plan of ``op`` waits because no connected worker offers it."""
    alive = [w for w in workers if w.alive]
    if not alive:
        return f"no worker is connected: the plan waits until one that offers op {op!r} joins (`fleetwire workers`)"
    offered = sorted({name for w in alive for name in w.capabilities.ops})
    lines = [f"no connected worker offers op {op!r}; they offer: {', '.join(offered) or 'no ops'}"]
    if op == "shell":
        lines.append("op 'shell' runs any command, so workers offer it only when started with --allow-shell "
                     "(`fleetwire worker --allow-shell`, or `fleetwire up --allow-shell`)")
    else:
        import difflib  # only for a typo's suggestion: not every command's start-up

        close = difflib.get_close_matches(op, offered, n=1, cutoff=0.6)
        if close:
            lines.append(f"did you mean {close[0]!r}?")
        lines.append("a handler of your own is offered with `fleetwire worker --handler NAME=MODULE:FUNCTION`")
    lines.append("the plan stays queued until a worker offering it joins; `fleetwire cancel` removes it")
    return "\n  ".join(lines)


def _op_hinter(client: Client, op: str) -> WaitingHook:
    """A ``finish`` hook printing :func:`op_hint` once, when the plan waits for its op."""
    said = False

    async def on_waiting(reason: str) -> None:
        nonlocal said
        if said or not reason.startswith(NO_WORKER_FOR_OP):
            return
        said = True
        try:
            reply = await client.workers()
        except RequestError:  # a token that may not list workers: the waiting reason alone must do
            return
        print(f"fleetwire: {op_hint(op, reply.workers)}", file=sys.stderr, flush=True)

    return on_waiting


# ---------------------------------------------------------------------------- Ctrl-C while following


def interrupted_text(plan_id: str, url: str | None) -> str:
    """What Ctrl-C during ``submit`` prints: the plan keeps running, and the commands to watch or cancel it."""
    where = f" --url {shlex.quote(url)}" if url else ""
    pid = shlex.quote(plan_id)
    return (
        f"interrupted: plan {plan_id} keeps running on the coordinator (Ctrl-C stops only this command).\n"
        f"  watch it:  fleetwire watch{where} {pid}\n"
        f"  cancel it: fleetwire cancel{where} {pid}\n"
        "  (next time, `submit --cancel-on-interrupt` cancels the plan on Ctrl-C)"
    )


async def follow_submitted(client: Client, plan: Plan, ns: argparse.Namespace) -> int:
    """``submit`` after the plan was accepted: wait for its outcome, printing as asked.

    Ctrl-C (SIGINT) stops waiting: the plan is cancelled with ``--cancel-on-interrupt``, else
    left running and the commands to watch or cancel it are printed; exit status 130.
    """
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    waiting = asyncio.ensure_future(
        finish(plan, follow=ns.follow, as_json=ns.json, on_waiting=_op_hinter(client, ns.op))
    )
    try:
        loop.add_signal_handler(signal.SIGINT, interrupted.set)
    except (NotImplementedError, RuntimeError):  # no signal handlers here (not the main thread): wait plainly
        return await waiting
    stop = asyncio.ensure_future(interrupted.wait())
    try:
        await asyncio.wait((waiting, stop), return_when=asyncio.FIRST_COMPLETED)
    finally:
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C interrupts whatever follows at once
        stop.cancel()
    if waiting.done():
        return waiting.result()
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    if ns.cancel_on_interrupt:
        info = await client.cancel(plan.id)
        if ns.json:
            print(_json({"plan_id": plan.id, "state": info.state, "interrupted": True}), flush=True)
        else:
            print(f"interrupted: plan {plan.id} {info.state} (--cancel-on-interrupt)", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    if ns.json:
        print(_json({"plan_id": plan.id, "state": "running", "interrupted": True}), flush=True)
    print(interrupted_text(plan.id, ns.url), file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


# ---------------------------------------------------------------------------- status


async def _status(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with connect(url, token) as client:
        workers = await client.workers()
        plans = await client.plans(limit=1)  # the counts cover every visible plan; the rows are not needed
    rows = workers.workers
    alive = sum(w.alive for w in rows)
    draining = sum(w.draining for w in rows)
    counts = {state: plans.counts[state] for state in PLAN_STATES if plans.counts.get(state)}
    counts.update({s: n for s, n in sorted(plans.counts.items()) if s not in counts and n})
    queued = plans.counts.get("queued", 0)
    versions = sorted({w.version for w in rows if w.alive and w.version})
    if ns.json:
        print(_json({
            "url": url, "version": workers.version,
            "workers": {"registered": len(rows), "alive": alive, "draining": draining, "versions": versions,
                        "summary": workers.summary},
            "queue": queued, "plans": counts,
        }))  # fmt: skip
        return EXIT_OK
    console = make_console()
    worker_line = f"{alive} alive of {len(rows)} registered"
    if draining:
        worker_line += f", {draining} draining"
    if len(versions) > 1:  # a rolling upgrade in progress (or stuck): say so
        worker_line += f"; versions {', '.join(versions)}"
    by_state = ", ".join(f"{n} {state}" for state, n in counts.items()) or "none"
    for label, value in (
        ("coordinator", f"{url} (version {workers.version or 'unknown'})"),
        ("workers", f"{worker_line}: {workers.summary}"),
        ("queue", f"{queued} plan{'s' if queued != 1 else ''} waiting"),
        ("plans", by_state),
    ):
        console.print(f"{label:<12} {value}", markup=False, highlight=False)
    return EXIT_OK


# ---------------------------------------------------------------------------- cancel


async def _cancel(ns: argparse.Namespace, target: Target) -> int:
    if ns.all == bool(ns.plan):
        print("fleetwire: error: give plan ids, or --all (with --state), not both and not neither", file=sys.stderr)
        return EXIT_USAGE
    if ns.state and not ns.all:
        print("fleetwire: error: --state selects plans for --all; with plan ids, leave it out", file=sys.stderr)
        return EXIT_USAGE
    url, token = target(ns)
    status = EXIT_OK
    async with connect(url, token) as client:
        ids = list(ns.plan) if not ns.all else await _matching(client, ns.state or UNFINISHED)
        if ns.all and not ids and not ns.json:
            print(f"no {'/'.join(ns.state or UNFINISHED)} plans to cancel", file=sys.stderr)
        for plan_id in ids:
            try:
                info = await client.cancel(plan_id, with_dependants=ns.with_dependants)
            except RequestError as exc:  # one unknown id does not stop the others
                status = EXIT_FAILED
                _print_refusal(ns, plan_id, exc)
                continue
            if info.state != "cancelled":
                status = EXIT_FAILED
            print(_json(info) if ns.json else f"plan {info.id} {info.state}", flush=True)
    return status


def _print_refusal(ns: argparse.Namespace, plan_id: str, exc: RequestError) -> None:
    """One plan's refusal: a JSON line on stdout with --json, else an error line on stderr."""
    if ns.json:
        print(_json({"plan_id": plan_id, "error": {"code": exc.code, "message": str(exc)}}), flush=True)
    else:
        print(f"fleetwire: error: plan {plan_id}: {exc} [{exc.code}]", file=sys.stderr, flush=True)


async def _release(ns: argparse.Namespace, target: Target) -> int:
    """``fleetwire release``: plans held for a greener hour are placed now (docs/SEMANTICS.md §Deadlines)."""
    url, token = target(ns)
    status = EXIT_OK
    async with connect(url, token) as client:
        for plan_id in ns.plan:
            try:
                info = await client.release(plan_id)
            except RequestError as exc:  # one unknown id does not stop the others
                status = EXIT_FAILED
                _print_refusal(ns, plan_id, exc)
                continue
            waiting = f" ({info.waiting_reason})" if info.waiting_reason else ""
            print(_json(info) if ns.json else f"plan {info.id} {info.state}{waiting}", flush=True)
    return status


async def _matching(client: Client, states: Iterable[str]) -> list[str]:
    """Ids of every plan this token may see in ``states``, oldest first (the order they were queued)."""
    reply = await client.plans(states=tuple(states), limit=10_000)
    ids = [p.id for p in reply.plans]
    ids.reverse()
    return ids


# ---------------------------------------------------------------------------- parsers


def add_ops_commands(
    sub: Any,
    *,
    common: argparse.ArgumentParser,
    client: argparse.ArgumentParser,
    admin_client: argparse.ArgumentParser,
    target: Target,
) -> None:
    """Add ``status``, ``cancel`` and ``release`` to the ``fleetwire`` subparsers.

    Args:
        sub: the root parser's subparsers.
        common: the logging flags; client / admin_client: the client flags, ``--token`` meaning the
            client / the admin token.
        target: reads ``(url, token)`` from parsed flags (exits 2 without a URL).
    """

    def admin_target(ns: argparse.Namespace) -> tuple[str, str | None]:
        url, token = target(ns)
        admin = os.environ.get("FLEETWIRE_ADMIN_TOKEN")
        return url, (token if ns.token or not admin else admin)

    p = sub.add_parser("status", parents=[common, admin_client], help="the coordinator, workers, queue and plans",
                       description="One look at the fleet: the coordinator's URL and version, workers alive, the "
                                   "queue depth and plans by state (with an admin token: everyone's plans). "
                                   "Uses $FLEETWIRE_ADMIN_TOKEN when set, else $FLEETWIRE_TOKEN.")

    async def status(ns: argparse.Namespace) -> int:
        return await _status(ns, admin_target)

    p.set_defaults(func=status)

    p = sub.add_parser("cancel", parents=[common, client], help="cancel plans",
                       description="Cancel the plans named, or with --all every plan of yours (an admin token: "
                                   "everyone's) in the --state given (default: queued, leased and running). One "
                                   "line per plan. Exit status 0 when every one ends cancelled.")
    p.add_argument("plan", nargs="*", help="plan ids")
    p.add_argument("--all", action="store_true", help="cancel every plan in --state instead of the ids given")
    p.add_argument("--state", action="append", choices=UNFINISHED, metavar="STATE",
                   help="with --all: only plans in this state, queued, leased or running (repeatable)")
    p.add_argument("--with-dependants", action="store_true",
                   help="cancel too the plans that use its outputs or run after it, directly or not (without it "
                        "they fail upstream_failed)")

    async def cancel(ns: argparse.Namespace) -> int:
        return await _cancel(ns, target)

    p.set_defaults(func=cancel)

    p = sub.add_parser("release", parents=[common, client], help="place plans held for a greener hour now",
                       description="Place now the plans named that wait for a greener hour (submitted with "
                                   "--deadline; their owner or an admin). One line per plan: its state then (a "
                                   "plan that was not held is left as it is). Exit status 0 unless an id is unknown.")
    p.add_argument("plan", nargs="+", help="plan ids")

    async def release(ns: argparse.Namespace) -> int:
        return await _release(ns, target)

    p.set_defaults(func=release)
