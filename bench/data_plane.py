"""Data plane throughput: a plan's input and output, beside the raw ceilings, Dask and Ray, in one run.

    python bench/data_plane.py                      # 64 MiB and 1 GiB, every column
    python bench/data_plane.py --sizes 64M --skip ray,dask --json
    python bench/data_plane.py --dir /dev/shm --only raw,ws,direct   # the spool on tmpfs: no disk writeback

``--dir`` is where the input files, the worker's spool and the fetched outputs go: fleetwire
writes every input to the worker's disk and every output to the client's (the ceilings and the
peers keep nothing), so on a slow disk its figures are the disk's; on tmpfs they are the path's.

Each size is a file of random bytes in a temporary directory (the input is a file: that is what
the client and worker RSS targets are about). Every column runs in a fresh child process of its
own, so one column's memory or threads never show in another's figures:

* ``raw``: the same bytes over one plain loopback TCP socket (``sendfile`` on the sending side,
  ``recv_into`` a reused buffer on the other, nothing kept): the ceiling of moving bytes at all.
* ``ws``: the same bytes over one websocket connection (the ``websockets`` library, 1 MiB binary
  messages, no compression), the receiving side discarding them: the ceiling the targets name,
  both processes with the C allocator as it comes.
* ``ws-pad``: the same, both processes with glibc's top pad at 64 MiB (``MALLOC_TOP_PAD_``): the
  setting every fleetwire process runs with (fleetwire/memtune.py). The library's per-frame
  buffers fault every page in afresh without it, so this is the ceiling on equal terms; the
  table gives each column's ratio to both.
* ``direct``: fleetwire, a coordinator and a worker (``--data-listen 127.0.0.1:0``) as real
  processes; the client submits a plan with ``inputs={"data": Path}`` (the worker spools it to a
  file, verifying its blake3 digest as it arrives) and fetches an output with ``plan.output_to(...)``.
  *in*: from the submit's answer to the plan's result (lease, upload, verify, a handler that only
  reads ``.size``); the digest pass before the submit is reported apart (``digest s``). *out*:
  ``output_to`` a file once the plan (which copied the file into the worker's spool) succeeded.
* ``relay``: the same through the coordinator (``relay=True``), when this SDK has it.
* ``dask``: ``LocalCluster`` (one worker process, 127.0.0.1); *in*: ``client.scatter(bytes)`` and a
  task that takes its ``len``; *out*: a task that returns the file's bytes, gathered once done.
  The file read into memory is not timed; the scheduler runs in the client's process.
* ``ray``: ``ray.put(bytes)`` and a task; *out*: a task's returned bytes, ``ray.get`` once done;
  run only if every socket stays on loopback (as bench/peers.py checks), else excluded with why.
  On one host Ray moves objects through shared memory, not a socket.

``--repeat N`` runs every column N times, each in a fresh process, and reports per direction the
run with the median MB/s (its CPU and RSS figures too) and the range of all N: on a shared VM one
run's figure can be half another's (a cold worker's first spool writes there cost host-level page
faults; see docs/OPERATIONS.md), and the median of three is the figure to compare.

Figures: MB/s (10^6 bytes per second), the ratio to ``ws``, the coordinator's CPU seconds and
RSS growth during the transfer (fleetwire: the coordinator process), the client's and worker's
CPU seconds (steadier than MB/s on a shared machine; for ``raw`` and ``ws`` the worker's are the
server process's), and the client's and worker's RSS growth: peak (``VmHWM``, reset through
``/proc/PID/clear_refs`` before each transfer) minus the RSS before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _harness as h

from fleetwire.memtune import DEFAULT_TOP_PAD

MIB = 1 << 20
COLUMNS = ("raw", "ws", "ws-pad", "direct", "relay", "dask", "ray")
WS_MESSAGE = MIB


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def size_label(size: int) -> str:
    return f"{size >> 30} GiB" if size >= 1 << 30 and not size % (1 << 30) else f"{size / MIB:g} MiB"


def make_file(path: Path, size: int) -> None:
    """``size`` random bytes (8 MiB of randomness repeated with a counter: cheap, and no block repeats)."""
    block = bytearray(os.urandom(8 * MIB))
    with open(path, "wb") as out:
        written, n = 0, 0
        while written < size:
            block[:8] = n.to_bytes(8, "little")
            part = memoryview(block)[: min(len(block), size - written)]
            out.write(part)
            written += len(part)
            n += 1


# ---------------------------------------------------------------------------- memory and CPU


class Watch:
    """CPU seconds and peak RSS growth of some processes over one transfer (Linux /proc)."""

    def __init__(self, **pids: int) -> None:
        self.pids = {name: pid for name, pid in pids.items() if pid}
        self.rss0: dict[str, int] = {}
        self.cpu0: dict[str, float] = {}

    def __enter__(self) -> Watch:
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError):  # the peak starts again from the current RSS
                Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.rss0[name] = h.rss_bytes(pid)
            self.cpu0[name] = h.cpu_seconds(pid)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.t0
        self.cpu = {name: h.cpu_seconds(pid) - self.cpu0[name] for name, pid in self.pids.items()}
        self.growth = {name: _peak_rss(pid) - self.rss0[name] for name, pid in self.pids.items()}

    def figures(self, size: int) -> dict[str, Any]:
        result: dict[str, Any] = {"s": round(self.elapsed, 4), "mb_s": round(size / self.elapsed / 1e6, 1)}
        for name in self.pids:
            result[f"{name}_cpu_s"] = round(self.cpu[name], 3)
            result[f"{name}_rss_mib"] = round(max(0, self.growth[name]) / MIB, 1)
        return result


def _peak_rss(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return h.rss_bytes(pid)


# ---------------------------------------------------------------------------- raw socket ceiling


def serve_raw() -> None:
    """One job per connection: ``IN n`` (read n bytes, discard, answer ``K``) or ``OUT n path`` (sendfile)."""
    listener = socket.create_server((h.HOST, 0))
    print(f"port {listener.getsockname()[1]}", flush=True)
    buffer = bytearray(4 * MIB)
    while True:
        conn, _ = listener.accept()
        with conn:
            head = b""
            while not head.endswith(b"\n"):
                head += conn.recv(1)
            kind, size, *rest = head.decode().split()
            remaining = int(size)
            if kind == "IN":
                while remaining:
                    got = conn.recv_into(buffer, min(len(buffer), remaining))
                    if not got:
                        break
                    remaining -= got
                conn.sendall(b"K")
            else:
                with open(rest[0], "rb") as file:
                    conn.sendfile(file, 0, remaining)


def start_server(kind: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True,
                            env=h.bench_env(), cwd=h.ROOT)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("port "):
        proc.kill()
        raise RuntimeError(f"the {kind} server did not start: {line!r}")
    return proc, int(line.split()[1])


def column_raw(path: Path, size: int) -> dict[str, Any]:
    server, port = start_server("raw")
    try:
        with socket.create_connection((h.HOST, port)) as sock, open(path, "rb") as file, Watch(client=os.getpid(),
                                                                                               server=server.pid) as w:
            sock.sendall(f"IN {size}\n".encode())
            sock.sendfile(file, 0, size)
            assert sock.recv(1) == b"K"
        result = {"in": w.figures(size)}
        buffer = bytearray(4 * MIB)
        with socket.create_connection((h.HOST, port)) as sock, Watch(client=os.getpid(), server=server.pid) as w:
            sock.sendall(f"OUT {size} {path}\n".encode())
            remaining = size
            while remaining:
                got = sock.recv_into(buffer, min(len(buffer), remaining))
                assert got, "the raw server closed early"
                remaining -= got
        result["out"] = w.figures(size)
        return result
    finally:
        server.kill()
        server.wait()


# ---------------------------------------------------------------------------- websocket ceiling


async def _serve_ws() -> None:
    from websockets.asyncio.server import ServerConnection, serve

    async def job(ws: ServerConnection) -> None:
        kind, size, *rest = str(await ws.recv()).split()
        remaining = int(size)
        if kind == "IN":
            while remaining:
                remaining -= len(await ws.recv())
            await ws.send("K")
            return
        with open(rest[0], "rb") as file:  # noqa: ASYNC230  (a page-cache read of the bench's own file)
            while remaining:
                chunk = file.read(min(WS_MESSAGE, remaining))
                remaining -= len(chunk)
                await ws.send(chunk)
        await ws.recv()

    async with serve(job, h.HOST, 0, compression=None, max_size=None) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        print(f"port {port}", flush=True)
        await asyncio.Event().wait()


async def _ws_column(path: Path, size: int) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    server, port = start_server("ws")
    try:
        uri = f"ws://{h.HOST}:{port}"
        async with connect(uri, compression=None, max_size=None) as ws:
            with open(path, "rb") as file, Watch(client=os.getpid(), server=server.pid) as w:  # noqa: ASYNC230
                await ws.send(f"IN {size}")
                remaining = size
                while remaining:
                    chunk = file.read(min(WS_MESSAGE, remaining))
                    remaining -= len(chunk)
                    await ws.send(chunk)
                assert await ws.recv() == "K"
        result = {"in": w.figures(size)}
        async with connect(uri, compression=None, max_size=None) as ws:
            with Watch(client=os.getpid(), server=server.pid) as w:
                await ws.send(f"OUT {size} {path}")
                remaining = size
                while remaining:
                    remaining -= len(await ws.recv())
            await ws.send("K")
        result["out"] = w.figures(size)
        return result
    finally:
        server.kill()
        server.wait()


# ---------------------------------------------------------------------------- fleetwire


async def _fleetwire_column(path: Path, size: int, relay: bool) -> dict[str, Any]:
    from fleetwire import Client

    submit_relay = "relay" in inspect.signature(Client.submit).parameters
    if relay and not submit_relay:
        return {"not_yet": "this SDK has no relay path yet (Client.submit has no relay=)"}
    work = Path(tempfile.mkdtemp(prefix="fw-bench-", dir=path.parent))
    async with h.fleet("memory") as f:
        await f.start_coordinator()
        worker = await f.start_worker(
            "bench-data", "--data-listen", "127.0.0.1:0", "--spool-dir", str(work / "spool"),
            "--handler", "data_sink=_bench_handlers:data_sink", "--handler", "data_source=_bench_handlers:data_source",
            max_concurrency=2,
        )
        await f.wait_workers()
        assert f.coordinator is not None
        pids = {"client": os.getpid(), "coordinator": f.coordinator.pid, "worker": worker.pid}
        profiler = h.Profiler(os.environ.get("FW_BENCH_PROFILE"))
        for name, pid in pids.items():
            profiler.attach(f"{'relay' if relay else 'direct'}-{size >> 20}M-{name}", pid)
        extra: dict[str, Any] = {"relay": True} if relay else {}
        async with Client(f.url) as client:
            warm = await client.submit("data_sink", inputs={"data": b"warm up"}, **extra)
            await warm.result()
            with Watch(**pids) as w:
                t0 = time.perf_counter()
                plan = await client.submit("data_sink", inputs={"data": path}, **extra)
                digest_s = time.perf_counter() - t0
                w.t0 = time.perf_counter()  # the transfer: from the submit's answer
                result = await plan.result()
            assert result["size"] == size, result
            figures: dict[str, Any] = {"in": {**w.figures(size), "digest_s": round(digest_s, 3)}}
            plan = await client.submit("data_source", {"path": str(path)}, outputs=["out"], **extra)
            await plan.result()
            target = work / "out.bin"
            if relay and not hasattr(plan, "relay"):
                figures["out"] = {"not_yet": "this SDK's plans have no relay attribute yet"}
            else:
                if relay:
                    plan.relay = True  # its output comes through the coordinator too
                with Watch(**pids) as w:
                    await plan.output_to("out", target)
                assert target.stat().st_size == size
                figures["out"] = w.figures(size)
                target.unlink()
        profiler.finish()
    return figures


# ---------------------------------------------------------------------------- peers


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def column_dask(path: Path, size: int) -> dict[str, Any]:
    try:
        import dask
        from distributed import Client, LocalCluster, wait
    except ImportError as exc:
        return {"excluded": f"not installed ({exc.name}); pip install -r bench/requirements.txt"}
    from peers import non_loopback_sockets

    with dask.config.set({"distributed.worker.daemon": False}), LocalCluster(
        n_workers=1, threads_per_worker=1, processes=True, host=h.HOST, dashboard_address=None, silence_logs=40,
    ) as cluster, Client(cluster) as client:
        client.submit(len, b"warm", pure=False).result()
        bad = non_loopback_sockets()
        if bad:
            return {"excluded": f"{len(bad)} sockets beyond 127.0.0.1, e.g. {bad[0]}"}
        worker_pid = next(iter(client.run(os.getpid).values()))
        data = _read(str(path))
        with Watch(client=os.getpid(), worker=worker_pid) as w:
            future = client.scatter(data)
            assert client.submit(len, future, pure=False).result() == size
        result: dict[str, Any] = {"in": w.figures(size)}
        del data, future
        future = client.submit(_read, str(path), pure=False)
        wait(future)
        with Watch(client=os.getpid(), worker=worker_pid) as w:
            data = future.result()
        assert len(data) == size
        result["out"] = w.figures(size)
        result["setup"] = "LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host=127.0.0.1)"
        return result


def column_ray(path: Path, size: int) -> dict[str, Any]:
    try:
        import ray
    except ImportError as exc:
        return {"excluded": f"not installed ({exc.name}); pip install -r bench/requirements.txt"}
    from peers import non_loopback_sockets

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=1, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR",
             configure_logging=False, log_to_driver=False, object_store_memory=max(3 * size, 256 * MIB))
    try:
        bad = non_loopback_sockets()
        if bad:
            return {"excluded": f"{len(bad)} sockets beyond 127.0.0.1 even with _node_ip_address=127.0.0.1, "
                                f"e.g. {bad[0]}"}
        length = ray.remote(len)
        reader = ray.remote(_read)
        ray.get(length.remote(b"warm"))
        data = _read(str(path))
        with Watch(client=os.getpid()) as w:
            assert ray.get(length.remote(ray.put(data))) == size
        result: dict[str, Any] = {"in": w.figures(size)}
        del data
        ref = reader.remote(str(path))
        ray.wait([ref])
        with Watch(client=os.getpid()) as w:
            data = ray.get(ref)
        assert len(data) == size
        result["out"] = w.figures(size)
        return result
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()


def run_column(column: str, path: Path, size: int) -> dict[str, Any]:
    if column == "raw":
        return column_raw(path, size)
    if column in ("ws", "ws-pad"):  # ws-pad: its environment has the pad (child())
        return h.run_loop(_ws_column(path, size))  # type: ignore[no-any-return]
    if column in ("direct", "relay"):
        return h.run_loop(_fleetwire_column(path, size, relay=column == "relay"))  # type: ignore[no-any-return]
    if column == "dask":
        return column_dask(path, size)
    return column_ray(path, size)


# ---------------------------------------------------------------------------- the run


def child(column: str, path: Path, size: int, timeout_s: float) -> dict[str, Any]:
    """One column in a fresh process; its JSON result (or why it has none)."""
    try:
        pad = {"MALLOC_TOP_PAD_": str(DEFAULT_TOP_PAD)} if column == "ws-pad" else {}
        done = subprocess.run([sys.executable, __file__, "--column", column, "--file", str(path), "--size", str(size)],
                              capture_output=True, text=True, env=h.bench_env(**pad), cwd=h.ROOT, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s:g} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One column's result from repeated runs: per direction, the figures of the run with the median MB/s
    (the lower middle one for an even count), with every run's MB/s in ``mb_s_runs``."""
    merged = dict(runs[0])
    for direction in ("in", "out"):
        done = [run[direction] for run in runs if "mb_s" in run.get(direction, {})]
        if len(done) > 1:
            ranked = sorted(done, key=lambda figures: figures["mb_s"])
            merged[direction] = {**ranked[(len(ranked) - 1) // 2], "mb_s_runs": [f["mb_s"] for f in done]}
    return merged


def _runs(figures: dict[str, Any]) -> str:
    """``--repeat``: the range of the runs' MB/s ("-" for one run)."""
    runs = figures.get("mb_s_runs")
    return f"{min(runs):.0f}-{max(runs):.0f}" if runs else "-"


def _cell(figures: dict[str, Any], key: str, fmt: str = "{:.2f}") -> str:
    value = figures.get(key)
    return "-" if value is None else fmt.format(value)


def table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    head = (f"{'size':>8} {'dir':>3} {'column':>7} {'MB/s':>8} {'x ws':>6} {'x ws-pad':>8} {'x dask':>6} "
            f"{'digest s':>8} "
            f"{'coord cpu s':>11} {'coord rss MiB':>13} {'client rss MiB':>14} {'worker rss MiB':>14} "
            f"{'client cpu s':>12} {'worker cpu s':>12} {'runs MB/s':>15}")
    lines = [head, "-" * len(head)]
    notes: list[str] = []
    for label, columns in results.items():
        for direction in ("in", "out"):
            ws = columns.get("ws", {}).get(direction, {}).get("mb_s")
            ws_pad = columns.get("ws-pad", {}).get(direction, {}).get("mb_s")
            dask = columns.get("dask", {}).get(direction, {}).get("mb_s")
            for column, result in columns.items():
                figures = result.get(direction)
                why = (result.get("not_yet") or result.get("excluded") or result.get("error")
                       or (figures or {}).get("not_yet"))
                if figures is None or "mb_s" not in figures:
                    text = "not yet" if result.get("not_yet") or (figures or {}).get("not_yet") else "excluded"
                    lines.append(f"{label:>8} {direction:>3} {column:>7} {text:>8}")
                    if why:
                        notes.append(f"{column}: {why}")
                    continue
                mb_s = figures["mb_s"]
                lines.append(
                    f"{label:>8} {direction:>3} {column:>7} {mb_s:>8.0f} "
                    f"{(f'{mb_s / ws:.2f}' if ws else '-'):>6} {(f'{mb_s / ws_pad:.2f}' if ws_pad else '-'):>8} "
                    f"{(f'{mb_s / dask:.2f}' if dask else '-'):>6} "
                    f"{_cell(figures, 'digest_s'):>8} {_cell(figures, 'coordinator_cpu_s', '{:.3f}'):>11} "
                    f"{_cell(figures, 'coordinator_rss_mib', '{:.1f}'):>13} "
                    f"{_cell(figures, 'client_rss_mib', '{:.1f}'):>14} "
                    f"{_cell(figures, 'worker_rss_mib', '{:.1f}'):>14} "
                    f"{_cell(figures, 'client_cpu_s'):>12} "
                    f"{_cell(figures, 'worker_cpu_s' if 'worker_cpu_s' in figures else 'server_cpu_s'):>12} "
                    f"{_runs(figures):>15}"
                )
        lines.append("")
    for note in dict.fromkeys(notes):
        lines.append(f"note: {note}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64M,1G", help="comma-separated sizes (K, M, G: binary), default 64M,1G")
    parser.add_argument("--skip", default="", help=f"columns to leave out, comma-separated, of {','.join(COLUMNS)}")
    parser.add_argument("--only", default="", help="run only these columns (comma-separated)")
    parser.add_argument("--dir", help="where the input files go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one column may take (default 300)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each column this many times (each in a fresh process) and report the run with "
                             "the median MB/s, per direction, with the range (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--profile", metavar="DIR",
                        help="py-spy profiles of the fleetwire client, coordinator and worker into DIR")
    parser.add_argument("--serve", choices=("raw", "ws"), help=argparse.SUPPRESS)
    parser.add_argument("--column", choices=COLUMNS, help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.serve == "raw":
        serve_raw()
        return 0
    if ns.serve == "ws":
        h.run_loop(_serve_ws())
        return 0
    if ns.column:
        print(json.dumps(run_column(ns.column, Path(ns.file), ns.size)), flush=True)
        return 0
    if ns.profile:
        os.environ["FW_BENCH_PROFILE"] = str(Path(ns.profile).resolve())
    skip = {c for c in ns.skip.split(",") if c}
    columns = [c for c in (ns.only.split(",") if ns.only else COLUMNS) if c and c not in skip]
    sizes = [parse_size(s) for s in ns.sizes.split(",") if s]
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fw-data-bench-", dir=ns.dir) as tmp:
        for size in sizes:
            path = Path(tmp) / f"input-{size}.bin"
            make_file(path, size)
            label = size_label(size)
            results[label] = {}
            for column in columns:
                runs = []
                for run in range(max(1, ns.repeat)):
                    print(f"# {label} {column} ({run + 1}/{max(1, ns.repeat)}) ...", file=sys.stderr, flush=True)
                    runs.append(child(column, path, size, ns.timeout))
                results[label][column] = median_run(runs)
            path.unlink()
    report = {"bench": "data_plane", "machine": h.machine(), "results": results}
    h.emit(report, ns.json, [f"data plane, {h.machine()}", *table(results)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
