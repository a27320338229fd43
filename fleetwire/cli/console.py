"""What the ``fleetwire`` client commands print: tables and live progress on a terminal (rich),
plain lines when piped, JSON lines with ``--json``; and the operator commands built on them.

Output rules (docs/OPERATIONS.md §CLI):

* ``--json`` prints one JSON document per line and nothing else on stdout, for scripts.
* Piped (not a terminal), text output is plain and stable: event lines ``[seq] kind data``,
  tables without colour, wide enough not to wrap.
* On a terminal, ``submit --follow`` and ``watch`` print each event as it arrives, with the plan's
  state, worker, event count and elapsed time in a spinner line below them; streamed ``token``
  events are shown growing in that line and printed as one text when the stream ends.

Commands defined here: ``plans``, ``drain``, ``undrain``, ``remove`` and ``completion``; ``main.py`` adds them
with :func:`add_operator_commands`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, TextIO

import msgspec

from fleetwire.errors import FleetwireConnectionError, PlanCancelled, PlanFailed
from protocol.messages import Event, PlanInfo, Plans, Receipt, WorkerInfo, Workers

if TYPE_CHECKING:  # rich (~60 ms) and the SDK's client: imported where a command uses them
    from rich.console import Console
    from rich.table import Table

    from fleetwire.client import Client, Plan

__all__ = [
    "EXIT_CANCELLED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_USAGE",
    "add_operator_commands",
    "data_ready_text",
    "event_record",
    "explain_unreachable",
    "finish",
    "print_table",
    "print_workers",
    "progress_text",
    "workers_table",
]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_CANCELLED: Final = 3

_KIND_STYLES: Final = {
    "queued": "yellow", "waiting": "yellow", "requeued": "yellow", "leased": "cyan", "running": "cyan",
    "succeeded": "bold green", "failed": "bold red", "cancelled": "magenta", "stderr": "red", "stdout": "",
}
_MARKERS: Final = ("resync", "rewound", "recovered")  # stream markers the SDK makes; each says why in data.reason
_STATE_STYLES: Final = {"alive": "green", "suspect": "yellow", "disconnected": "red", "draining": "yellow"}
_HEALTH_STYLES: Final = {"quarantined": "red", "degraded": "yellow"}  # the GPU HEALTH cell, by its worst device


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def connect(url: str, token: str | None, **options: Any) -> Client:
    """A client of ``url``: the SDK's client is imported by the commands that dial, not by the daemons."""
    from fleetwire.client import Client

    return Client(url, token=token, **options)


def escape(text: str) -> str:
    """``text`` with rich markup escaped (rich imported on first use)."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


def _table() -> Table:
    from rich.table import Table

    return Table(box=None, header_style="bold", pad_edge=False)


def make_console(file: TextIO | None = None) -> Console:
    """A console on stdout; piped, it is plain and 200 columns wide so tables never wrap."""
    from rich.console import Console

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
                self.progress = progress_text(data)
            if self.follow:
                seqs = str(event.seq)
                if event.kind == "progress" and "fraction" in data:  # 0.333333 -> "33 %"
                    payload = " " + progress_text(data)
                elif event.kind in _MARKERS and isinstance(data.get("reason"), str):  # fleetwire/stream.py's markers
                    payload = ": " + data["reason"]
                    if event.kind == "resync" and data.get("first_seq", event.seq) != event.seq:
                        seqs = f"{data['first_seq']}-{event.seq}"  # the seqs it stands for
                elif event.kind == "data_ready":  # signed tickets: never on a screen or in a log
                    payload = " " + data_ready_text(data)
                else:
                    payload = "" if event.data is None else " " + _json(event.data)
                style = _KIND_STYLES.get(event.kind, "")
                line = f"[{seqs}] {event.kind}{payload}"
                self.console.print(line, style=style or None, markup=False, highlight=False)
            elif event.kind == "waiting" and not self.live:
                print(f"plan {self.plan_id} waiting: {data.get('reason', '')}", file=sys.stderr, flush=True)
        if self.status is not None:
            self.status.update(self.status_text())


WaitingHook = Callable[[str], Awaitable[None]]


async def finish(plan: Plan, *, follow: bool, as_json: bool, on_waiting: WaitingHook | None = None) -> int:
    """Wait for the plan's terminal event, printing events as asked; the exit status says the outcome.

    ``on_waiting`` is awaited with the reason of each ``waiting`` event (after it is printed).
    """
    if as_json:
        async for event in plan.events():
            if on_waiting is not None and event.kind == "waiting":
                await on_waiting(_reason(event))
            if follow:
                print(_json(event_record(event)), flush=True)
    else:
        console = make_console()
        follower = _Follower(console, plan.id, follow=follow, live=console.is_terminal)
        if follower.live:
            with console.status(follower.status_text(), spinner="dots") as status:
                follower.status = status
                async for event in plan.events():
                    follower.event(event)
                    if on_waiting is not None and event.kind == "waiting":
                        await on_waiting(_reason(event))
        else:
            async for event in plan.events():
                follower.event(event)
                if on_waiting is not None and event.kind == "waiting":
                    await on_waiting(_reason(event))
        follower.flush_tokens()
    outcome = await _result(plan)
    if follow and not as_json:  # before the result: that stays the last line
        if plan.receipt is not None:
            print(receipt_line(plan.receipt), flush=True)
        elif plan.worker_id is not None and plan.state != "cancelled":  # it ran, and nothing measured it
            print(NO_RECEIPT, flush=True)
    return _outcome(plan, outcome, as_json)


#: The fields of a ``data_ready`` event that are bearer credentials (docs/PROTOCOL.md §11 Tickets).
TICKET_FIELDS: Final = ("ticket", "get_ticket")
REDACTED: Final = "(redacted)"


def event_record(event: Event) -> dict[str, Any]:
    """An event as ``--follow --json`` prints it: its data as sent, tickets redacted (anyone holding
    one can upload or download the plan's bytes until it expires; the SDK fetches its own)."""
    data = event.data
    if event.kind == "data_ready" and isinstance(data, dict):
        data = {k: REDACTED if k in TICKET_FIELDS and v else v for k, v in data.items()}
    return {"plan_id": event.plan_id, "seq": event.seq, "kind": event.kind, "data": data}


def data_ready_text(data: dict[str, Any]) -> str:
    """A ``data_ready`` event in a line, without its tickets: attempt, worker, endpoint, the files it covers."""
    where = data.get("url") or "the relay (the worker has no data endpoint)"
    text = f"attempt {data.get('attempt', '?')} on {data.get('worker_id') or '?'} via {where}"
    files = data.get("files")
    if isinstance(files, dict) and files:
        sizes = [f"{name} ({claim[0]} B)" if isinstance(claim, list) and claim and isinstance(claim[0], int)
                 and claim[0] >= 0 else str(name) for name, claim in files.items()]
        text += "; inputs " + ", ".join(sizes)
    held = [name for name in TICKET_FIELDS if data.get(name)]
    if held:
        text += f"; {' and '.join(held)} {REDACTED}"
    return text


def _joules(joules: float) -> str:
    if joules >= 1e6:
        return f"{joules / 1e6:.3g} MJ"
    return f"{joules / 1e3:.3g} kJ" if joules >= 1e4 else f"{joules:.1f} J"


def _grams(grams: float) -> str:
    return f"{grams:.2f}" if grams >= 0.01 or grams == 0 else f"{grams:.2g}"


#: What ``submit --follow`` prints for a plan that ran and came back without a receipt: its worker
#: measured nothing, so it sent none (docs/PROTOCOL.md §Receipt).
NO_RECEIPT: Final = "energy unknown (no receipt: the worker has no NVML, --power-watts or --uj-per-token)"


def receipt_line(receipt: Receipt) -> str:
    """One line for a plan's receipt: ``energy 12.3 J (estimated), 0.41 gCO2e; projected 11.0 J``."""
    if receipt.source == "none":
        energy = "energy unknown (the worker has no NVML, --power-watts or --uj-per-token)"
    else:
        energy = f"energy {_joules(receipt.joules)}" + (" (estimated)" if receipt.estimated else "")
        known = receipt.intensity_g_per_kwh > 0
        energy += f", {_grams(receipt.co2e_g)} gCO2e" if known else ", gCO2e unknown (no zone intensity)"
    if receipt.projected_joules > 0:
        energy += f"; projected {_joules(receipt.projected_joules)}"
        if receipt.projected_co2e_g > 0:
            energy += f", {_grams(receipt.projected_co2e_g)} gCO2e"
    return energy


def _with_receipt(plan: Plan, record: dict[str, Any]) -> dict[str, Any]:
    if plan.receipt is not None:
        record["receipt"] = plan.receipt
    return record


def _reason(event: Event) -> str:
    reason = event.data.get("reason") if isinstance(event.data, dict) else None
    return reason if isinstance(reason, str) else ""


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
            error = {"code": value.code, "message": value.message}
            print(_json(_with_receipt(plan, {"plan_id": plan.id, "state": "failed", "error": error})))
        else:  # the message alone: str(PlanFailed) says "plan X failed (code)" too
            print(f"plan {plan.id} failed [{value.code}]: {value.message}", file=sys.stderr)
        return EXIT_FAILED
    if state == "cancelled":
        print(_json(_with_receipt(plan, {"plan_id": plan.id, "state": "cancelled"})) if as_json
              else f"plan {plan.id} cancelled",
              file=sys.stdout if as_json else sys.stderr)
        return EXIT_CANCELLED
    print(_json(_with_receipt(plan, {"plan_id": plan.id, "state": "succeeded", "result": value})) if as_json
          else _json(value))
    return EXIT_OK


# ---------------------------------------------------------------------------- tables


def _worker_state(w: WorkerInfo) -> str:
    state = "alive" if w.alive else ("suspect" if w.connected else "disconnected")
    return f"{state}, draining" if w.draining else state


def progress_text(data: dict[str, Any]) -> str:
    """A ``progress`` event as a person reads it: the fraction as a whole percentage, then the message."""
    try:
        percent = f"{round(100 * float(data['fraction']))} %"
    except (KeyError, TypeError, ValueError):
        percent = ""
    message = data.get("message")
    return f"{percent} {message if isinstance(message, str) else ''}".strip()


# Columns shown even when every row is "-" (the rest are dropped then: a CPU fleet has no ENERGY).
_KEPT_COLUMNS: Final = frozenset({"ID", "STATE", "IN-FLIGHT", "LAST BEAT"})
_EMPTY_CELLS: Final = frozenset({"", "-"})


def workers_table(rows: list[WorkerInfo]) -> Table:
    """The ``fleetwire workers`` table: ids first and whole, columns no row fills left out.

    Print it with :func:`print_table`, which lets a table wider than the terminal run past it
    (the terminal wraps the line) instead of cutting ids.
    """
    columns = ("ID", "VERSION", "STATE", "TAGS", "CPUS", "GPUS", "GPU HEALTH", "RAM", "IN-FLIGHT", "ENERGY", "CARBON",
               "ENGINE", "LAST BEAT")
    cells = [_worker_cells(w) for w in rows]
    shown = [i for i, column in enumerate(columns)
             if column in _KEPT_COLUMNS or any(row[i] not in _EMPTY_CELLS for row in cells)]  # fmt: skip
    table = _table()
    for i in shown:
        table.add_column(columns[i], no_wrap=True)
    for w, row in zip(rows, cells, strict=True):
        style = _STATE_STYLES["draining" if w.draining else row[2].split(",")[0]]
        values = [escape(row[i]) for i in shown]
        state_at = shown.index(2)
        if style:
            values[state_at] = f"[{style}]{values[state_at]}[/]"
        health = _HEALTH_STYLES.get(_worst_device_state(w))
        if health and 6 in shown:
            values[shown.index(6)] = f"[{health}]{values[shown.index(6)]}[/]"
        table.add_row(*values)
    return table


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` at its natural width: never squeezed (cells cut with "…") to fit the terminal."""
    natural = console.measure(table, options=console.options.update_width(1 << 16)).maximum
    if natural > console.width:
        table.width = natural
    console.print(table, crop=False)


def _worker_cells(w: WorkerInfo) -> list[str]:
    """One ``workers`` row as plain text, in the table's column order ("-": nothing to show)."""
    caps, load = w.capabilities, w.load
    state = _worker_state(w)
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
    return [
        w.id,
        w.version or "-",
        state,
        ",".join(caps.tags) or "-",
        str(caps.cpu_cores) if caps.cpu_cores else "-",
        _gpu_cell(w),
        _gpu_health_cell(w),
        f"{caps.ram_bytes / 1e9:.1f} GB" if caps.ram_bytes else "-",
        f"{w.leases}/{caps.max_concurrency}",
        energy,
        carbon,
        engine,
        "-" if w.last_beat_age_s is None else f"{w.last_beat_age_s:.1f}s ago",
    ]


def _gpu_cell(w: WorkerInfo) -> str:
    """``4 (1 used, 3 free)``: the worker's devices and how many plans hold them ("-": none)."""
    gpus = w.capabilities.gpus
    if not gpus:
        return "-"
    used = sum(1 for n in w.gpu_use if n)
    share = w.capabilities.gpu_share
    return f"{len(gpus)} ({used} used, {len(gpus) - used} free" + (f", {share} plans each)" if share > 1 else ")")


def _gpu_health_cell(w: WorkerInfo) -> str:
    """``ok; max 64 °C``, or each device not ok with why (``gpu 0 quarantined: fatal XID 79 (...)``) and the
    hottest device's temperature, from the worker's last load (docs/OPERATIONS.md §GPU health; "-": not sampled)."""
    devices = w.load.devices if w.load is not None else []
    if not devices:
        return "-"
    parts = [f"gpu {d.index} {d.state}" + (f": {d.reason}" if d.reason else "") for d in devices if d.state != "ok"]
    hottest = max(d.temperature_c for d in devices)
    return "; ".join((parts or ["ok"]) + ([f"max {hottest:.0f} °C"] if hottest > 0 else []))


def _worst_device_state(w: WorkerInfo) -> str:
    """The worst state among the worker's devices ("ok" when none is sampled)."""
    states = {d.state for d in w.load.devices} if w.load is not None else set()
    return next((state for state in ("quarantined", "degraded") if state in states), "ok")


def print_workers(reply: Workers, *, as_json: bool) -> None:
    """Print a ``workers`` reply: the table and the summary line, or one JSON document."""
    if as_json:
        print(_json({"summary": reply.summary, "workers": reply.workers}))
        return
    console = make_console()
    print_table(console, workers_table(reply.workers))
    console.print(reply.summary, markup=False)


def plans_table(plans: list[PlanInfo]) -> Table:
    """The ``fleetwire plans`` table."""
    table = _table()
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
    states = ns.state or ()
    if ns.by is not None and not states:
        states = ("succeeded", "failed", "cancelled")  # a footprint is made of finished plans
    limit = ns.limit if ns.limit is not None else (MAX_LIST if ns.by is not None else 50)
    # Cluster mode (several URLs): a coordinator's main port reads every shard's plans from PostgreSQL.
    async with connect(url, token) as client:
        reply: Plans = await client.plans(states=states, limit=limit)
    if ns.since is not None:
        since = time.time() - ns.since
        reply.plans = [p for p in reply.plans if p.ended_at is not None and p.ended_at >= since]
    if ns.by is not None:
        return _print_footprint(reply.plans, ns.by, as_json=ns.json)
    if ns.json:
        print(_json(reply))
        return EXIT_OK
    console = make_console()
    print_table(console, plans_table(reply.plans))
    counts = ", ".join(f"{n} {state}" for state, n in sorted(reply.counts.items()))
    queue = f"; queue: {len(reply.queue)}" + (f" (next: {reply.queue[0]})" if reply.queue else "")
    console.print(f"{len(reply.plans)} of {reply.total} plans shown; all: {counts or 'none'}{queue}", markup=False)
    return EXIT_OK


MAX_LIST: Final = 10_000  # the most rows ``list_plans`` gives (docs/PROTOCOL.md)


def footprint(plans: list[PlanInfo], by: str) -> list[dict[str, Any]]:
    """Finished plans' receipts summed by ``principal`` or ``op``: one row per key, the largest energy first."""
    rows: dict[str, dict[str, Any]] = {}
    for p in plans:
        key = p.owner if by == "principal" else p.op
        row = rows.setdefault(key, {by: key, "plans": 0, "joules": 0.0, "co2e_g": 0.0, "estimated": 0,
                                    "no_receipt": 0, "projected_joules": 0.0})  # fmt: skip
        row["plans"] += 1
        r = p.receipt
        if r is None:
            row["no_receipt"] += 1
            continue
        row["joules"] += r.joules
        row["co2e_g"] += r.co2e_g
        row["estimated"] += r.estimated
        row["projected_joules"] += r.projected_joules
    return sorted(rows.values(), key=lambda row: (-row["joules"], row[by]))


def _print_footprint(plans: list[PlanInfo], by: str, *, as_json: bool) -> int:
    rows = footprint(plans, by)
    if as_json:
        print(_json({"by": by, "rows": rows}))
        return EXIT_OK
    table = _table()
    for column in (by.upper(), "PLANS", "ENERGY", "GCO2E", "ESTIMATED", "PROJECTED", "NO RECEIPT"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        table.add_row(escape(row[by] or "-"), str(row["plans"]), _joules(row["joules"]), _grams(row["co2e_g"]),
                      str(row["estimated"]), _joules(row["projected_joules"]) if row["projected_joules"] else "-",
                      str(row["no_receipt"]))
    console = make_console()
    print_table(console, table)
    total_j, total_g = sum(r["joules"] for r in rows), sum(r["co2e_g"] for r in rows)
    console.print(f"{len(plans)} finished plans: {_joules(total_j)}, {_grams(total_g)} gCO2e", markup=False)
    return EXIT_OK


def duration_s(text: str) -> float:
    """``90``, ``90s``, ``30m``, ``24h`` or ``7d`` in seconds (argparse type of ``--since``)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:].lower() in units else (text, "s")
    try:
        value = float(number) * units[unit.lower()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a duration like 90s, 30m, 24h or 7d, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text!r}")
    return value


def deadline(text: str) -> tuple[float | None, float | None]:
    """``--deadline``: ``6h`` (a duration from now) or an ISO 8601 time (no offset: this host's local time), as
    ``(deadline_s, deadline_at)`` with one of the two set (argparse type)."""
    if "-" in text or "T" in text or ":" in text:
        try:
            when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a duration like 6h or a time like 2026-06-01T06:00, got "
                                             f"{text!r}") from None  # fmt: skip
        return None, (when if when.tzinfo is not None else when.astimezone()).timestamp()
    return duration_s(text), None


async def _drain(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with connect(url, token) as client:
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
    async with connect(url, token) as client:
        await client.undrain(ns.worker)
    print(_json({"worker_id": ns.worker, "draining": False}) if ns.json else f"worker {ns.worker} takes plans again")
    return EXIT_OK


async def _release_device(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with connect(url, token) as client:
        await client.release_device(ns.worker, ns.device)
    if ns.json:
        print(_json({"worker_id": ns.worker, "device": ns.device, "released": True}))
    else:
        print(f"device {ns.device} of worker {ns.worker} released: the worker ends its quarantine and reports it "
              "in its next load")
    return EXIT_OK


async def _remove(ns: argparse.Namespace, target: Target) -> int:
    url, token = target(ns)
    async with connect(url, token) as client:
        await client.remove_worker(ns.worker)
    if ns.json:
        print(_json({"worker_id": ns.worker, "removed": True}))
    else:
        print(f"worker {ns.worker} removed: its unfinished plans are queued again; its id is refused until the "
              "coordinator restarts")
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
    p.add_argument("--limit", type=int, default=None,
                   help="at most this many plans (default 50; with --by 10000)")
    p.add_argument("--since", type=duration_s, metavar="DURATION",
                   help="only plans that finished within this long, e.g. 24h, 30m, 7d (the coordinator keeps "
                        "finished plans for --plan-retention)")
    p.add_argument("--by", choices=("principal", "op"),
                   help="sum finished plans' energy and gCO2e receipts by principal or op (a team's footprint)")
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

    p = sub.add_parser("remove", parents=[common, client], help="remove a worker for good",
                       description="Remove a worker at once: its unfinished plans go back to the queue (no attempt "
                                   "spent), its session is closed (4410: the agent stops) and its id is refused until "
                                   "the coordinator restarts. For a graceful removal, `fleetwire drain --deadline S` "
                                   "first. Needs an admin token: $FLEETWIRE_ADMIN_TOKEN (or --token).")
    p.add_argument("worker", help="worker id")
    p.set_defaults(func=bind(_remove))

    p = sub.add_parser("device", parents=[common], help="act on a worker's device (release a quarantine)",
                       description="GPU devices as workers report them (docs/OPERATIONS.md §GPU health); "
                                   "`fleetwire workers` shows each device's health.")
    devices = p.add_subparsers(dest="device_command", required=True, metavar="ACTION")
    p = devices.add_parser("release", parents=[common, client], help="put a quarantined device back in service",
                           description="End a device's quarantine (a fatal XID, rising uncorrectable ECC errors or "
                                       "failed health probes put it there): the worker takes its counters as the "
                                       "new baseline and placement uses the device again. Needs an admin token: "
                                       "$FLEETWIRE_ADMIN_TOKEN (or --token).")
    p.add_argument("worker", help="worker id (see `fleetwire workers`)")
    p.add_argument("device", type=int, help="the device's position in the worker's GPU list (0, 1, ...)")
    p.set_defaults(func=bind(_release_device))

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
    if exc.close_code is not None or not str(exc).startswith("cannot connect") or "does not serve TLS" in str(exc):
        return f"{exc}"
    return (
        f"{exc}\n"
        f"  tried: {url or '(no URL)'} (from --url or FLEETWIRE_URL)\n"
        "  check: the coordinator is running there (`fleetwire coordinator`, or `fleetwire up` for a local one);\n"
        "         the host and port are right and reachable from here (firewall, --host 0.0.0.0 on the coordinator);\n"
        "         the scheme matches: ws:// for a plain coordinator, wss:// when it serves TLS"
    )
