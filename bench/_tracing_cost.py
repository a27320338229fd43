"""What tracing costs fleetwire (``bench/compare.py --tracing``): throughput and latency, off / 1 % / 100 %.

    python bench/compare.py --peers none --tracing --plans 3000 --samples 300 --rounds 2

Each level runs bench/throughput.py and bench/latency.py (coordinator, worker and client each in
its own process, on 127.0.0.1) with the standard variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` set
to an OTLP/HTTP sink in this process (it keeps the posted bodies and decodes them after the runs,
so it does not compete for the CPU meanwhile), ``OTEL_TRACES_SAMPLER=parentbased_traceidratio``
and ``OTEL_TRACES_SAMPLER_ARG`` 0.01 or 1.0: the client's submit spans sample; the coordinator and
the worker follow the caller (parent-based). The throughput run collects the client's start-up garbage after its
warm-up plan at every level (``--collect-after-warmup``): a traced client imports the SDK at its start and collects
then (wireio/tracing.py), so without it only the untraced levels' windows would hold a start-up collection (§T32o).
"off" has no endpoint: nothing is imported. "ratio 0"
(``--tracing-levels off,0,1``) starts all of it, tracers, exporter threads and children, with
``OTEL_TRACES_SAMPLER_ARG`` 0: every plan carries the unsampled decision and none makes a span, so
"ratio 0" less "off" is what propagation costs every plan, and "1 %" less "ratio 0" the sampled plans'
spans (1 in 100) and their export. At 100 %
the exporters post whenever a batch of 2,048 spans is queued, and every ``OTEL_BSP_SCHEDULE_DELAY``
= 200 ms (not the default 5 s), so what is left after the last batch is exported inside the timed
window, as it would be in a fleet that runs all day; at 1 % the default delay stays (a post every
200 ms would cost more than the spans: each post is ~1 ms of CPU in the exporter's HTTP client).

Where the spans are exported (``FLEETWIRE_TRACE_EXPORT``, wireio/tracing.py): at "1 %" and "100 %"
as shipped, the coordinator and the workers through their exporter child processes and the client
in its own thread; "100 %, all threads" every process in its own exporter thread (as before the
child processes); "100 %, all processes" the client through a child too. The CPU columns count the
children (bench/throughput.py adds each daemon's child processes). Levels run in interleaved rounds,
each round in an order rotated by one from the last (off, 1 % then 1 %, off with two levels; ``--tracing-order
fixed``: the same order every round, as before), so a slot that runs slower (the second after the first, or the
first after the last) falls on every level alike; each figure is the median over the rounds, and the cost is the
change against "off" in the same run, also taken round by round (each level's run against the same round's off:
the median and the spread of those paired changes, and their medians when the level ran after off and before it).
A level named twice runs twice, the second labelled "(again)": ``--tracing-levels off,off`` is the A/A control,
the change that the method alone shows between two runs of the same code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

LEVELS = (("off", None), ("ratio 0", "0"), ("1 %", "0.01"), ("100 %", "1.0"), ("100 %, all threads", "1.0"),
          ("100 %, all processes", "1.0"))  # fmt: skip
EXPORT_MODES = {"100 %, all threads": "thread", "100 %, all processes": "process"}  # FLEETWIRE_TRACE_EXPORT by level
EXPORT_DELAY_MS = {name: "200" for name, ratio in LEVELS if ratio == "1.0"}  # OTEL_BSP_SCHEDULE_DELAY (docstring)
TARGETS = {"1 %": 1.0, "100 %": 5.0}  # the most throughput may drop, in per cent (issue #32)
# compare.py --tracing-levels: the levels' short names; "off" always runs (the baseline the others are read against).
LEVEL_KEYS = {"off": "off", "0": "ratio 0", "1": "1 %", "100": "100 %", "100-threads": "100 %, all threads",
              "100-processes": "100 %, all processes"}  # fmt: skip


class Level(NamedTuple):
    """A level as run: its label in the table, the sampling ratio (None: off), and the level it repeats (its name)."""

    label: str
    ratio: str | None
    base: str


def chosen_levels(keys: str) -> tuple[Level, ...]:
    """The levels a ``--tracing-levels`` list names (comma-separated :data:`LEVEL_KEYS`), "off" first, table order;
    a level named again runs again, labelled "(again)" ("off,off": the A/A control, off against off)."""
    counts: dict[str, int] = {}
    for key in filter(None, (k.strip() for k in keys.split(","))):
        if key not in LEVEL_KEYS:
            raise SystemExit(f"--tracing-levels: unknown level {key!r}; one of {', '.join(LEVEL_KEYS)}")
        counts[LEVEL_KEYS[key]] = counts.get(LEVEL_KEYS[key], 0) + 1
    counts["off"] = max(counts.get("off", 0), 1)  # the baseline always runs
    levels = []
    for name, ratio in LEVELS:
        for n in range(counts.get(name, 0)):
            levels.append(Level(name if n == 0 else f"{name} (again)" if n == 1 else f"{name} (again {n})",
                                ratio, name))  # fmt: skip
    return tuple(levels)


def round_order(levels: Sequence[Level], round_index: int, order: str = "rotate") -> list[Level]:
    """The order the levels run in round ``round_index`` (from 0): ``rotate`` starts each round one level further
    on (off, 1 %; 1 %, off; ...), so each level runs in each slot as often as the others over ``len(levels)``
    rounds; ``fixed`` runs them in table order every round."""
    if order == "fixed" or not levels:
        return list(levels)
    k = round_index % len(levels)
    return [*levels[k:], *levels[:k]]


def paired_changes(
    rates: Mapping[str, Sequence[float | None]], orders: Sequence[Sequence[str]], label: str, base: str = "off"
) -> dict[str, Any]:
    """``label``'s figure against ``base``'s round by round, in per cent (rounds where both ran): every change, their
    median and range, and their medians when ``label`` ran after ``base`` in its round and before it."""
    changes, after, before = [], [], []
    for r, (mine, theirs) in enumerate(zip(rates[label], rates[base], strict=True)):
        if not mine or not theirs:
            continue
        change = (mine / theirs - 1) * 100
        changes.append(change)
        (after if orders[r].index(label) > orders[r].index(base) else before).append(change)
    med = statistics.median
    return {"changes": [round(c, 2) for c in changes], "median": med(changes) if changes else None,
            "min": min(changes, default=None), "max": max(changes, default=None),
            "after_base": med(after) if after else None, "before_base": med(before) if before else None,
            "rounds_after": len(after), "rounds_before": len(before)}  # fmt: skip


class Sink:
    """An OTLP/HTTP endpoint that answers 200 and keeps what was posted."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector: not a new connection for every post

            def do_POST(self) -> None:
                sink.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self, bodies: list[bytes] | None = None) -> int | None:
        """Spans received so far, or in ``bodies`` (None: opentelemetry-proto is not installed to count them)."""
        try:
            from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
        except ImportError:
            return None
        total = 0
        for body in self.bodies if bodies is None else bodies:
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            total += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return total


ENV_KEYS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_BSP_SCHEDULE_DELAY",
            "FLEETWIRE_TRACE_EXPORT")  # fmt: skip


def _configure(level: Level, endpoint: str) -> None:
    """The variables the daemons and the client read for ``level`` (the others unset)."""
    for key in ENV_KEYS:
        os.environ.pop(key, None)
    if level.ratio is None:
        return
    os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                      OTEL_TRACES_SAMPLER_ARG=level.ratio)  # fmt: skip
    if level.base in EXPORT_MODES:
        os.environ["FLEETWIRE_TRACE_EXPORT"] = EXPORT_MODES[level.base]
    if level.base in EXPORT_DELAY_MS:
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS[level.base]


class Runs:
    """Every level's figures, round by round (None where a run failed): the table is read from these."""

    def __init__(self, levels: Sequence[Level], rounds: int) -> None:
        labels = [level.label for level in levels]
        self.rates: dict[str, list[float | None]] = {label: [None] * rounds for label in labels}
        self.p50s: dict[str, list[float | None]] = {label: [None] * rounds for label in labels}
        self.cpus: dict[str, list[float | None]] = {label: [None] * rounds for label in labels}  # µs a plan, all
        self.by_process: dict[str, dict[str, list[float]]] = {label: {} for label in labels}  # the same, per process
        self.posts: dict[str, int] = dict.fromkeys(labels, 0)
        self.bodies: dict[str, list[bytes]] = {label: [] for label in labels}  # each level's posts, counted after
        self.errors: dict[str, str] = {}
        self.orders: list[list[str]] = []  # each round's labels in the order they ran

    def add(self, label: str, r: int, plans: int, t: dict[str, Any], lat: dict[str, Any]) -> None:
        """Round ``r``'s throughput (``t``) and latency (``lat``) results of ``label``."""
        for result in (t, lat):
            if "error" in result:
                self.errors[label] = result["error"]
        self.rates[label][r] = t.get("plans_per_s")
        if isinstance(t.get("cpu_s"), dict):
            self.cpus[label][r] = sum(t["cpu_s"].values()) / plans * 1e6
            for process, seconds in t["cpu_s"].items():
                self.by_process[label].setdefault(process, []).append(seconds / plans * 1e6)
        self.p50s[label][r] = lat.get("p50_ms")


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v]
    return statistics.median(present) if present else None


def _change(value: float | None, base: float | None) -> float | None:
    return (value / base - 1) * 100 if value and base else None


def measure(ns: argparse.Namespace, run: Callable[..., dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Run every level ``ns.rounds`` times, each round in :func:`round_order`; the table's lines and the results."""
    sink = Sink()
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    levels = chosen_levels(getattr(ns, "tracing_levels", ",".join(LEVEL_KEYS)))
    order = getattr(ns, "tracing_order", "rotate")
    runs = Runs(levels, ns.rounds)
    try:
        for r in range(ns.rounds):
            ordered = round_order(levels, r, order)
            runs.orders.append([level.label for level in ordered])
            for level in ordered:
                _configure(level, sink.endpoint)
                before = len(sink.bodies)
                t = run("throughput.py", "--plans", str(ns.plans), "--store", ns.store, "--collect-after-warmup",
                        timeout_s=ns.timeout)
                lat = run("latency.py", "--samples", str(ns.samples), "--store", ns.store, timeout_s=ns.timeout)
                runs.add(level.label, r, ns.plans, t, lat)
                runs.posts[level.label] += len(sink.bodies) - before
                runs.bodies[level.label] += sink.bodies[before:]  # every daemon flushed at its shutdown: all in
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return report(ns, levels, runs, sink, order)


def report(ns: argparse.Namespace, levels: Sequence[Level], runs: Runs, sink: Sink,
           order: str = "rotate") -> tuple[list[str], dict[str, Any]]:  # fmt: skip
    """The table's lines and the results of ``runs`` (:func:`measure`)."""
    base_rate, base_p50, base_cpu = _median(runs.rates["off"]), _median(runs.p50s["off"]), _median(runs.cpus["off"])
    lines = [
        f"tracing cost ({ns.plans:,} no-op plans throughput, {ns.samples} sequential round trips; store {ns.store}; "
        f"median of {ns.rounds} interleaved rounds, order {order}; OTLP/HTTP to a local sink)",
        "| sampling | throughput | change | paired change a round: median [range]; after off / before off | "
        "CPU per plan, all processes | change | p50 round trip | change | OTLP posts | target (throughput) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    results: dict[str, Any] = {"levels": {}, "spans_received": sink.spans(), "errors": runs.errors,
                               "order": order, "orders": runs.orders}  # fmt: skip
    for level in levels:
        name = level.label
        rate, p50, cpu = _median(runs.rates[name]), _median(runs.p50s[name]), _median(runs.cpus[name])
        d_rate, d_p50, d_cpu = _change(rate, base_rate), _change(p50, base_p50), _change(cpu, base_cpu)
        paired = paired_changes(runs.rates, runs.orders, name) if name != "off" else None
        target = TARGETS.get(name)
        verdict = "-" if target is None or d_rate is None else (
            f"{'met' if -d_rate <= target else 'MISSED'} (<= {target:g} % drop)")  # fmt: skip
        lines.append(
            f"| {name} | {runs.errors.get(name) or f'{rate:,.0f} plans/s' if rate else '-'} | "
            f"{'-' if d_rate is None or name == 'off' else f'{d_rate:+.1f} %'} | {_fmt_paired(paired)} | "
            f"{f'{cpu:.0f} µs' if cpu else '-'} | {'-' if d_cpu is None or name == 'off' else f'{d_cpu:+.1f} %'} | "
            f"{f'{p50:.3f} ms' if p50 else '-'} | {'-' if d_p50 is None or name == 'off' else f'{d_p50:+.1f} %'} | "
            f"{runs.posts[name]} | {verdict} |"
        )
        results["levels"][name] = {
            "plans_per_s": rate, "p50_ms": p50, "rates": runs.rates[name], "p50s": runs.p50s[name],
            "posts": runs.posts[name], "cpu_us_per_plan": cpu, "cpus": runs.cpus[name], "paired_rate": paired,
            "paired_cpu": paired_changes(runs.cpus, runs.orders, name) if name != "off" else None,
            "paired_p50": paired_changes(runs.p50s, runs.orders, name) if name != "off" else None,
            "cpu_us_per_plan_by_process": {p: statistics.median(v) for p, v in runs.by_process[name].items()},
        }  # fmt: skip
    lines.append("paired change a round against off (median [range]; after off / before off), of the CPU per plan "
                 "(steadier than throughput on a busy machine) and the p50: " + " | ".join(
                     f"{level.label}: CPU {_fmt_paired(results['levels'][level.label]['paired_cpu'])}, "
                     f"p50 {_fmt_paired(results['levels'][level.label]['paired_p50'])}"
                     for level in levels if level.label != "off"))  # fmt: skip
    zero = next((level.label for level in levels if level.base == "ratio 0"), None)
    if zero is not None:  # propagation (ratio 0 less off) apart from the sampled plans' spans (each level less ratio 0)
        sampled = [level.label for level in levels if level.ratio not in (None, "0")]
        results["paired_cpu_against_ratio_0"] = {
            name: paired_changes(runs.cpus, runs.orders, name, zero) for name in sampled}  # fmt: skip
        lines.append("paired change a round against ratio 0 (the sampled plans' share), of the CPU per plan: " + (
            " | ".join(f"{name}: {_fmt_paired(results['paired_cpu_against_ratio_0'][name])}" for name in sampled)
            or "-"))  # fmt: skip
    processes = sorted({p for per in runs.by_process.values() for p in per})
    lines.append("CPU µs per plan by process (median of rounds): " + "; ".join(
        f"{level.label}: " + ", ".join(f"{p} {statistics.median(runs.by_process[level.label][p]):.0f}"
                                       for p in processes if runs.by_process[level.label].get(p))
        for level in levels))  # fmt: skip
    lines += _spans_lines(ns, levels, runs, sink, results)
    return lines, results


def _fmt_paired(paired: dict[str, Any] | None) -> str:
    if paired is None or paired["median"] is None:
        return "-"
    side = " / ".join("-" if v is None else f"{v:+.1f} % ({n})" for v, n in (
        (paired["after_base"], paired["rounds_after"]), (paired["before_base"], paired["rounds_before"])))  # fmt: skip
    return f"{paired['median']:+.1f} % [{paired['min']:+.1f}, {paired['max']:+.1f}]; {side}"


def _spans_lines(ns: argparse.Namespace, levels: Sequence[Level], runs: Runs, sink: Sink,
                 results: dict[str, Any]) -> list[str]:  # fmt: skip
    """The spans each 100 % level's runs posted against the six a plan they make (fewer: spans dropped)."""
    counted = results["spans_received"]
    shown = counted if counted is not None else "? (no opentelemetry-proto to count them)"
    # At 100 % every plan is six spans (submit; queue, two commits; attempt, handler): the throughput run's plans and
    # its warm-up plan, the latency run's samples and its 200 warm-up plans. Fewer received: spans dropped.
    expected = 6 * (ns.plans + 1 + ns.samples + 200) * ns.rounds
    received = {level.label: sink.spans(runs.bodies[level.label]) for level in levels if level.ratio == "1.0"}
    results["dropped_at_100"] = {name: None if got is None else expected - got for name, got in received.items()}
    return [
        "spans at 100 % (six a plan), received / expected (dropped): " + "; ".join(
            f"{name}: {got} / {expected} ({expected - got})" if got is not None else f"{name}: ?"
            for name, got in received.items()),
        f"spans received by the sink, all levels: {shown}",
    ]  # fmt: skip
