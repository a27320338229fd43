"""Instructions per traced plan in the coordinator and in its span exporter (callgrind; issue #32).

    python bench/tracing_per_plan.py                        # this tree
    python bench/tracing_per_plan.py --compare /tmp/wt_old  # and another checkout, same sitting
    python bench/tracing_per_plan.py --every 100            # 1 % of the plans traced
    python bench/tracing_per_plan.py --every -1             # ratio 0: tracing on, no plan traced

``coordinator``: the pure core with tracing on (``Streams.tracing``) driven as bench/core_per_plan.py drives
it (echo plans in batches of 500, two workers of 1000 slots that accept, emit and finish every plan), each
step's trace notes handed to ``PlanSpans`` (coordinator/io/ops/tracing.py) as the driver hands them, and what
it noted packed with msgpack as the tracer's exporter thread packs it for its child: the coordinator process's
own work for its spans, less the pipe. ``--every N`` traces one plan in N (the others carry ``"00"``, the
unsampled decision, as the SDK sends them at 1 %; no ``traceparent`` in trees without it); ``--every 0``: none,
tracing off in the core; ``--every -1``: ratio 0, tracing on in the core and every plan carrying ``"00"`` (what
propagation costs with no plan sampled: ``--every -1`` less ``--every 0``). ``exporter``: what the span exporter
child does with those spans (wireio/span_export.py ``main``, less the HTTP post): unpack 2,048-record frames, make
the coordinator's step records into spans (``StepSpans``, in trees that send them) and encode them as OTLP
(wireio/otlp.py), its collector as the child sets it. Each figure is the callgrind difference of two runs of
different sizes (start-up and imports cancel out), so the machine's load does not move it; ``--no-callgrind`` prints
CPU µs instead (noisy).
"""

from __future__ import annotations

import argparse
import collections
import gc
import inspect
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from _echo_core import CLIENT, WORKERS, echo_core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = 500
CONTEXTS = 3000  # the callers' contexts, drawn before a run (a plan's is the one at its index modulo this)


def coordinator(plans: int, every: int, dump: str | None = None) -> float:
    """``plans`` echo plans through the core, one in ``every`` traced (0: tracing off; -1: on, none traced); CPU
    seconds spent."""
    import msgspec

    from coordinator.io.ops.tracing import PlanSpans
    from protocol.messages import Accept, Assign, Done, Event, Submit
    from wireio.tracing import Sampler, Tracing

    tracing = Tracing.__new__(Tracing)  # the hot path's fields only: no exporter thread, no child
    tracing._queue, tracing._max_queue, tracing._batch = collections.deque(), 1 << 40, 1 << 40
    tracing._wake, tracing.dropped, tracing.sampler = threading.Event(), 0, Sampler()
    tracing._parked = False  # the exporter thread's park flag (61906e1; unused by older trees)
    tracing._noted = tracing._taken = 0  # the step records' weight (wireio/tracing.py add_step; unused by older trees)
    spans = PlanSpans(tracing)
    pack = msgspec.msgpack.Encoder().encode
    kept: list[Any] = []
    ids = (f"p{i}" for i in itertools.count(1))
    core = echo_core(lambda: next(ids))  # one client holds them all (bench/_echo_core.py)
    core.streams.tracing = every != 0
    workers, client = WORKERS, CLIENT
    rnd = random.Random(1)
    try:  # an unsampled plan carries the SDK's "no" without ids where the tree has it (protocol/tracecontext.py)
        from protocol.tracecontext import UNSAMPLED as unsampled
    except ImportError:
        unsampled = ""
    contexts = [f"00-{rnd.getrandbits(128):032x}-{rnd.getrandbits(64):016x}-01" for _ in range(CONTEXTS)]
    # as many drawn in either run of a count: their ~6.5k instructions a plan cancel out
    parents = [contexts[i % CONTEXTS] if every > 0 and i % every == 0 else unsampled if every else ""
               for i in range(plans)]  # fmt: skip
    pending: dict[int, list[Any]] = {conn: [] for conn in workers}
    seqs = dict.fromkeys(workers, 0)
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # the daemon's (fleetwire/cli/serve.py)

    def pump() -> None:
        effects = core.take_effects()
        if effects.traces is not None:
            spans.flushed(effects.traces)
            spans.delivered(effects.traces)
        queue = tracing._queue
        if queue:
            batch = list(queue)
            queue.clear()
            pack((0, batch))
            if dump is not None:
                kept.extend(batch)
        for conn, msgs in effects.sends.items():
            if conn in pending:
                pending[conn].extend(m for m in msgs if isinstance(m, Assign))

    now, done = 1.0, 0
    t0 = time.process_time()
    for start in range(0, plans, BATCH):
        for i in range(start, min(plans, start + BATCH)):
            core.receive(client, Submit(req_id=i + 1, op="echo", args=i, subscribe=True, traceparent=parents[i]), now)
        pump()
        now += 0.001
    while done < plans:
        before = done
        for conn in workers:
            assigned, pending[conn] = pending[conn][:BATCH], pending[conn][BATCH:]
            seq = seqs[conn]
            for a in assigned:
                core.receive(conn, Accept(plan_id=a.plan_id, attempt=a.attempt, seq=seq + 1), now)
                core.receive(conn, Event(plan_id=a.plan_id, attempt=a.attempt, kind="echo", data=a.args, seq=seq + 2),
                             now)  # fmt: skip
                core.receive(conn, Done(plan_id=a.plan_id, attempt=a.attempt, outcome="succeeded", result=a.args,
                                        seq=seq + 3), now)  # fmt: skip
                seq += 3
                done += 1
            seqs[conn] = seq
            pump()
            now += 0.001
        if done == before:
            raise RuntimeError(f"stuck after {done} of {plans} plans")
    spent = time.process_time() - t0
    if dump is not None:
        with open(dump, "wb") as fh:
            fh.write(msgspec.msgpack.encode(kept))
    return spent


def exporter(path: str, rounds: int) -> float:
    """The exporter child's unpacking and encoding of the spans in ``path``, ``rounds`` times; CPU seconds."""
    import msgspec

    from wireio.otlp import SpanEncoder

    with open(path, "rb") as fh:
        spans = msgspec.msgpack.decode(fh.read())
    frames = [msgspec.msgpack.encode((0, spans[k : k + 2048])) for k in range(0, len(spans), 2048)]
    encoder = SpanEncoder({"service.name": "fleetwire-coordinator", "telemetry.sdk.language": "python"})
    decode = msgspec.msgpack.Decoder().decode
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 100)  # the child's (wireio/span_export.py)
    t0 = time.process_time()
    for _ in range(rounds):
        expand = _expander(encoder)  # the coordinator's step records made into spans there (trees that send them)
        for frame in frames:
            encoder.encode(expand(decode(frame)[1]))
    return time.process_time() - t0


def _expander(encoder: Any = None) -> Any:
    """What the exporter does to a batch before encoding it: ``StepSpans().expand`` where the tree has it, given the
    encoder where it takes one (it then encodes the spans it makes at once, as the exporter child does)."""
    try:
        from wireio.span_export import StepSpans
    except ImportError:
        return lambda batch: batch
    expand = StepSpans().expand
    if encoder is not None and "encoder" in inspect.signature(expand).parameters:
        return lambda batch: expand(batch, encoder)
    return expand


def count(path: str) -> int:
    """The spans the noted records in ``path`` make."""
    import msgspec

    with open(path, "rb") as fh:
        return len(_expander()(msgspec.msgpack.decode(fh.read())))


def _python(tree: str, args: list[str], callgrind: bool) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--inside", *args]
    if callgrind:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd]
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree, check=True)


def _collected(proc: subprocess.CompletedProcess[str]) -> int:
    line = next(x for x in proc.stderr.splitlines() if "Collected" in x)
    return int(line.split()[-1])


def _seconds(stdout: str) -> float:
    """The CPU seconds an inside run printed (its last JSON line; the core logs to stdout too)."""
    return float(json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])["s"])


def measure(tree: str, ns: argparse.Namespace, scratch: str) -> dict[str, Any]:
    """This tree's figures: coordinator instructions (or µs) per plan, exporter per span."""
    dump = os.path.join(scratch, f"spans-{abs(hash(tree))}.msgpack")
    small, large = ns.plans // 3, ns.plans
    result: dict[str, Any] = {"tree": tree}
    out = _python(tree, ["coordinator", str(large), str(ns.every), dump], False).stdout  # the spans, kept apart
    if ns.callgrind:
        a = _collected(_python(tree, ["coordinator", str(small), str(ns.every)], True))
        b = _collected(_python(tree, ["coordinator", str(large), str(ns.every)], True))
        result["coordinator_instructions_per_plan"] = round((b - a) / (large - small))
    else:
        out = _python(tree, ["coordinator", str(large), str(ns.every)], False).stdout
        result["coordinator_us_per_plan"] = round(_seconds(out) / large * 1e6, 2)
    if ns.every > 0:
        count = int(_seconds(_python(tree, ["count", dump], False).stdout))
        if ns.callgrind:
            a = _collected(_python(tree, ["exporter", dump, "1"], True))
            b = _collected(_python(tree, ["exporter", dump, "3"], True))
            result["exporter_instructions_per_span"] = round((b - a) / (2 * count))
        else:
            out = _python(tree, ["exporter", dump, "3"], False).stdout
            result["exporter_us_per_span"] = round(_seconds(out) / (3 * count) * 1e6, 2)
        result["spans_per_plan"] = round(count / (large // ns.every if ns.every > 1 else large), 2)
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--inside"]:
        what, *rest = argv[1:]
        if what == "coordinator":
            spent = coordinator(int(rest[0]), int(rest[1]), rest[2] if len(rest) > 2 else None)
        elif what == "count":
            spent = float(count(rest[0]))
        else:
            spent = exporter(rest[0], int(rest[1]))
        print(json.dumps({"s": spent}))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=3000, help="plans in the larger run (default 3000)")
    parser.add_argument(
        "--every", type=int, default=1, help="trace one plan in N (default 1: all; 0: none, tracing off; -1: ratio 0)"
    )
    parser.add_argument("--compare", metavar="PATH", help="another checkout to measure the same way")
    parser.add_argument("--no-callgrind", dest="callgrind", action="store_false", help="CPU µs instead")
    ns = parser.parse_args(argv)
    if ns.callgrind and shutil.which("valgrind") is None:
        print("tracing_per_plan: valgrind is not installed: --no-callgrind for CPU µs", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="fleetwire-tracing-") as scratch:
        for tree in [ROOT, *([ns.compare] if ns.compare else [])]:
            print(json.dumps(measure(os.path.abspath(tree), ns, scratch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
