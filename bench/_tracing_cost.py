"""What tracing costs fleetwire (``bench/compare.py --tracing``): throughput and latency, off / 1 % / 100 %.

    python bench/compare.py --peers none --tracing --plans 3000 --samples 300 --rounds 2

Each level runs bench/throughput.py and bench/latency.py (coordinator, worker and client each in
its own process, on 127.0.0.1) with the standard variables: ``OTEL_EXPORTER_OTLP_ENDPOINT`` set
to an OTLP/HTTP sink in this process (it keeps the posted bodies and decodes them after the runs,
so it does not compete for the CPU meanwhile), ``OTEL_TRACES_SAMPLER=parentbased_traceidratio``
and ``OTEL_TRACES_SAMPLER_ARG`` 0.01 or 1.0: the client's submit spans sample; the coordinator and
the worker follow the caller (parent-based). "off" has no endpoint: nothing is imported. At 100 %
the exporters post whenever a batch of 2,048 spans is queued, and every ``OTEL_BSP_SCHEDULE_DELAY``
= 200 ms (not the default 5 s), so what is left after the last batch is exported inside the timed
window, as it would be in a fleet that runs all day; at 1 % the default delay stays (a post every
200 ms would cost more than the spans: each post is ~1 ms of CPU in the exporter's HTTP client).

Where the spans are exported (``FLEETWIRE_TRACE_EXPORT``, wireio/tracing.py): at "1 %" and "100 %"
as shipped, the coordinator and the workers through their exporter child processes and the client
in its own thread; "100 %, all threads" every process in its own exporter thread (as before the
child processes); "100 %, all processes" the client through a child too. The CPU columns count the
children (bench/throughput.py adds each daemon's child processes). Levels run in interleaved rounds
(off, 1 %, 100 %, ..., off, ...) and each figure is the median over the rounds, so the machine's
drift falls on every level. The cost is the change against "off" in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LEVELS = (("off", None), ("1 %", "0.01"), ("100 %", "1.0"), ("100 %, all threads", "1.0"),
          ("100 %, all processes", "1.0"))  # fmt: skip
EXPORT_MODES = {"100 %, all threads": "thread", "100 %, all processes": "process"}  # FLEETWIRE_TRACE_EXPORT by level
EXPORT_DELAY_MS = {name: "200" for name, ratio in LEVELS if ratio == "1.0"}  # OTEL_BSP_SCHEDULE_DELAY (docstring)
TARGETS = {"1 %": 1.0, "100 %": 5.0}  # the most throughput may drop, in per cent (issue #32)
# compare.py --tracing-levels: the levels' short names; "off" always runs (the baseline the others are read against).
LEVEL_KEYS = {"off": "off", "1": "1 %", "100": "100 %", "100-threads": "100 %, all threads",
              "100-processes": "100 %, all processes"}  # fmt: skip


def chosen_levels(keys: str) -> tuple[tuple[str, str | None], ...]:
    """The levels a ``--tracing-levels`` list names (comma-separated :data:`LEVEL_KEYS`), "off" first, table order."""
    names = {"off"}
    for key in filter(None, (k.strip() for k in keys.split(","))):
        if key not in LEVEL_KEYS:
            raise SystemExit(f"--tracing-levels: unknown level {key!r}; one of {', '.join(LEVEL_KEYS)}")
        names.add(LEVEL_KEYS[key])
    return tuple(level for level in LEVELS if level[0] in names)


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


def measure(ns: argparse.Namespace, run: Callable[..., dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    """Run every level ``ns.rounds`` times; the table's lines and the results."""
    sink = Sink()
    saved = {k: os.environ.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_TRACES_SAMPLER",
                                            "OTEL_TRACES_SAMPLER_ARG", "OTEL_BSP_SCHEDULE_DELAY",
                                            "FLEETWIRE_TRACE_EXPORT")}  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name, _ in LEVELS}
    p50s: dict[str, list[float]] = {name: [] for name, _ in LEVELS}
    cpus: dict[str, list[float]] = {name: [] for name, _ in LEVELS}  # CPU µs per plan, every process together
    by_process: dict[str, dict[str, list[float]]] = {name: {} for name, _ in LEVELS}  # the same, per process
    spans: dict[str, int] = {name: 0 for name, _ in LEVELS}
    bodies: dict[str, list[bytes]] = {name: [] for name, _ in LEVELS}  # each level's posts: its spans, counted after
    errors: dict[str, str] = {}
    levels = chosen_levels(getattr(ns, "tracing_levels", ",".join(LEVEL_KEYS)))
    try:
        for _ in range(ns.rounds):
            for name, ratio in levels:
                for key in saved:
                    os.environ.pop(key, None)
                if ratio is not None:
                    os.environ.update(
                        OTEL_EXPORTER_OTLP_ENDPOINT=sink.endpoint,
                        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                        OTEL_TRACES_SAMPLER_ARG=ratio,
                    )
                    if name in EXPORT_MODES:
                        os.environ["FLEETWIRE_TRACE_EXPORT"] = EXPORT_MODES[name]
                    if name in EXPORT_DELAY_MS:
                        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = EXPORT_DELAY_MS[name]
                before = len(sink.bodies)
                t = run("throughput.py", "--plans", str(ns.plans), "--store", ns.store, timeout_s=ns.timeout)
                lat = run("latency.py", "--samples", str(ns.samples), "--store", ns.store, timeout_s=ns.timeout)
                for result in (t, lat):
                    if "error" in result:
                        errors[name] = result["error"]
                if "plans_per_s" in t:
                    rates[name].append(t["plans_per_s"])
                if isinstance(t.get("cpu_s"), dict):
                    cpus[name].append(sum(t["cpu_s"].values()) / ns.plans * 1e6)
                    for process, seconds in t["cpu_s"].items():
                        by_process[name].setdefault(process, []).append(seconds / ns.plans * 1e6)
                if "p50_ms" in lat:
                    p50s[name].append(lat["p50_ms"])
                spans[name] += len(sink.bodies) - before  # requests now; counted as spans below
                bodies[name] += sink.bodies[before:]  # every daemon flushed at its shutdown: the run's spans are in
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    counted = sink.spans()
    base_rate = statistics.median(rates["off"]) if rates["off"] else None
    base_p50 = statistics.median(p50s["off"]) if p50s["off"] else None
    base_cpu = statistics.median(cpus["off"]) if cpus["off"] else None
    lines = [
        f"tracing cost ({ns.plans:,} no-op plans throughput, {ns.samples} sequential round trips; store {ns.store}; "
        f"median of {ns.rounds} interleaved rounds; OTLP/HTTP to a local sink)",
        "| sampling | throughput | change | CPU per plan, all processes | change | p50 round trip | change | "
        "OTLP posts | target (throughput) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    results: dict[str, Any] = {"levels": {}, "spans_received": counted, "errors": errors}
    for name, _ in levels:
        rate = statistics.median(rates[name]) if rates[name] else None
        p50 = statistics.median(p50s[name]) if p50s[name] else None
        d_rate = (rate / base_rate - 1) * 100 if rate and base_rate else None
        d_p50 = (p50 / base_p50 - 1) * 100 if p50 and base_p50 else None
        cpu = statistics.median(cpus[name]) if cpus[name] else None
        d_cpu = (cpu / base_cpu - 1) * 100 if cpu and base_cpu else None
        target = TARGETS.get(name)
        verdict = "-" if target is None or d_rate is None else (
            f"{'met' if -d_rate <= target else 'MISSED'} (<= {target:g} % drop)")  # fmt: skip
        lines.append(
            f"| {name} | {errors.get(name) or f'{rate:,.0f} plans/s' if rate else '-'} | "
            f"{'-' if d_rate is None or name == 'off' else f'{d_rate:+.1f} %'} | "
            f"{f'{cpu:.0f} µs' if cpu else '-'} | {'-' if d_cpu is None or name == 'off' else f'{d_cpu:+.1f} %'} | "
            f"{f'{p50:.3f} ms' if p50 else '-'} | {'-' if d_p50 is None or name == 'off' else f'{d_p50:+.1f} %'} | "
            f"{spans[name]} | {verdict} |"
        )
        results["levels"][name] = {"plans_per_s": rate, "p50_ms": p50, "rates": rates[name], "p50s": p50s[name],
                                   "posts": spans[name], "cpu_us_per_plan": cpu,
                                   "cpu_us_per_plan_by_process": {p: statistics.median(v)
                                                                  for p, v in by_process[name].items()}}  # fmt: skip
    processes = sorted({p for per in by_process.values() for p in per})
    lines.append("CPU µs per plan by process (median of rounds): " + "; ".join(
        f"{name}: " + ", ".join(f"{p} {statistics.median(by_process[name][p]):.0f}" for p in processes
                                if by_process[name].get(p))
        for name, _ in levels))  # fmt: skip
    shown = counted if counted is not None else "? (no opentelemetry-proto to count them)"
    # At 100 % every plan is six spans (submit; queue, two commits; attempt, handler): the throughput run's plans and
    # its warm-up plan, the latency run's samples and its 200 warm-up plans. Fewer received: spans dropped.
    expected = 6 * (ns.plans + 1 + ns.samples + 200) * ns.rounds
    received = {name: sink.spans(bodies[name]) for name, ratio in levels if ratio == "1.0"}
    lines.append("spans at 100 % (six a plan), received / expected (dropped): " + "; ".join(
        f"{name}: {got} / {expected} ({expected - got})" if got is not None else f"{name}: ?"
        for name, got in received.items()))  # fmt: skip
    results["dropped_at_100"] = {name: None if got is None else expected - got for name, got in received.items()}
    lines.append(f"spans received by the sink, all levels: {shown}")
    return lines, results
