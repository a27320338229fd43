"""A sequential round trip's timeline, hop by hop in every process (docs/PERFORMANCE.md §D29c).

Runs bench/latency.py under ``strace -f -ff -ttt -T --seccomp-bpf -e trace=write,read,fdatasync`` (only
those calls stop a process: with ``fcntl`` and ``pwrite64`` traced too, the inline commits grew past
``INLINE_SLOW_S`` and the cool-down sent a third of them to the writer process), then matches each plan's
calls across the processes: the client's submit written, the coordinator's read of it, its ``fdatasync``,
the ``assign`` written, the worker's read and its frame written, the coordinator's read, ``fdatasync``, the
event written, the client's read and its next submit. Prints the p50 of each gap in µs, per mode:

* ``memory``: the memory store;
* ``sqlite-nosync``: SQLite with ``synchronous=OFF`` (bench/store_split_site: a measurement, never a mode);
* ``sqlite``: SQLite, every lone commit on the event loop (no slow-disk cool-down: as on a quiet disk).

    python bench/durable_timeline.py                      # 400 round trips a mode, after 100
    python bench/durable_timeline.py --modes memory,sqlite --samples 300

The traced processes run slower than untraced ones (each traced call stops them twice): read the gaps
side by side, not as a round trip's p50. Needs ``strace``.
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import _harness as h

MODES: dict[str, tuple[str, dict[str, str]]] = {
    "memory": ("memory", {}),
    "sqlite-nosync": ("sqlite", {"FW_STORE_SPLIT_SYNC": "OFF", "FW_STORE_SPLIT_COMMIT": "inline"}),
    "sqlite": ("sqlite", {"FW_STORE_SPLIT_COMMIT": "inline"}),
}
_CALL = re.compile(r"^(\d+\.\d+) (\w+)\((\d+)(?:, (.*?))?\)\s+= (-?\d+)(?:.*<(\d+\.\d+)>)?")
Call = tuple[float, str, int, float, str]  # start (s), name, fd, duration (s), its arguments' text


def _calls(path: Path) -> list[Call]:
    calls: list[Call] = []
    with open(path, errors="replace") as fh:
        for line in fh:
            m = _CALL.match(line)
            if m is not None and (int(m.group(5)) > 0 or m.group(2) == "fdatasync"):  # reads of 0 bytes left out
                calls.append((float(m.group(1)), m.group(2), int(m.group(3)), float(m.group(6) or 0), m.group(4) or ""))
    return calls


def _finder(calls: list[Call]) -> Callable[..., Call | None]:
    """The first of ``calls`` at or after a time that ``pred`` accepts."""
    starts = [c[0] for c in calls]

    def first(t: float, pred: Callable[[Call], bool] = lambda c: True) -> Call | None:
        for call in calls[bisect.bisect_left(starts, t) :]:
            if pred(call):
                return call
        return None

    return first


def gaps(trace_dir: Path, skip: int) -> dict[str, list[float]]:
    """Each hop's gaps (µs) over the plans of one traced run (the first ``skip`` submits left out)."""
    procs = {int(p.name.rsplit(".", 1)[1]): _calls(p) for p in trace_dir.glob("t.*")}

    def frames(pid: int, name: str) -> list[Call]:  # websocket binary frames (first byte 0x82)
        return [c for c in procs[pid] if c[1] == name and c[4].startswith('"\\202')]

    coord = max(procs, key=lambda p: sum("assign" in c[4] for c in frames(p, "write")))
    writes = frames(coord, "write")
    client_fd = next(c[2] for c in writes if "accepted" in c[4])
    worker_fds = {c[2] for c in writes if "assign" in c[4]}
    peers = [p for p in procs if p != coord and len(frames(p, "write")) > 100]
    client = max(peers, key=lambda p: len(procs[p]))  # the bench process: it imports the most
    workers = [p for p in peers if p != client]
    k_read, k_write = _finder(frames(coord, "read")), _finder(writes)
    k_sync = _finder([c for c in procs[coord] if c[1] == "fdatasync"])
    c_read = _finder(frames(client, "read"))
    c_write = _finder(frames(client, "write"))
    w_read = {w: _finder(frames(w, "read")) for w in workers}
    w_write = {w: _finder(frames(w, "write")) for w in workers}
    out: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        out.setdefault(name, []).append(seconds * 1e6)

    for submit in frames(client, "write")[skip:]:
        t0 = submit[0] + submit[3]
        read1 = k_read(t0, lambda c: c[2] == client_fd)
        assign = read1 and k_write(read1[0], lambda c: c[2] in worker_fds)
        if not read1 or not assign:
            break
        reads = [(r, w) for w in workers if (r := w_read[w](assign[0])) is not None]  # the worker that got it
        w_in, worker = min(reads, key=lambda rw: rw[0][0]) if reads else (None, 0)
        w_out = w_write[worker](w_in[0]) if w_in is not None else None
        read2 = w_out and k_read(w_out[0], lambda c: c[2] in worker_fds)
        event = read2 and k_write(read2[0], lambda c: c[2] == client_fd and "accepted" not in c[4])
        c_in = event and c_read(event[0])
        after = c_in and c_write(c_in[0])
        if not (w_in and w_out and read2 and event and c_in and after):
            break
        add("client's submit written -> coordinator reads it", read1[0] - t0)
        add("coordinator: read -> assign written", assign[0] - read1[0])
        sync1 = k_sync(read1[0])
        if sync1 is not None and sync1[0] < assign[0]:
            add("  of which: read -> fdatasync begins", sync1[0] - read1[0])
            add("  of which: fdatasync (first commit)", sync1[3])
            add("  of which: fdatasync ends -> assign written", assign[0] - sync1[0] - sync1[3])
        add("assign written -> worker reads it", w_in[0] - assign[0] - assign[3])
        add("worker: read -> its frame written", w_out[0] - w_in[0])
        add("worker's frame written -> coordinator reads it", read2[0] - w_out[0] - w_out[3])
        add("coordinator: read -> event written", event[0] - read2[0])
        sync2 = k_sync(read2[0])
        if sync2 is not None and sync2[0] < event[0]:
            add("  of which: fdatasync (second commit)", sync2[3])
        add("event written -> client reads it", c_in[0] - event[0] - event[3])
        add("client: read -> next submit written", after[0] + after[3] - c_in[0])
        add("submit -> next submit", after[0] + after[3] - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=400, help="timed round trips a mode (default 400)")
    parser.add_argument("--warmup", type=int, default=100, help="round trips first, left out (default 100)")
    parser.add_argument("--modes", default="memory,sqlite-nosync,sqlite", help=f"of {', '.join(MODES)}")
    ns = parser.parse_args(argv)
    table: dict[str, dict[str, float]] = {}
    for mode in ns.modes.split(","):
        store, extra = MODES[mode]
        with tempfile.TemporaryDirectory(prefix="fw-timeline-") as tmp:
            env = {**os.environ, **extra, "FW_STORE_SPLIT_OUT": str(Path(tmp) / "probe.json"),
                   "PYTHONPATH": os.pathsep.join(p for p in (str(h.BENCH / "store_split_site"),
                                                             os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
            cmd = ["strace", "-f", "-ff", "-ttt", "-T", "--seccomp-bpf", "-e", "trace=write,read,fdatasync",
                   "-o", f"{tmp}/t", sys.executable, str(h.BENCH / "latency.py"), "--samples", str(ns.samples),
                   "--warmup", str(ns.warmup), "--store", store, "--json"]  # fmt: skip
            subprocess.run(cmd, env=env, cwd=h.ROOT, check=True, capture_output=True)
            found = gaps(Path(tmp), ns.warmup)
        table[mode] = {hop: statistics.median(values) for hop, values in found.items()}
    hops = list(max(table.values(), key=len))  # in the order of the round trip: a synced mode's has every hop
    print(
        f"a sequential round trip's hops under strace, p50 µs ({ns.samples} plans a mode, "
        f"{h.machine().get('cpus')} CPUs)"
    )
    print("| hop | " + " | ".join(table) + " |")
    print("|---|" + "---|" * len(table))
    for hop in hops:
        cells = " | ".join(f"{table[m][hop]:.0f}" if hop in table[m] else "" for m in table)
        print(f"| {hop} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
