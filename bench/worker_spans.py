"""What a traced plan's worker spans cost, where (callgrind; issue #32, docs/PERFORMANCE.md §T32g).

    python bench/worker_spans.py                  # this tree
    python bench/worker_spans.py --compare PATH   # and another checkout, same sitting

A sampled ``assign`` (echo, no inputs) gives the worker an attempt span and a handler span
(worker_agent/plan_tracing.py): noted on the worker's loop (``attempt_span``, ``child_span``, the outcome set,
both ended), packed by its exporter thread (msgpack, as ``ExportProcess.send``), then unpacked and encoded to
OTLP bytes in its exporter child (as ``SpanBuilder.export``: ``StepSpans.expand``, ``SpanEncoder.encode``).
Instructions a plan for each stage: the callgrind difference of a 3,000- and a 1,000-plan run of the stages up
to it, so start-up cancels out and the machine's load does not move it.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STAGES = ("loop", "pack", "child")
BATCH = 2048


def run(stage: str, plans: int) -> None:
    """Note ``plans`` plans' worker spans, and (``stage``) pack them, and unpack and encode them."""
    import msgspec

    from protocol.messages import Assign
    from wireio.otlp import SpanEncoder
    from wireio.span_export import StepSpans
    from wireio.tracing import Sampler, Tracing
    from worker_agent.plan_tracing import attempt_span, child_span

    tracing = Tracing.__new__(Tracing)  # the hot path's state only: no exporter thread, no child
    tracing._queue = collections.deque()
    tracing._max_queue = 1 << 30
    tracing._batch = 1 << 30
    tracing._wake = threading.Event()
    tracing._parked = False  # the exporter thread's park flag (61906e1; unused by older trees)
    tracing.dropped = 0
    tracing.sampler = Sampler()
    assigns = [Assign(plan_id=f"p-{i:08d}", attempt=1, op="echo", args=i,
                      traceparent=f"00-{i + 1:032x}-{i + 7:016x}-01") for i in range(plans)]  # fmt: skip
    for assign in assigns:  # as worker_agent/runner.py: the attempt, its handler span, the outcome
        span = attempt_span(tracing, assign, "worker-1")
        assert span is not None
        handler = child_span(tracing, span, "fleetwire.handler", {"fleetwire.plan_id": assign.plan_id})
        assert handler is not None
        handler.traceparent  # noqa: B018  (the handler's context, formatted for it)
        handler.end("")
        span.set("fleetwire.outcome", "succeeded")
        span.end("")
    if stage == "loop":
        return
    queue = list(tracing._queue)
    encode = msgspec.msgpack.Encoder().encode
    frames = [encode((0, queue[i : i + BATCH])) for i in range(0, len(queue), BATCH)]
    if stage == "pack":
        return
    decode = msgspec.msgpack.Decoder().decode
    encoder = SpanEncoder({"service.name": "fleetwire-worker"}, "fleetwire")
    steps = StepSpans()
    for frame in frames:
        _, batch = decode(frame)
        encoder.encode(steps.expand(batch, encoder))


def instructions(tree: str, stage: str, plans: int, tmp: str) -> int:
    from _harness import callgrind_total  # the parent's only: a child's count has no more imports than before

    return callgrind_total(tree, [__file__, "--child", stage, str(plans)], os.path.join(tmp, f"cg.{stage}.{plans}"))


def per_plan(tree: str) -> dict[str, float]:
    """Callgrind instructions a plan up to each stage: (Ir(3,000 plans) - Ir(1,000 plans)) / 2,000."""
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}  # compiled first: no run counts the compiling
    subprocess.run([sys.executable, __file__, "--child", "child", "10"], env=env, cwd=tree, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        return {s: (instructions(tree, s, 3000, tmp) - instructions(tree, s, 1000, tmp)) / 2000 for s in STAGES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", metavar="PATH", help="also measure the tree at PATH")
    parser.add_argument("--child", nargs=2, metavar=("STAGE", "PLANS"), help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        run(ns.child[0], int(ns.child[1]))
        return 0
    for tree in [ROOT] + ([os.path.abspath(ns.compare)] if ns.compare else []):
        f = per_plan(tree)
        print(f"{tree}: a plan (2 spans): loop {f['loop']:,.0f}, pack {f['pack'] - f['loop']:,.0f}, "
              f"child {f['child'] - f['pack']:,.0f} ({(f['child'] - f['pack']) / 2:,.0f} a span)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
