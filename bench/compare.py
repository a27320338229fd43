"""fleetwire, Dask distributed, Ray and the raw relay on the same work, in one run, in one table.

    pip install -r bench/requirements.txt      # Dask, Ray (and the profilers)
    python bench/compare.py                    # 20,000 no-op plans/tasks; sequential round trips
    python bench/compare.py --peers none --plans 300 --samples 100   # fleetwire and raw relay only

Every figure comes from this invocation: each system runs in its own processes, one after
the other, on 127.0.0.1 (bench/throughput.py, bench/latency.py, bench/raw_relay.py,
bench/peers.py). A peer that is not installed, that fails, or that would leave loopback
keeps its column, which says why. The ratio rows say how many times faster (or slower)
fleetwire is than that column, for throughput and for the p50 latency.

The durable store's floor is measured in the same run (``--store sqlite``): the p50 of one
commit's disk work on the store's own file system (``--fsync-dir``, default the temporary
directory the benchmarks put their store in), done as SQLite does it in WAL mode with
``synchronous=FULL`` — the commit's WAL frame (24-byte header + 4 KiB page: a lone plan's commit
changes its ``plans`` row's page alone since schema 6) written in place into a WAL file that was
filled once already (SQLite restarts its WAL from the start after each checkpoint), then one
``fdatasync`` of that file. A first pass that grows the file (an append: the size changes, so
``fdatasync`` writes the inode too) is reported as well.
A sequential durable round trip waits for two commits (the submit with its lease, then the
result), so

    limit = raw relay p50 + 2 x fsync p50

and the targets are durable p50 <= 1.5 x limit, p99 <= 3 x limit, and (with ``--also-memory``)
durable throughput >= 0.85 x the memory store's in the same run (the durability tax).
The fsync is sampled before and after the fleetwire runs (the median of both), so a
neighbour's disk traffic during the run shows up in the figure it is compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import _harness as h

TARGETS = {
    "plans_per_s": 20_000,
    "x_dask": 40,
    "x_ray": 20,
    "p50_ms": 1.0,
    "p50_x_relay": 1.5,
    "p99_ms": 3.0,
    "p50_x_limit": 1.5,
    "p99_x_limit": 3.0,
    "durable_x_memory": 0.85,
}

WAL_FRAME = 24 + 4096  # SQLite's WAL frame: header + one page (the default page size)
# The pages a lone plan's commit changes: its plans row's. store_meta's page was a second until schema 6
# stamped the generation on the row (6e2a2eb); bench/store_writer.py --lone measures 1.18 frames a commit
# (2.18 before), the rest a b-tree page now and then. Not the 2 of the limit (two commits a round trip).
WAL_FRAMES_PER_COMMIT = 1
WAL_BYTES = 1000 * WAL_FRAME  # the WAL's size at SQLite's default autocheckpoint (1,000 pages)


def fsync_samples(directory: str, samples: int) -> dict[str, list[float]]:
    """Seconds per commit-sized write + ``fdatasync`` in ``directory``: in place (as SQLite's WAL) and appended."""
    fdatasync = getattr(os, "fdatasync", os.fsync)
    frame = os.urandom(WAL_FRAME * WAL_FRAMES_PER_COMMIT)
    out: dict[str, list[float]] = {"in_place": [], "append": []}
    with tempfile.TemporaryDirectory(dir=directory, prefix="fw-fsync-") as tmp:
        path = os.path.join(tmp, "wal")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            clock = time.perf_counter
            for i in range(samples):  # append: the file grows with every commit (a fresh WAL)
                t0 = clock()
                os.pwrite(fd, frame, i * len(frame))
                fdatasync(fd)
                out["append"].append(clock() - t0)
            os.ftruncate(fd, WAL_BYTES)
            fdatasync(fd)
            offset = 0
            for _ in range(samples):  # in place: a WAL restarted after a checkpoint, as a running store's is
                t0 = clock()
                os.pwrite(fd, frame, offset)
                fdatasync(fd)
                out["in_place"].append(clock() - t0)
                offset = (offset + len(frame)) % (WAL_BYTES - len(frame))
        finally:
            os.close(fd)
    return out


def fsync_summary(batches: list[dict[str, list[float]]], directory: str) -> dict[str, Any]:
    """The fsync figures of every batch sampled in this run."""
    in_place = [t for b in batches for t in b["in_place"]]
    append = [t for b in batches for t in b["append"]]
    return {
        "dir": directory,
        "samples": len(in_place),
        "bytes_per_commit": WAL_FRAME * WAL_FRAMES_PER_COMMIT,
        "call": "fdatasync" if hasattr(os, "fdatasync") else "fsync",
        "p50_ms": round(h.percentile(in_place, 50) * 1e3, 4),
        "p99_ms": round(h.percentile(in_place, 99) * 1e3, 4),
        "append_p50_ms": round(h.percentile(append, 50) * 1e3, 4),
        "batch_p50_ms": [round(h.percentile(b["in_place"], 50) * 1e3, 4) for b in batches],
    }


def run(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run a bench script with ``--json``; its result, or ``{"error": why}``."""
    cmd = [sys.executable, str(h.BENCH / script), *args, "--json"]
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=h.ROOT, env=h.bench_env(),
                             check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {out.returncode}: {' | '.join(tail)}"}
    result: dict[str, Any] = json.loads(lines[-1])
    result["wall_s"] = round(time.monotonic() - t0, 1)
    return result


def _fmt_rate(value: float | None, unit: str) -> str:
    return "-" if value is None else f"{value:,.0f} {unit}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def collect(ns: argparse.Namespace) -> dict[str, Any]:
    peers = [] if ns.peers == "none" else ns.peers.split(",")
    results: dict[str, Any] = {"machine": h.machine(), "store": ns.store}
    t = ns.timeout
    fsync_dir = ns.fsync_dir or tempfile.gettempdir()
    batches = [fsync_samples(fsync_dir, ns.fsync_samples)] if ns.store != "memory" else []
    writer = ["--coordinator-args", f"--store-writer {ns.store_writer}"] if ns.store_writer else []
    results["store_writer"] = ns.store_writer or "the coordinator's default"
    results["fleetwire_throughput"] = run("throughput.py", "--plans", str(ns.plans), "--store", ns.store, *writer,
                                          timeout_s=t)
    results["fleetwire_latency"] = run("latency.py", "--samples", str(ns.samples), "--store", ns.store, *writer,
                                       timeout_s=t)
    if ns.also_memory and ns.store != "memory":
        results["fleetwire_memory_throughput"] = run("throughput.py", "--plans", str(ns.plans), "--store", "memory",
                                                     timeout_s=t)
        results["fleetwire_memory_latency"] = run("latency.py", "--samples", str(ns.samples), "--store", "memory",
                                                  timeout_s=t)
    if batches:
        batches.append(fsync_samples(fsync_dir, ns.fsync_samples))
        results["fsync"] = fsync_summary(batches, fsync_dir)
    results["relay_1"] = run("raw_relay.py", "throughput", "--items", str(ns.plans), "--per-frame", "1", timeout_s=t)
    results["relay_64"] = run("raw_relay.py", "throughput", "--items", str(ns.plans), "--per-frame", "64",
                              timeout_s=t)
    results["relay_latency"] = run("raw_relay.py", "latency", "--samples", str(ns.samples), timeout_s=t)
    results["pingpong"] = run("raw_relay.py", "pingpong", "--samples", str(ns.samples), timeout_s=t)
    for peer in ("dask", "ray"):
        if peer in peers:
            results[peer] = run("peers.py", peer, "--tasks", str(ns.plans), "--samples", str(ns.peer_samples),
                                timeout_s=max(t, 600))
        else:
            results[peer] = {"skipped": True, "why": "not asked for (--peers)"}
    return results


def _peer_cell(r: dict[str, Any], key: str) -> tuple[str, float | None]:
    """The text of a peer's cell and its number (None when it has none)."""
    if r.get("skipped"):
        return "skipped: " + r["why"], None
    if "error" in r:
        return "failed: " + r["error"], None
    if not r.get("installed", True):
        return r["why"], None
    if r.get("excluded"):
        return "excluded: " + r["why"], None
    if key == "rate":
        return _fmt_rate(r["tasks_per_s"], "tasks/s"), r["tasks_per_s"]
    lat = r["latency"]
    return f"{_ms(lat['p50_ms'])} (p99 {_ms(lat['p99_ms'])})", lat["p50_ms"]


def table(results: dict[str, Any], plans: int) -> tuple[list[str], dict[str, Any]]:
    fw_t, fw_l = results["fleetwire_throughput"], results["fleetwire_latency"]
    r1, r64, rl, pp = results["relay_1"], results["relay_64"], results["relay_latency"], results["pingpong"]
    fw_rate = fw_t.get("plans_per_s")
    fw_p50, fw_p99 = fw_l.get("p50_ms"), fw_l.get("p99_ms")
    dask_rate_txt, dask_rate = _peer_cell(results["dask"], "rate")
    ray_rate_txt, ray_rate = _peer_cell(results["ray"], "rate")
    dask_lat_txt, dask_p50 = _peer_cell(results["dask"], "lat")
    ray_lat_txt, ray_p50 = _peer_cell(results["ray"], "lat")

    def x(fleetwire: float | None, peer: float | None, *, lower_is_better: bool = False) -> str:
        """How fleetwire compares: "12.3x faster" / "2.5x slower"."""
        if fleetwire is None or peer is None or fleetwire <= 0 or peer <= 0:
            return "-"
        ratio = peer / fleetwire if lower_is_better else fleetwire / peer
        return f"fleetwire {ratio:.1f}x faster" if ratio >= 1 else f"fleetwire {1 / ratio:.1f}x slower"

    fw_rate_txt = fw_t["error"] if "error" in fw_t else _fmt_rate(fw_rate, "plans/s")
    fw_lat_txt = fw_l["error"] if "error" in fw_l else f"{_ms(fw_p50)} (p99 {_ms(fw_p99)})"
    relay1_txt = r1["error"] if "error" in r1 else _fmt_rate(r1["items_per_s"], "items/s")
    relay64_txt = r64["error"] if "error" in r64 else _fmt_rate(r64["items_per_s"], "items/s")
    relay_lat_txt = rl["error"] if "error" in rl else f"{_ms(rl['p50_ms'])} (p99 {_ms(rl['p99_ms'])})"
    pp_txt = pp["error"] if "error" in pp else f"2-party RTT {_ms(pp['p50_ms'])}"
    r1_rate = r1.get("items_per_s")
    r64_rate = r64.get("items_per_s")
    relay_p50 = rl.get("p50_ms")
    lines = [
        f"| work | fleetwire (store: {fw_t.get('store_used', '?')}) | Dask distributed | Ray | "
        "raw relay, 1 msg/frame | raw relay, 64 msgs/frame |",
        "|---|---|---|---|---|---|",
        f"| {plans:,} no-op plans, throughput | {fw_rate_txt} | {dask_rate_txt} | {ray_rate_txt} | {relay1_txt} | "
        f"{relay64_txt} |",
        f"| ratio | - | {x(fw_rate, dask_rate)} | {x(fw_rate, ray_rate)} | {x(fw_rate, r1_rate)} | "
        f"{x(fw_rate, r64_rate)} |",
        f"| sequential submit -> result, p50 | {fw_lat_txt} | {dask_lat_txt} | {ray_lat_txt} | {relay_lat_txt} | "
        f"{pp_txt} |",
        f"| ratio (p50) | - | {x(fw_p50, dask_p50, lower_is_better=True)} | "
        f"{x(fw_p50, ray_p50, lower_is_better=True)} | {x(fw_p50, relay_p50, lower_is_better=True)} | - |",
    ]
    limit = durable_limit(results)
    if limit is not None:
        fs = results["fsync"]
        lines.append("")
        lines.append(f"durable floor: fsync p50 {_ms(fs['p50_ms'])} ({fs['call']} of {fs['bytes_per_commit']:,} bytes "
                     f"written in place in a WAL-sized file in {fs['dir']}; appended: {_ms(fs['append_p50_ms'])}); "
                     f"limit = relay p50 {_ms(relay_p50)} + 2 x fsync p50 = {_ms(limit['limit_ms'])}; durable p50 = "
                     f"{_fmt_x(limit['p50_x_limit'])} limit, p99 = {_fmt_x(limit['p99_x_limit'])} limit")
    tax = results.get("durability_tax")
    if tax is not None:
        lines.append(f"durability tax: durable / memory throughput = {tax['durable_x_memory']:.2f} "
                     f"({_fmt_rate(tax['durable_plans_per_s'], 'plans/s')} / "
                     f"{_fmt_rate(tax['memory_plans_per_s'], 'plans/s')})")
    verdict = {
        f"throughput >= {TARGETS['plans_per_s']:,} plans/s": _ok(fw_rate, lambda v: v >= TARGETS["plans_per_s"]),
        f">= {TARGETS['x_dask']}x Dask": _ok(_div(fw_rate, dask_rate), lambda v: v >= TARGETS["x_dask"]),
        f">= {TARGETS['x_ray']}x Ray": _ok(_div(fw_rate, ray_rate), lambda v: v >= TARGETS["x_ray"]),
        "above the unbatched raw relay": _ok(_div(fw_rate, r1_rate), lambda v: v > 1),
        f"p50 <= {TARGETS['p50_ms']} ms": _ok(fw_p50, lambda v: v <= TARGETS["p50_ms"]),
        f"p50 <= {TARGETS['p50_x_relay']}x the raw relay's": _ok(_div(fw_p50, relay_p50),
                                                                  lambda v: v <= TARGETS["p50_x_relay"]),
        f"p99 <= {TARGETS['p99_ms']} ms": _ok(fw_p99, lambda v: v <= TARGETS["p99_ms"]),
    }
    if limit is not None:
        verdict[f"durable p50 <= {TARGETS['p50_x_limit']}x limit (relay p50 + 2 fsync p50)"] = _ok(
            limit["p50_x_limit"], lambda v: v <= TARGETS["p50_x_limit"])
        verdict[f"durable p99 <= {TARGETS['p99_x_limit']}x limit"] = _ok(
            limit["p99_x_limit"], lambda v: v <= TARGETS["p99_x_limit"])
    if tax is not None:
        verdict[f"durable throughput >= {TARGETS['durable_x_memory']}x memory store's"] = _ok(
            tax["durable_x_memory"], lambda v: v >= TARGETS["durable_x_memory"])
    return lines, verdict


def _fmt_x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def durable_limit(results: dict[str, Any]) -> dict[str, Any] | None:
    """The durable floor (relay p50 + 2 fsync p50) and the durable latency's ratios to it; None unmeasured."""
    fs, rl, fw = results.get("fsync"), results.get("relay_latency", {}), results.get("fleetwire_latency", {})
    if not fs or "p50_ms" not in rl:
        return None
    limit_ms = rl["p50_ms"] + 2 * fs["p50_ms"]
    return {
        "limit_ms": round(limit_ms, 4),
        "relay_p50_ms": rl["p50_ms"],
        "fsync_p50_ms": fs["p50_ms"],
        "p50_x_limit": _round(_div(fw.get("p50_ms"), limit_ms)),
        "p99_x_limit": _round(_div(fw.get("p99_ms"), limit_ms)),
    }


def durability_tax(results: dict[str, Any]) -> dict[str, Any] | None:
    """Durable ÷ memory store throughput of this run (``--also-memory``); None unmeasured."""
    durable = results.get("fleetwire_throughput", {}).get("plans_per_s")
    memory = results.get("fleetwire_memory_throughput", {}).get("plans_per_s")
    if durable is None or memory is None:
        return None
    return {"durable_plans_per_s": durable, "memory_plans_per_s": memory,
            "durable_x_memory": _round(_div(durable, memory))}  # fmt: skip


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _ok(value: float | None, test: Any) -> str:
    if value is None:
        return "not measured"
    return f"{'reached' if test(value) else 'NOT reached'} ({value:,.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=20_000, help="plans/tasks/items for throughput (default 20000)")
    parser.add_argument("--samples", type=int, default=2000, help="round trips for fleetwire and the relay")
    parser.add_argument("--peer-samples", type=int, default=500, help="round trips for Dask and Ray (default 500)")
    parser.add_argument("--peers", default="dask,ray", help="dask,ray (default), one of them, or none")
    parser.add_argument("--store", choices=("memory", "sqlite"), default="sqlite", help="fleetwire's store")
    parser.add_argument("--store-writer", choices=("thread", "process"), default=None,
                        help="the sqlite store's --store-writer (default: the coordinator's default)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each run may take (default 300)")
    parser.add_argument("--also-memory", action="store_true",
                        help="run fleetwire with the memory store too (what durability costs)")
    parser.add_argument("--fsync-dir", metavar="DIR",
                        help="where to measure the fsync floor (default: the temporary directory, where the "
                             "benchmarks' stores are)")
    parser.add_argument("--fsync-samples", type=int, default=300,
                        help="commit-sized fdatasyncs measured before and after the fleetwire runs (default 300)")
    parser.add_argument("--json", action="store_true", help="print every result as one JSON object")
    parser.add_argument("--tracing", action="store_true",
                        help="measure what tracing costs instead: fleetwire at off / 1 %% / 100 %% sampling, and "
                             "100 %% with every process exporting in a thread or through a child process "
                             "(bench/_tracing_cost.py; needs fleetwire[otel])")
    parser.add_argument("--rounds", type=int, default=2, help="with --tracing: interleaved rounds (default 2)")
    parser.add_argument("--tracing-levels", default="off,1,100,100-threads,100-processes", metavar="LIST",
                        help="with --tracing: the levels to run, comma-separated among off, 0 (tracing on, nothing "
                             "sampled: propagation alone), 1, 100, 100-threads, 100-processes (off always runs); e.g. "
                             "'off,1' with many --rounds to resolve 1 %%'s cost; a level named twice runs twice "
                             "('off,off': the A/A control, what the method alone shows)")
    parser.add_argument("--tracing-order", choices=("rotate", "fixed"), default="rotate",
                        help="with --tracing: each round's order of the levels, rotated by one from the last round's "
                             "(default; each level runs in each slot alike) or the same every round (as before)")
    ns = parser.parse_args(argv)
    if ns.tracing:
        import _tracing_cost

        lines, traced = _tracing_cost.measure(ns, run)
        print(json.dumps(traced, sort_keys=True) if ns.json else "\n".join(lines))
        return 0
    results = collect(ns)
    results["durable_limit"] = durable_limit(results)
    results["durability_tax"] = durability_tax(results)
    lines, verdict = table(results, ns.plans)
    results["verdict"] = verdict
    if ns.json:
        print(json.dumps(results, sort_keys=True))
        return 0
    m = results["machine"]
    print(f"machine: {m.get('cpus')} CPUs ({m.get('cpu', '?')}), {m.get('mem_gib', '?')} GiB, "
          f"Python {m.get('python')}; everything on 127.0.0.1")
    print("\n".join(lines))
    mem_t, mem_l = results.get("fleetwire_memory_throughput"), results.get("fleetwire_memory_latency")
    if mem_t is not None and mem_l is not None:
        rate = mem_t.get("error") or _fmt_rate(mem_t.get("plans_per_s"), "plans/s")
        lat = mem_l.get("error") or f"p50 {_ms(mem_l.get('p50_ms'))}, p99 {_ms(mem_l.get('p99_ms'))}"
        print(f"\nfleetwire with the memory store (no durability), same run: {rate}; {lat}")
    print("\ntargets (docs/PERFORMANCE.md):")
    for name, state in verdict.items():
        print(f"  {name}: {state}")
    for key in ("dask", "ray"):
        r = results[key]
        if r.get("installed") and not r.get("excluded") and "error" not in r:
            print(f"{key}: {r.get('version')} {r.get('setup')}; sockets: {r.get('sockets_checked_after')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
