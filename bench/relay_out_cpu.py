"""The relayed output's CPU a MiB in each process: client, coordinator and worker (issue #29, DP29).

    python bench/relay_out_cpu.py --size 64M --fetches 6 --dir /dev/shm
    python bench/relay_out_cpu.py --direct            # the same for the worker's data endpoint (no relay)
    python bench/relay_out_cpu.py --input             # a relayed input: a plan a fetch, its file uploaded

data_plane.py's ``relay`` column times one ``output_to`` a run in MB/s, which two cores shared with other work move
by ±30 %. This runs the same fleet (a coordinator, a worker with ``--data-listen``, this process the client, the
memory store), makes one output of ``--size`` random bytes, then fetches it ``--fetches`` times through the
coordinator (``plan.relay = True``), and reads for each fetch every process's nanoseconds on a CPU and runnable
waiting for one: the sum of ``/proc/PID/task/*/schedstat`` over its threads (a thread that ends during a fetch
loses its share: the coordinator's and the worker's relay path start none), the client's CPU from ``getrusage``
(its download's writer and hasher threads end with each fetch). The first fetch warms the path and is left out
of the medians.

Figures: each process's CPU ms a MiB (median over the fetches, with the range), the sum of the three, the
wall MB/s, and the wait ms a MiB (load: a process runnable with no CPU). CPU a MiB moves much less with load
than MB/s does; compare two trees with old and new runs interleaved (each tree's copy of this script: the
harness runs every process from the script's own tree).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h

MIB = 2**20


def schedstat_ns(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable waiting for one) of every live thread of ``pid``. This process's CPU comes from
    ``getrusage`` instead, which keeps the threads that ended (the SDK's download writes and hashes in threads of
    its own, started for each transfer)."""
    run = wait = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as fh:
                fields = fh.read().split()
        except OSError:  # the thread ended
            continue
        run += int(fields[0])
        wait += int(fields[1])
    if pid == os.getpid():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        run = round((usage.ru_utime + usage.ru_stime) * 1e9)
    return run, wait


def make_file(path: Path, size: int) -> None:
    with open(path, "wb") as out:
        left = size
        while left:
            part = os.urandom(min(left, 4 * MIB))
            out.write(part)
            left -= len(part)


def callgrind_under(directory: str, names: set[str]) -> None:
    """The processes named (``coordinator``, ``bench-data``: the worker) start under callgrind with its
    instrumentation off (``DIR/<name>-<pid>.out``); :func:`callgrind_toggle` turns it on over the measured fetches."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    spawn = h.spawn
    where = Path(directory).resolve()

    async def wrapped(name: str, *argv: str, env: dict[str, str] | None = None) -> h.Proc:
        if name in names:
            out = str(where / f"{name}-%p.out")
            argv = ("valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *argv)
        return await spawn(name, *argv, env=env)

    h.spawn = wrapped  # type: ignore[assignment]  # Fleet.start_* read the module's spawn


def callgrind_toggle(pids: list[int], on: bool) -> None:
    """Callgrind's instrumentation on (before the measured fetches) or off and dumped (after them). This process's own
    (``--callgrind-of client``) too: vgdb reaches it while it waits here."""
    for pid in pids:
        subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(pid)], capture_output=True, check=True)
        if not on:
            subprocess.run(["callgrind_control", "-d", str(pid)], capture_output=True, check=True)


def callgrind_totals(directory: str) -> dict[str, int]:
    """Each dump's total instructions (``DIR/<name>-<pid>.out.1``: the measured fetches')."""
    totals = {}
    for dump in sorted(Path(directory).glob("*.out.1")):
        found = re.findall(r"^totals: (\d+)", dump.read_text(errors="replace"), re.M)
        if found:
            totals[dump.name] = int(found[-1])
    return totals


async def measure(
    path: Path, size: int, fetches: int, relay: bool, callgrind: tuple[str, ...] = (), upload: bool = False
) -> dict[str, Any]:
    from fleetwire import Client

    work = Path(tempfile.mkdtemp(prefix="fw-relay-cpu-", dir=path.parent))
    async with h.fleet("memory") as f:
        await f.start_coordinator()
        worker = await f.start_worker(
            "bench-data",
            "--data-listen",
            "127.0.0.1:0",
            "--spool-dir",
            str(work / "spool"),
            "--handler",
            "data_source=_bench_handlers:data_source",
            "--handler",
            "data_sink=_bench_handlers:data_sink",
            max_concurrency=2,
        )
        await f.wait_workers()
        assert f.coordinator is not None
        pids = {"client": os.getpid(), "coordinator": f.coordinator.pid, "worker": worker.pid}
        extra: dict[str, Any] = {"relay": True} if relay else {}
        runs: list[dict[str, float]] = []
        async with Client(f.url) as client:
            plan = await client.submit("data_source", {"path": str(path)}, outputs=["out"], **extra)
            await plan.result()
            if relay:
                plan.relay = True
            target = work / "out.bin"
            for fetch in range(fetches + 1):
                if callgrind and fetch == 1:  # after the warm fetch
                    callgrind_toggle([pids[name] for name in callgrind], True)
                before = {name: schedstat_ns(pid) for name, pid in pids.items()}
                t0 = time.perf_counter()
                if upload:  # the client's digest pass, the upload, the worker's check, a handler that reads .size
                    sink = await client.submit("data_sink", inputs={"data": path}, **extra)
                    assert (await sink.result())["size"] == size
                else:
                    await plan.output_to("out", target)
                wall = time.perf_counter() - t0
                after = {name: schedstat_ns(pid) for name, pid in pids.items()}
                if not upload:
                    assert target.stat().st_size == size
                    target.unlink()
                run = {"mb_s": size / wall / 1e6}
                for name in pids:
                    run[f"{name}_cpu"] = (after[name][0] - before[name][0]) / 1e6 / (size / MIB)
                    run[f"{name}_wait"] = (after[name][1] - before[name][1]) / 1e6 / (size / MIB)
                run["sum_cpu"] = sum(run[f"{name}_cpu"] for name in pids)
                runs.append(run)
            if callgrind:
                callgrind_toggle([pids[name] for name in callgrind], False)
    runs = runs[1:]  # the first fetch warms the path
    result: dict[str, Any] = {
        "fetches": len(runs),
        "size": size,
        "relay": relay,
        "input": upload,
        "load": os.getloadavg()[0],
    }
    for key in runs[0]:
        values = [r[key] for r in runs]
        result[key] = {
            "median": round(statistics.median(values), 4),
            "min": round(min(values), 4),
            "max": round(max(values), 4),
        }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64M", help="the output's size (K, M, G: binary; default 64M)")
    parser.add_argument("--fetches", type=int, default=6, help="fetches measured, after one that warms (default 6)")
    parser.add_argument("--dir", default=None, help="where the file, the spool and the fetched copy go")
    parser.add_argument("--direct", action="store_true", help="from the worker's data endpoint, not the relay")
    parser.add_argument(
        "--input",
        action="store_true",
        help="an input instead: each fetch a plan whose input is "
        "the file (the client's digest pass included), as data_plane.py's 'in'",
    )
    parser.add_argument(
        "--callgrind",
        metavar="DIR",
        help="the coordinator and the worker under callgrind, counting "
        "over the measured fetches only (DIR/<name>-<pid>.out.1): instructions a MiB; slow (~50x)",
    )
    parser.add_argument(
        "--callgrind-of",
        default="coordinator,worker",
        help="which of coordinator,worker,client run under callgrind (default coordinator,worker); client: this "
        "process, which you start under callgrind yourself: valgrind --tool=callgrind --instr-atstart=no "
        "--callgrind-out-file=DIR/client-%%p.out python bench/relay_out_cpu.py --callgrind DIR --callgrind-of client",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    ns = parser.parse_args(argv)
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    size = int(ns.size[:-1]) * units[ns.size[-1].upper()] if ns.size[-1].upper() in units else int(ns.size)
    with tempfile.TemporaryDirectory(prefix="fw-relay-cpu-", dir=ns.dir) as tmp:
        path = Path(tmp) / "input.bin"
        make_file(path, size)
        under = tuple(ns.callgrind_of.split(",")) if ns.callgrind else ()
        if under:
            callgrind_under(ns.callgrind, {"bench-data" if name == "worker" else name for name in under})
        result = h.run_loop(measure(path, size, ns.fetches, relay=not ns.direct, callgrind=under, upload=ns.input))
    lines = [
        f"{'relay' if result['relay'] else 'direct'} {'in' if ns.input else 'out'}, {size // MIB} MiB x "
        f"{result['fetches']} "
        f"(load {result['load']:.2f}): median [min-max]"
    ]
    for key in (
        "mb_s",
        "client_cpu",
        "coordinator_cpu",
        "worker_cpu",
        "sum_cpu",
        "client_wait",
        "coordinator_wait",
        "worker_wait",
    ):
        f = result[key]
        unit = "MB/s" if key == "mb_s" else "ms/MiB"
        lines.append(f"  {key:18s} {f['median']:9.3f} [{f['min']:.3f}-{f['max']:.3f}] {unit}")
    if ns.callgrind:
        mib = size / MIB * result["fetches"]
        result["callgrind_per_mib"] = {
            name: round(total / mib) for name, total in callgrind_totals(ns.callgrind).items()
        }
        lines += [
            f"  callgrind {name}: {per:,} instructions a MiB" for name, per in result["callgrind_per_mib"].items()
        ]
    h.emit(result, ns.json, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
