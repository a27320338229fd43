"""The client's tracing path of a lone submit (``Client.submit``: ``start_submit_spans`` of one submit, outside any
span), warm instructions and cold time (issue #32, docs/PERFORMANCE.md §T32h, §T32j).

    python bench/lone_submit_tracing.py                        # this tree
    python bench/lone_submit_tracing.py --compare /tmp/wt_old  # and another checkout, same sitting, interleaved

The client's tracer at ``--ratio`` (default 0.01, ``parentbased_traceidratio``; its exporter keeps nothing and posts
nowhere), OpenTelemetry imported as the tracer imports it, and each submit's tracing path run alone:
``start_submit_spans([submit])`` then ``end_submit_spans`` (one submit, its ``traceparent`` cleared before each call;
the collector off), ``random`` seeded alike in every tree.

``instructions``: callgrind's count a call, the difference of a ``--calls`` and a 4x run over their difference (the
start-up and imports cancel out; the machine's load does not move it). ``cold_us``: on a lone round trip the path
runs once among other processes' work, its code and data out of the CPU's caches (§T32h): each call is timed alone
after touching a 96 MiB buffer line by line, ``--cold`` calls, the median (noisy: give the load; trees alternate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _harness as h

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLUSH_BYTES = 96 << 20


def child(calls: int, ratio: float, cold: int) -> None:
    import gc
    import random

    import fleetwire.tracing as ft
    from protocol.messages import Submit
    from wireio.tracing import SERVICE_CLIENT, Tracing

    class _Nowhere:
        def export(self, spans: object) -> None:
            pass

        def force_flush(self, timeout_millis: int = 0) -> bool:
            return True

        def shutdown(self) -> None:
            pass

    random.seed(7)
    environ = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(ratio),
               "OTEL_BSP_SCHEDULE_DELAY": "600000"}  # fmt: skip
    tracing = Tracing(SERVICE_CLIENT, exporter=_Nowhere(), environ=environ)
    import opentelemetry.trace  # noqa: F401  (the SDK's exporter imports it: the client's usual state)

    ft._tracing = tracing
    start, end = ft.start_submit_spans, ft.end_submit_spans
    msgs = [Submit(req_id=1, op="echo")]  # one submit, its traceparent cleared each call: no allocation counted
    msg = msgs[0]
    for _ in range(10):  # warm: nothing first-time in the counted calls
        msg.traceparent = ""
        end(start(msgs))
    gc.disable()  # the count is the path's, not a collection's that one run makes and the other does not
    if not cold:
        for _ in range(calls):
            msg.traceparent = ""
            end(start(msgs))
        tracing.shutdown()
        return
    buffer = bytearray(FLUSH_BYTES)
    zeros = bytes(FLUSH_BYTES // 64)
    times = []
    clock = time.perf_counter_ns
    for _ in range(cold):
        msg.traceparent = ""
        buffer[::64] = zeros  # every line written: the caches hold the buffer, not the path
        t0 = clock()
        end(start(msgs))
        times.append(clock() - t0)
    tracing.shutdown()
    print(json.dumps({"cold_ns": statistics.median(times)}))


def instructions(tree: str, calls: int, ratio: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        counts = []
        for n in (calls, 4 * calls):
            argv = [os.path.join(HERE, "lone_submit_tracing.py"), "--child", "--calls", str(n), "--ratio", str(ratio),
                    "--cold", "0"]  # fmt: skip
            counts.append(h.callgrind_total(tree, argv, os.path.join(tmp, f"cg.{n}")))
    return (counts[1] - counts[0]) / (3 * calls)


def cold_us(tree: str, cold: int, ratio: float) -> float:
    argv = [sys.executable, os.path.join(HERE, "lone_submit_tracing.py"), "--child", "--cold", str(cold),
            "--ratio", str(ratio)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=True).stdout
    return float(json.loads(out.splitlines()[-1])["cold_ns"]) / 1000


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000, help="calls of the smaller callgrind run (default 20000)")
    parser.add_argument("--ratio", type=float, default=0.01, help="the sampler's ratio (default 0.01)")
    parser.add_argument("--cold", type=int, default=300, help="cold calls timed a run (0: none; default 300)")
    parser.add_argument("--rounds", type=int, default=1, help="cold runs of each tree, alternated (default 1)")
    parser.add_argument("--no-callgrind", action="store_true", help="the cold time only")
    parser.add_argument("--compare", metavar="PATH", nargs="+", default=[], help="also measure the tree(s) at PATH")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        child(ns.calls, ns.ratio, ns.cold)
        return 0
    trees = [ROOT, *(os.path.abspath(path) for path in ns.compare)]
    result: dict[str, dict[str, object]] = {tree: {"cold_us": []} for tree in trees}
    if not ns.no_callgrind:
        for tree in trees:
            result[tree]["instructions"] = round(instructions(tree, ns.calls, ns.ratio))
    for _ in range(ns.rounds if ns.cold else 0):
        for tree in trees:
            result[tree]["cold_us"].append(round(cold_us(tree, ns.cold, ns.ratio), 2))  # type: ignore[union-attr]
    print(json.dumps({"bench": "lone_submit_tracing", "ratio": ns.ratio, "load": os.getloadavg()[0], **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
