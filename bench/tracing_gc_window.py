"""Where tracing's CPU goes in a throughput window, by process and thread, with each process's collector timed
(issue #32; docs/PERFORMANCE.md §T32o).

    python bench/tracing_gc_window.py --rounds 3 --plans 10000        # off / ratio 0 / 1 %, order rotated

Each run is bench/throughput.py's ``measure`` (coordinator, two workers and the client, 127.0.0.1, memory store) in
a fresh client process, at one level (bench/_tracing_cost.py's variables, its OTLP sink in this process). Over the
timed window (throughput.py's two ``process_time`` calls): the client's collections by generation (``gc.callbacks``,
µs a plan and counts, and where in the window each full one fell, 0-1), its main thread's CPU and its other
threads' (``/proc/self/task/*/schedstat``), and for every process under it (daemons, exporter children) its main
thread's and other threads' CPU, and the daemons' collections (a ``sitecustomize`` that this bench writes to a
temporary directory and puts first on the daemons' ``PYTHONPATH``, active only with ``TRACING_GC_WINDOW_DIR`` set, not
a FLEETWIRE_ name that bench_env drops: ``gc.callbacks`` timing, written out at SIGUSR2). Wall-clock CPU: run
old and new trees interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
LEVELS = (("off", None), ("ratio 0", "0"), ("1 %", "0.01"))
_SITE = """import os
if os.environ.get("TRACING_GC_WINDOW_DIR"):
    import gc, signal, time
    _ns, _n, _at = [0, 0, 0], [0, 0, 0], [0]
    def _timed(phase, info):
        if phase == "start":
            _at[0] = time.perf_counter_ns()
        else:
            g = info["generation"]; _ns[g] += time.perf_counter_ns() - _at[0]; _n[g] += 1
    gc.callbacks.append(_timed)
    def _dump(*_):
        with open(os.path.join(os.environ["TRACING_GC_WINDOW_DIR"], str(os.getpid())), "a") as fh:
            fh.write(" ".join(map(str, _ns + _n)) + "\\n")
    signal.signal(signal.SIGUSR2, _dump)
"""


def _threads(pid: int | str = "self") -> dict[int, int]:
    """Each thread's ns on a CPU (schedstat's first field)."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                out[int(tid)] = int(fh.read().split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def _one(plans: int) -> None:
    """One run in this (fresh) process: print its figures as one JSON line."""
    import gc
    import signal
    import time

    import _harness as h
    import psutil
    import throughput

    gc_ns, gc_n, full_at, started = [0, 0, 0], [0, 0, 0], [], [0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter_ns()
            return
        g = info["generation"]
        gc_ns[g] += time.perf_counter_ns() - started[0]
        gc_n[g] += 1
        if g == 2:
            full_at.append(time.perf_counter())

    gc.callbacks.append(timed)
    marks: list[tuple[float, list[int], list[int], dict[int, int], dict[int, tuple[str, dict[int, int]]]]] = []

    def fleet() -> dict[int, tuple[str, dict[int, int]]]:
        out = {}
        for p in psutil.Process().children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            kind = "exporter" if "export" in cmd else "coordinator" if "coordinator" in cmd else "worker"
            out[p.pid] = (kind, _threads(p.pid))
            os.kill(p.pid, signal.SIGUSR2)
        return out

    class Clock:  # throughput.py's window: its two process_time() calls
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        def process_time(self) -> float:
            marks.append((time.perf_counter(), list(gc_ns), list(gc_n), _threads(), fleet()))
            return time.process_time()

    setattr(throughput, "time", Clock())  # noqa: B010 (throughput.py reads its module attribute `time`)
    result = h.run_loop(throughput.measure(plans, 2, 1000, "memory", 5000, None))
    (w0, ns0, n0, t0, f0), (w1, ns1, n1, t1, f1) = marks[0], marks[1]
    me = os.getpid()
    dir_ = os.environ["TRACING_GC_WINDOW_DIR"]
    procs: dict[str, Any] = {}
    for pid, (kind, after) in f1.items():
        before = f0.get(pid, (kind, {}))[1]
        entry: dict[str, Any] = {
            "main_us": round((after.get(pid, 0) - before.get(pid, 0)) / 1e3 / plans, 3),
            "threads_us": round(sum(v - before.get(t, 0) for t, v in after.items() if t != pid) / 1e3 / plans, 4),
        }
        try:
            rows = [list(map(int, line.split())) for line in Path(dir_, str(pid)).read_text().splitlines()]
            entry["gc_us"] = [round((rows[-1][g] - rows[-2][g]) / 1e3 / plans, 3) for g in range(3)]
            entry["gc_n"] = [rows[-1][g] - rows[-2][g] for g in range(3, 6)]
        except (OSError, IndexError, ValueError):
            pass
        name, i = kind, 2
        while name in procs:
            name, i = f"{kind} {i}", i + 1
        procs[name] = entry
    print(
        json.dumps(
            {
                "plans_per_s": result.get("plans_per_s"),
                "client": {
                    "main_us": round((t1[me] - t0[me]) / 1e3 / plans, 3),
                    "threads_us": round(sum(v - t0.get(t, 0) for t, v in t1.items() if t != me) / 1e3 / plans, 4),
                    "gc_us": [round((ns1[g] - ns0[g]) / 1e3 / plans, 3) for g in range(3)],
                    "gc_n": [n1[g] - n0[g] for g in range(3)],
                    "full_at": [round((x - w0) / (w1 - w0), 2) for x in full_at if w0 < x < w1],
                    "tracked": len(gc.get_objects()),
                },
                **procs,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three levels, order rotated (default 3)")
    parser.add_argument("--plans", type=int, default=10_000, help="plans a run (default 10000)")
    parser.add_argument("--one", type=int, metavar="PLANS", help=argparse.SUPPRESS)  # a run, in its own process
    ns = parser.parse_args()
    if ns.one:
        _one(ns.one)
        return
    sys.path.insert(0, str(BENCH))
    import _tracing_cost as tc

    sink = tc.Sink()
    levels = [tc.Level(label, ratio, label) for label, ratio in LEVELS]
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in LEVELS}
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "sitecustomize.py").write_text(_SITE)
        for r in range(ns.rounds):
            for level in levels[r % 3 :] + levels[: r % 3]:
                tc._configure(level, sink.endpoint)
                env = dict(
                    os.environ,
                    TRACING_GC_WINDOW_DIR=tmp,
                    PYTHONPATH=os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH", "")) if p),
                )
                out = subprocess.run([sys.executable, __file__, "--one", str(ns.plans)], env=env, capture_output=True,
                                     text=True, cwd=BENCH.parent, timeout=600)  # fmt: skip
                lines = out.stdout.strip().splitlines()
                if out.returncode or not lines:
                    print(f"{level.label}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                runs[level.label].append(json.loads(lines[-1]))
                print(r, level.label, lines[-1], flush=True)

    def med(label: str, *path: str | int) -> float:
        values = []
        for run in runs[label]:
            v: Any = run
            for key in path:
                v = v[key] if isinstance(key, int) or key in v else None
                if v is None:
                    break
            if isinstance(v, (int, float)):
                values.append(v)
        return statistics.median(values) if values else float("nan")

    print("\nmedians, µs a plan | " + " | ".join(runs))
    rows = [("client main thread", ("client", "main_us")), ("client other threads", ("client", "threads_us")),
            ("client full collections", ("client", "gc_us", 2)), ("client young collections", ("client", "gc_us", 1)),
            ("coordinator main thread", ("coordinator", "main_us")), ("coordinator collections",
             ("coordinator", "gc_us", 0)), ("worker main thread", ("worker", "main_us")),
            ("worker 2 main thread", ("worker 2", "main_us"))]  # fmt: skip
    for name, path in rows:
        print(f"{name} | " + " | ".join(f"{med(label, *path):.3f}" for label in runs))
    for label in runs:
        fulls = [run["client"]["gc_n"][2] for run in runs[label]]
        print(
            f"{label}: client full collections in the window {fulls}, at "
            f"{[run['client']['full_at'] for run in runs[label]]}"
        )


if __name__ == "__main__":
    main()
