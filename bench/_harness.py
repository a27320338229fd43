"""What every benchmark shares: real fleetwire processes on 127.0.0.1, and how to report.

The benchmarks start the coordinator and the workers as separate processes through the
CLI (``python -m fleetwire coordinator|worker``), exactly as a user runs them, and measure
from the benchmark's own process, which plays the client. Everything listens on and dials
127.0.0.1 only. Every wait has a deadline and every process started here is stopped here
(SIGTERM, then SIGKILL), so a benchmark always ends by itself.

``--store memory|sqlite`` is passed to the coordinator when its CLI has ``--store`` (the
SQLite file goes in a temporary ``--data-dir``); a coordinator without it keeps plans in
memory, and the report says so (``store_used``). Per-client limits that a benchmark exceeds
by design (message rate, unfinished plans, connections) are lifted the same way, flag by
flag, and listed in the report (``limits_lifted``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
HOST = "127.0.0.1"

# The client is this tree's SDK, as the processes it starts are (bench_env): a script's path starts with bench/, and
# without this ``fleetwire`` came from the venv's editable install, the checkout, so a worktree's or a compiled copy's
# latency.py timed the checkout's pure client against its own fleet (docs/PERFORMANCE.md §C29i).
if str(ROOT) not in sys.path:
    sys.path.insert(1 if sys.path and sys.path[0] == str(BENCH) else 0, str(ROOT))


def run_loop(main: Any) -> Any:
    """Run ``main`` (a coroutine) on uvloop, the loop fleetwire's CLI uses."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a fleetwire dependency
        return asyncio.run(main)
    return uvloop.run(main)


def common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every fleetwire benchmark takes."""
    parser.add_argument("--store", choices=("memory", "sqlite"), default="sqlite",
                        help="coordinator store, when the coordinator supports --store (default sqlite)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--profile", metavar="DIR",
                        help="record py-spy profiles of the coordinator and workers into DIR")
    parser.add_argument("--coordinator-args", default="", metavar="ARGS",
                        help="more flags for the coordinator, e.g. '--ping-interval 0' (one string)")


EXTRA_COORDINATOR_ARGS: list[str] = []


def configure(ns: argparse.Namespace) -> None:
    """Apply the common flags that are not per benchmark (``--coordinator-args``)."""
    EXTRA_COORDINATOR_ARGS[:] = shlex.split(getattr(ns, "coordinator_args", "") or "")


# ---------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """A child process; its stdout lines are kept (the last few hundred) as they arrive."""

    name: str
    proc: asyncio.subprocess.Process
    lines: list[str] = field(default_factory=list)
    _new: asyncio.Event = field(default_factory=asyncio.Event)
    _reader: asyncio.Task[None] | None = None

    def start_reading(self) -> None:
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            self.lines.append(line.decode(errors="replace").rstrip("\n"))
            if len(self.lines) > 500:
                del self.lines[:250]
            self._new.set()
        self._new.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait_for_line(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        """The first stdout line (from now on or already read) matching ``pattern``."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            for line in self.lines[seen:]:
                if m := regex.search(line):
                    return m
            seen = len(self.lines)
            if self._reader is not None and self._reader.done():
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before printing {pattern!r}: "
                                   f"{self.lines[-10:]}")
            self._new.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name} did not print {pattern!r} within {timeout_s} s")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._new.wait(), left)

    async def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 5)

    def kill(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()


def callgrind_total(tree: str, argv: Sequence[str], out_file: str) -> int:
    """The instructions callgrind counts for ``python ARGV`` run in ``tree`` (its ``PYTHONPATH``, hash seed 0): the
    per-plan benches take the difference of two such runs. ``out_file``: callgrind's output (a temp dir's)."""
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONHASHSEED": "0"}
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", sys.executable, *argv]
    subprocess.run(cmd, env=env, cwd=tree, capture_output=True, check=True)
    with open(out_file) as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("summary:"))


# The tracing bench's; the PostgreSQL writer process; the PostgreSQL store's lone-commit spin (LONE_SPIN_ENV) and its
# split threshold (SPLIT_MIN_PLANS_ENV: a run with and without the split, docs/PERFORMANCE.md §C29r, §C29t)
_ENV_PASSED = ("FLEETWIRE_TRACE_EXPORT", "FLEETWIRE_PG_WRITER", "FLEETWIRE_PG_SPIN_US", "FLEETWIRE_PG_SPLIT_MIN_PLANS")


def bench_env(**extra: str) -> dict[str, str]:
    """The environment of child processes: no inherited FLEETWIRE_* (but :data:`_ENV_PASSED`) and bench/ importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_") or k in _ENV_PASSED}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH), str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


async def spawn(name: str, *argv: str, env: dict[str, str] | None = None) -> Proc:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env or bench_env(), cwd=ROOT
    )
    p = Proc(name, proc)
    p.start_reading()
    return p


_HELP: str | None = None

# Limits a production coordinator keeps and a benchmark must lift: one client submitting
# 20,000 plans a second is, by design, over the default per-client rate and plan quota.
# Each is passed only when this coordinator's CLI has the flag; the report lists them.
BENCH_LIMITS: dict[str, str] = {
    "--client-rate": "0",
    "--worker-rate": "0",
    "--max-plans-per-client": "0",
    "--max-connections": "0",
    "--max-pending-messages": "10000000",
}


def coordinator_help() -> str:
    """``fleetwire coordinator --help``, read once: which flags this coordinator has."""
    global _HELP
    if _HELP is None:
        _HELP = subprocess.run(
            [sys.executable, "-m", "fleetwire", "coordinator", "--help"],
            capture_output=True, text=True, cwd=ROOT, env=bench_env(), check=False, timeout=60,
        ).stdout
    return _HELP


def coordinator_has_flag(flag: str) -> bool:
    return re.search(rf"{re.escape(flag)}\b", coordinator_help()) is not None


@dataclass
class Fleet:
    """A coordinator and its workers, started for one benchmark."""

    store_asked: str
    store_used: str = "memory"
    url: str = ""
    coordinator: Proc | None = None
    workers: list[Proc] = field(default_factory=list)
    others: list[Proc] = field(default_factory=list)
    tmp: tempfile.TemporaryDirectory[str] = field(default_factory=tempfile.TemporaryDirectory)
    port: int = 0
    limits_lifted: dict[str, str] = field(default_factory=dict)

    async def start_coordinator(self, *extra: str, port: int = 0) -> Proc:
        args = ["coordinator", "--host", HOST, "--port", str(port), "--insecure", "--log-level", "warning"]
        if coordinator_has_flag("--store"):
            args += ["--store", self.store_asked]
            if self.store_asked == "sqlite" and coordinator_has_flag("--data-dir"):
                args += ["--data-dir", self.tmp.name]
            self.store_used = self.store_asked
        else:
            self.store_used = "memory (this coordinator has no --store flag yet)"
        for flag, value in BENCH_LIMITS.items():
            if coordinator_has_flag(flag) and flag not in extra and flag not in EXTRA_COORDINATOR_ARGS:
                args += [flag, value]
                self.limits_lifted[flag] = value
        args += [*extra, *EXTRA_COORDINATOR_ARGS]
        self.coordinator = await spawn("coordinator", sys.executable, "-m", "fleetwire", *args)
        self.url = (await self.coordinator.wait_for_line(r"listening on (ws://\S+)")).group(1)
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.coordinator

    async def start_worker(self, worker_id: str, *extra: str, max_concurrency: int = 64) -> Proc:
        proc = await spawn(
            worker_id, sys.executable, "-m", "fleetwire", "worker", "--url", self.url, "--id", worker_id,
            "--max-concurrency", str(max_concurrency), "--log-level", "warning", *extra,
        )
        self.workers.append(proc)
        return proc

    async def wait_workers(self, timeout_s: float = 60.0) -> None:
        await asyncio.gather(*(w.wait_for_line(r"registered", timeout_s) for w in self.workers))

    async def stop(self) -> None:
        procs = [*self.others, *self.workers]
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        if self.coordinator is not None:
            await self.coordinator.stop()
        self.tmp.cleanup()


@contextlib.asynccontextmanager
async def fleet(store: str) -> AsyncIterator[Fleet]:
    f = Fleet(store)
    try:
        yield f
    finally:
        await f.stop()


# ---------------------------------------------------------------------------- measuring


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds a process (or its thread ``tid``) has used so far (0.0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def percentile(samples: Sequence[float], pct: float) -> float:
    """The ``pct`` percentile (nearest rank) of ``samples``; NaN when empty."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean/max of samples given in seconds, reported in milliseconds."""
    return {
        "p50_ms": round(percentile(samples_s, 50) * 1e3, 3),
        "p90_ms": round(percentile(samples_s, 90) * 1e3, 3),
        "p99_ms": round(percentile(samples_s, 99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(samples_s) * 1e3, 3) if samples_s else float("nan"),
        "max_ms": round(max(samples_s) * 1e3, 3) if samples_s else float("nan"),
    }


class Profiler:
    """py-spy profiles of running processes (``--profile DIR``); a no-op without DIR.

    Each process gets ``DIR/<name>.txt`` in py-spy's collapsed-stack format (one line per
    stack with its sample count): ``python bench/profile_top.py DIR/<name>.txt`` lists the
    functions with the most samples, and any flame-graph tool reads the file as is.
    """

    def __init__(self, directory: str | None) -> None:
        self.directory = Path(directory) if directory else None
        self._procs: list[subprocess.Popen[bytes]] = []

    def attach(self, name: str, pid: int, duration_s: int = 60) -> None:
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        out = self.directory / f"{name}.txt"
        self._procs.append(subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "--output", str(out), "--duration", str(duration_s),
             "--rate", "1000", "--format", "raw", "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))

    def finish(self) -> None:
        """Stop every profiler attached so far; each writes its file (py-spy does on SIGINT)."""
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in self._procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs = []


def emit(result: dict[str, Any], as_json: bool, lines: Sequence[str]) -> None:
    """Print the result: one JSON object, or the human lines."""
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        print("\n".join(lines))


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["mem_gib"] = round(int(line.split()[1]) / 2**20, 1)
                break
    return info
