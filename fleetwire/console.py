"""What the ``fleetwire`` client commands print: tables and live progress on a terminal (rich),
plain lines when piped, JSON lines with ``--json``; and the operator commands built on them.

Output rules (docs/OPERATIONS.md §CLI):

* ``--json`` prints one JSON document per line and nothing else on stdout, for scripts.
* Piped (not a terminal), text output is plain and stable: event lines ``[seq] kind data``,
  tables without colour, wide enough not to wrap.
* On a terminal, ``submit --follow`` and ``watch`` print each event as it arrives, with the plan's
  state, worker, event count and elapsed time in a spinner line below them; streamed ``token``
  events are shown growing in that line and printed as one text when the stream ends.

Commands defined here: ``plans``, ``drain``, ``undrain`` and ``completion``; ``cli.py`` adds them
with :func:`add_operator_commands`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final, TextIO

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fleetwire.client import Client, Plan
from fleetwire.errors import FleetwireConnectionError, PlanCancelled, PlanFailed
from protocol.messages import Event, PlanInfo, Plans, WorkerInfo, Workers

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_operator_commands",
    "explain_unreachable",
    "finish",
    "print_workers",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_CANCELLED: Final = 3

_KIND_STYLES: Final = {
    "queued": "yellow", "waiting": "yellow", "requeued": "yellow", "leased": "cyan", "running": "cyan",
    "succeeded": "bold green", "failed": "bold red", "cancelled": "magenta", "stderr": "red", "stdout": "",
}
_STATE_STYLES: Final = {"alive": "green", "suspect": "yellow", "disconnected": "red", "draining": "yellow"}


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def make_console(file: TextIO | None = None) -> Console:
    """A console on stdout; piped, it is plain and 200 columns wide so tables never wrap."""
    stream = file or sys.stdout
    interactive = stream.isatty()
    return Console(
        file=stream,
        width=None if interactive else 200,
        no_color=not interactive or "NO_COLOR" in os.environ,
        highlight=False,
        soft_wrap=not interactive,
    )


# ---------------------------------------------------------------------------- following a plan


class _Follower:
    """Renders one plan's events; ``live`` adds the spinner line (terminals only)."""

    def __init__(self, console: Console, plan_id: str, *, follow: bool, live: bool) -> None:
        self.console = console
        self.plan_id = plan_id
        self.follow = follow
        self.live = live
        self.state = "submitted"
        self.worker = ""
        self.events = 0
        self.tokens: list[str] = []
        self.progress = ""
        self.started = time.monotonic()
        self.status: Any = None

    def status_text(self) -> str:
        parts = [f"plan {self.plan_id}: {self.state}"]
        if self.worker:
            parts.append(f"on {self.worker}")
        parts.append(f"{self.events} events")
        if self.progress:
            parts.append(self.progress)
        parts.append(f"{time.monotonic() - self.started:.1f} s")
        text = " · ".join(parts)
        if self.tokens:
            tail = "".join(self.tokens)[-60:].replace("\n", " ")
            text += f" · {tail}"
        return escape(text)

    def flush_tokens(self) -> None:
        if self.tokens:
            if self.follow:
                self.console.print("".join(self.tokens), markup=False, highlight=False)
            self.tokens = []

    def event(self, event: Event) -> None:
        self.events += 1
        data = event.data if isinstance(event.data, dict) else {}
        if event.kind == "token" and self.live and isinstance(data.get("text"), str):
            self.tokens.append(data["text"])
        else:
            self.flush_tokens()
            if event.kind in ("queued", "waiting", "leased", "running", "requeued"):
                self.state = event.kind if event.kind != "waiting" else f"waiting ({data.get('reason', '')})"
                self.worker = data.get("worker_id", self.worker) if event.kind in ("leased", "running") else ""
            elif event.kind == "progress" and "fraction" in data:
                self.progress = f"{100 * float(data['fraction']):.0f}% {data.get('message', '')}".strip()
            if self.follow:
                payload = "" if event.data is None else " " + _json(event.data)
                style = _KIND_STYLES.get(event.kind, "")
                line = f"[{event.seq}] {event.kind}{payload}"
                self.console.print(line, style=style or None, markup=False, highlight=False)
            elif event.kind == "waiting" and not self.live:
                print(f"plan {self.plan_id} waiting: {data.get('reason', '')}", file=sys.stderr, flush=True)
        if self.status is not None:
            self.status.update(self.status_text())


async def finish(plan: Plan, *, follow: bool, as_json: bool) -> int:
    """Wait for the plan's terminal event, printing events as asked; the exit status says the outcome."""
    if as_json:
        async for event in plan.events():
            if follow:
                print(_json({"plan_id": event.plan_id, "seq": event.seq, "kind": event.kind, "data": event.data}),
                      flush=True)
    else:
        console = make_console()
        follower = _Follower(console, plan.id, follow=follow, live=console.is_terminal)
        if follower.live:
            with console.status(follower.status_text(), spinner="dots") as status:
                follower.status = status
                async for event in plan.events():
                    follower.event(event)
        else:
            async for event in plan.events():
                follower.event(event)
        follower.flush_tokens()
    return _outcome(plan, await _result(plan), as_json)


async def _result(plan: Plan) -> tuple[str, Any]:
    try:
        return "succeeded", await plan.result()
    except PlanFailed as exc:
        return "failed", exc
    except PlanCancelled as exc:
        return "cancelled", exc


def _outcome(plan: Plan, outcome: tuple[str, Any], as_json: bool) -> int:
    state, value = outcome
    if state == "failed":
        if as_json:
            print(_json({"plan_id": plan.id, "state": "failed", "error": {"code": value.code, "message": str(value)}}))
        else:
            print(f"plan {plan.id} failed [{value.code}]: {value}", file=sys.stderr)
        return EXIT_FAILED
    if state == "cancelled":
        print(_json({"plan_id": plan.id, "state": "cancelled"}) if as_json else f"plan {plan.id} cancelled",
              file=sys.stdout if as_json else sys.stderr)
        return EXIT_CANCELLED
    print(_json({"plan_id": plan.id, "state": "succeeded", "result": value}) if as_json else _json(value))
    return EXIT_OK


# ---------------------------------------------------------------------------- tables


def _worker_state(w: WorkerInfo) -> str:
    state = "alive" if w.alive else ("suspect" if w.connected else "disconnected")
    return f"{state}, draining" if w.draining else state


def workers_table(rows: list[WorkerInfo]) -> Table:
    """The ``fleetwire workers`` table."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    columns = ("ID", "STATE", "TAGS", "CPUS", "GPUS", "RAM", "IN-FLIGHT", "ENERGY", "CARBON", "ENGINE", "LAST BEAT")
    for column in columns:
        table.add_column(column, no_wrap=True)
    for w in rows:
        caps, load = w.capabilities, w.load
        state = _worker_state(w)
        style = _STATE_STYLES["draining" if w.draining else state.split(",")[0]]
        energy = "-"
        carbon = caps.carbon_zone or "-"
        engine = "-"
        if load is not None:
            parts = [f"{load.uj_per_token:.0f} µJ/tok" if load.uj_per_token else "", f"{load.power_w:.0f} W"
                     if load.power_w else ""]
            energy = ", ".join(p for p in parts if p) or "-"
            if load.zone_intensity_g_per_kwh:
                carbon = f"{load.zone_intensity_g_per_kwh:.0f} g/kWh" + (f" ({caps.carbon_zone})" if caps.carbon_zone
                                                                         else "")
            if load.engine_running or load.engine_waiting or load.kv_cache_usage:
                engine = f"{load.engine_running} run/{load.engine_waiting} wait, KV {100 * load.kv_cache_usage:.0f}%"
        table.add_row(
            escape(w.id),
            f"[{style}]{state}[/]" if style else state,
            escape(",".join(caps.tags) or "-"),
            str(caps.cpu_cores),
            str(len(caps.gpus)),
            f"{caps.ram_bytes / 1e9:.1f} GB",
            f"{w.leases}/{caps.max_concurrency}",
            energy,
            escape(carbon),
            engine,
            "-" if w.last_beat_age_s is None else f"{w.last_beat_age_s:.1f}s ago",
        )
    return table


def print_workers(reply: Workers, *, as_json: bool) -> None:
    """Print a ``workers`` reply: the table and the summary line, or one JSON document."""
    if as_json:
        print(_json({"summary": reply.summary, "workers": reply.workers}))
        return
    console = make_console()
    console.print(workers_table(reply.workers))
    console.print(reply.summary, markup=False)


def plans_table(plans: list[PlanInfo]) -> Table:
    """The ``fleetwire plans`` table."""
    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("ID", "OP", "STATE", "WORKER", "ATTEMPT", "EVENTS", "WAITING"):
        table.add_column(column, no_wrap=column != "WAITING")
    for p in plans:
        style = _KIND_STYLES.get(p.state, "")
        table.add_row(escape(p.id), escape(p.op), f"[{style}]{p.state}[/]" if style else p.state,
                      escape(p.worker_id or "-"), str(p.attempt), str(p.last_seq), escape(p.waiting_reason or ""))
    return table


# ---------------------------------------------------------------------------- operator commands

Target = Callable[[argparse.Namespace], tuple[str, str | None]]


async def _plans(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with Client(url, token=token) as client:
        reply: Plans = await client.plans(states=ns.state or (), limit=ns.limit)
    if ns.json:
        print(_json(reply))
        return EXIT_OK
    console = make_console()
    console.print(plans_table(reply.plans))
    counts = ", ".join(f"{n} {state}" for state, n in sorted(reply.counts.items()))
    queue = f"; queue: {len(reply.queue)}" + (f" (next: {reply.queue[0]})" if reply.queue else "")
    console.print(f"{len(reply.plans)} of {reply.total} plans shown; all: {counts or 'none'}{queue}", markup=False)
    return EXIT_OK


async def _drain(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with Client(url, token=token) as client:
        await client.drain(ns.worker, deadline_s=ns.deadline)
    if ns.json:
        print(_json({"worker_id": ns.worker, "draining": True, "deadline_s": ns.deadline}))
    else:
        after = (
            "finish whenever they finish" if ns.deadline is None else f"have {ns.deadline:g} s before they are requeued"
        )
        print(f"worker {ns.worker} draining: no new plans; its running plans {after}")
    return EXIT_OK


async def _undrain(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with Client(url, token=token) as client:
        await client.undrain(ns.worker)
    print(_json({"worker_id": ns.worker, "draining": False}) if ns.json else f"worker {ns.worker} takes plans again")
    return EXIT_OK


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def add_operator_commands(
    sub: Any,
    *,
    common: argparse.ArgumentParser,
    client: argparse.ArgumentParser,
    target: Target,
    root: Callable[[], argparse.ArgumentParser],
) -> None:
    """Add ``plans``, ``drain``, ``undrain`` and ``completion`` to the ``fleetwire`` subparsers.

    Args:
        sub: the root parser's subparsers.
        common, client: parent parsers with the logging and the client flags.
        target: reads ``(url, token)`` from parsed flags (exits 2 without a URL).
        root: builds the whole parser again (for ``completion``).
    """

    def admin_target(ns: argparse.Namespace) -> tuple[str, str | None]:
        # Operator commands want the admin token (drain/undrain refuse a client token; plans
        # shows everyone's plans with it): $FLEETWIRE_ADMIN_TOKEN when set, unless --token.
        url, token = target(ns)
        admin = os.environ.get("FLEETWIRE_ADMIN_TOKEN")
        return url, (token if ns.token or not admin else admin)

    def bind(fn: Callable[[argparse.Namespace, Target], Coroutine[Any, Any, int]]) -> Any:
        async def run(ns: argparse.Namespace) -> int:
            return await fn(ns, admin_target)

        return run

    p = sub.add_parser("plans", parents=[common, client], help="list plans and the queue",
                       description="Plans you may see (an admin token: all), newest first, and the queue. "
                                   "Uses $FLEETWIRE_ADMIN_TOKEN when set, else $FLEETWIRE_TOKEN.")
    p.add_argument("--state", action="append", metavar="STATE",
                   choices=("queued", "leased", "running", "succeeded", "failed", "cancelled"),
                   help="only plans in this state (repeatable)")
    p.add_argument("--limit", type=int, default=50, help="at most this many plans (default 50)")
    p.set_defaults(func=bind(_plans))

    p = sub.add_parser("drain", parents=[common, client], help="stop placing plans on a worker",
                       description="Drain a worker: it takes no new plans and says so in `fleetwire workers`. "
                                   "Its running plans finish, or with --deadline are requeued after S seconds. "
                                   "Stays drained across reconnects until `fleetwire undrain`. Needs an admin "
                                   "token: $FLEETWIRE_ADMIN_TOKEN (or --token).")
    p.add_argument("worker", help="worker id (see `fleetwire workers`)")
    p.add_argument("--deadline", type=_non_negative, default=None, metavar="S",
                   help="requeue the plans it still runs after S seconds (default: let them finish)")
    p.set_defaults(func=bind(_drain))

    p = sub.add_parser("undrain", parents=[common, client], help="place plans on a drained worker again",
                       description="Undrain a worker: it takes plans again, including ones it refused while draining. "
                                   "Needs an admin token: $FLEETWIRE_ADMIN_TOKEN (or --token).")
    p.add_argument("worker", help="worker id")
    p.set_defaults(func=bind(_undrain))

    p = sub.add_parser("completion", parents=[common], help="print a shell completion script",
                       description="Print a completion script for SHELL. Bash: "
                                   "`fleetwire completion bash > /etc/bash_completion.d/fleetwire`, "
                                   "or `source <(fleetwire completion bash)` in ~/.bashrc.")
    p.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell")

    async def completion(ns: argparse.Namespace) -> int:
        import shtab

        print(shtab.complete(root(), shell=ns.shell))
        return EXIT_OK

    p.set_defaults(func=completion)


def explain_unreachable(exc: FleetwireConnectionError, url: str | None) -> str:
    """The message for a coordinator the CLI could not reach: the URL tried and what to check."""
    if exc.close_code is not None or not str(exc).startswith("cannot connect"):
        return f"{exc}"
    return (
        f"{exc}\n"
        f"  tried: {url or '(no URL)'} (from --url or FLEETWIRE_URL)\n"
        "  check: the coordinator is running there (`fleetwire coordinator`, or `fleetwire up` for a local one);\n"
        "         the host and port are right and reachable from here (firewall, --host 0.0.0.0 on the coordinator);\n"
        "         the scheme matches: ws:// for a plain coordinator, wss:// when it serves TLS"
    )
