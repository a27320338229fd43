"""Plan graphs (issue #28) beside Ray (object refs) and Dask (futures), measured in one run.

    python bench/graphs.py                                   # every part, every column
    python bench/graphs.py --parts fan --columns core --json
    python bench/graphs.py --chain-mib 64 --peer-python /path/to/venv/bin/python

Parts:

* ``chain``: ``--chain`` plans (10), each taking the previous one's output (``--chain-mib``, 256 MiB)
  as its input and writing it out again as its own output. Figures: wall time beside the raw copy
  (the same bytes copied as many times in one process's memory; fleetwire's steps are shell plans
  that ``cat`` a file, so ``raw_file_copy_s`` is the same ``cat`` run as many times on the same
  disk), bytes through the client and the coordinator (fleetwire: 0 on the direct path; the
  coordinator's figure is its relay counter), the share of plans placed on the worker that held
  their input.
* ``fan``: one producer, ``--fan`` (1,000) small consumers of its output, one plan after them all:
  2 x fan edges, every submit sent without waiting for the one before's reply. Figures: wall
  time per edge and the control plane's CPU per edge (fleetwire: the
  coordinator process; Dask: the scheduler, in the driver's process; Ray: its GCS and raylet).
  The ``core`` column is the graph's own bookkeeping (coordinator/graphs/, driven directly): what
  each edge costs the coordinator's decisions, with no sockets.
* ``loss``: a chain of ``--loss-chain`` (6) plans on two workers, each step after the first
  sleeping ``LOSS_PAUSE_S`` (1 s) on every column; the worker holding a mid-chain output is
  killed (``SIGKILL``) once it made it (fleetwire's outputs are 1.2 MiB, past locality's 1 MiB, so
  the chain runs where its bytes are, as Dask's does). Figures: whether the chain completes, how many
  times each step ran to completion (the producer of the lost output: twice; nothing downstream
  twice; fleetwire's ``starts_per_step`` also counts a run the kill cut short).

Columns: ``core`` (fan only), ``fleetwire`` (a coordinator and two workers as real processes),
``dask`` (``LocalCluster``, two worker processes of one thread, 127.0.0.1), ``ray``
(``ray.init(num_cpus=2)`` on 127.0.0.1; its loss part is not run: on one node Ray's objects live
in the node's shared store, not in the worker process that made them, so killing that process loses
nothing). Each column runs in a child process of its own (a peer's, one per part; fleetwire's, every
part in one fleet, started once: chain, fan, then loss); the peers' with ``--peer-python`` (a
Python that has them: ``pip install -r bench/requirements.txt``); a peer that is missing, or that
opens a socket beyond loopback (bench/peers.py), is excluded with why. Ray's GCS listens on every
address, so its child runs in a network namespace of its own whose only interface is lo (``unshare
--net``, where the host allows it: root), where such a listen reaches loopback alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _harness as h

MIB = 1 << 20
PARTS = ("chain", "fan", "loss")
COLUMNS = ("core", "fleetwire", "dask", "ray")
LOSS_PAUSE_S = 1.0  # each loss step after the first sleeps this long: the step after the killed holder is unfinished


# ---------------------------------------------------------------------------- core: the graph alone


@dataclass
class _Plan:
    """What coordinator/graphs/ reads of a plan (its PlanView)."""

    id: str
    owner: str = "bench"
    state: str = "queued"
    attempt: int = 0
    worker_id: str | None = None
    produced: list[Any] = field(default_factory=list)
    inputs: list[Any] = field(default_factory=list)
    deterministic: bool = True
    error: Any = None

    @property
    def terminal(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")


def core_fan(fan: int) -> dict[str, Any]:
    """The fan part on the graph's bookkeeping alone: submit (refusal, add, admit), each end, per edge."""
    from coordinator.graphs import Need, PlanGraph
    from protocol.messages import OutputSpec

    plans: dict[str, _Plan] = {}
    graph = PlanGraph(plans)
    spec = OutputSpec("y", 10, "blake3:" + "0" * 64)
    t0 = time.perf_counter()
    cpu0 = time.process_time()

    def submit(key: str, needs: list[Need]) -> None:
        assert graph.refusal(key, "bench", needs) is None
        plans[key] = _Plan(key)
        graph.add(key, needs)
        graph.admit(key)

    def end(key: str) -> list[str]:
        plan = plans[key]
        plan.state, plan.attempt, plan.worker_id, plan.produced = "succeeded", 1, "w1", [spec]
        return graph.ended(key).ready

    plans["src"] = _Plan("src")
    consumers = [f"c{i}" for i in range(fan)]
    for key in consumers:
        submit(key, [Need("src", "y", "x")])
    submit("sink", [Need(key) for key in consumers])
    ready = end("src")
    assert len(ready) == fan
    for key in consumers:
        ready = end(key)
    assert ready == ["sink"]
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    edges = 2 * fan
    return {"edges": edges, "wall_s": round(wall, 4), "us_per_edge": round(wall / edges * 1e6, 2),
            "cpu_us_per_edge": round(cpu / edges * 1e6, 2)}


# ---------------------------------------------------------------------------- fleetwire


def fleetwire_parts(parts: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    """The parts on fleetwire, in one fleet: a coordinator and two workers (data endpoints on loopback) as real
    processes, the parts in the order of PARTS (the loss part, which kills a worker, last). ``{"parts": {...}}``."""
    import fleetwire

    if not hasattr(fleetwire, "OutputRef"):
        return {"excluded": "this SDK has no plan references"}
    return {"parts": h.run_loop(_with_fleet([part for part in PARTS if part in parts], ns))}


async def _with_fleet(parts: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    runs = {"chain": _fw_chain, "fan": _fw_fan, "loss": _fw_loss}
    coordinator_args = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.5", "--worker-reconnect-grace-s", "1"]
    results: dict[str, Any] = {}
    async with h.fleet("memory") as fleet:
        await fleet.start_coordinator(*coordinator_args)
        for worker_id in ("w1", "w2"):
            await fleet.start_worker(worker_id, "--allow-shell", "--data-listen", "127.0.0.1:0",
                                     "--spool-dir", f"{fleet.tmp.name}/{worker_id}", max_concurrency=2)
        await fleet.wait_workers()
        from fleetwire import Client

        for part in parts:
            try:
                async with Client(fleet.url) as client:
                    results[part] = await runs[part](client, fleet, ns)
            except Exception as exc:  # a part that fails is reported as such; the next one still runs
                results[part] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            results[part]["setup"] = ("coordinator + 2 workers (--max-concurrency 2, data endpoints), 127.0.0.1, "
                                      "store memory; one fleet for every part, in the order chain, fan, loss")
    return results


def _relay_bytes(url: str) -> float:
    """fleetwire_relay_bytes_total on the coordinator's /metrics: what the relay carried (both directions)."""
    import urllib.request

    with urllib.request.urlopen(url.replace("ws://", "http://") + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("fleetwire_relay_bytes_total"))


_COPY = 'cat "$FLEETWIRE_INPUT_X" > "$FLEETWIRE_OUTPUT_DIR/y"'


async def _fw_chain(client: Any, fleet: Any, ns: argparse.Namespace) -> dict[str, Any]:
    size = ns.chain_mib * MIB
    first = await client.submit("shell", args={"cmd": f'head -c {size} /dev/urandom > "$FLEETWIRE_OUTPUT_DIR/y"'},
                                outputs=["y"])  # fmt: skip
    await first.result()
    coordinator_cpu0 = h.cpu_seconds(fleet.coordinator.pid)
    t0 = time.perf_counter()
    plans = [first]
    for _ in range(ns.chain):
        plans.append(await client.submit("shell", args={"cmd": _COPY}, inputs={"x": plans[-1].ref("y")}, outputs=["y"]))
    await plans[-1].result()
    wall = time.perf_counter() - t0
    local = sum(1 for before, plan in itertools.pairwise(plans) if plan.worker_id == before.worker_id)
    raw_file = _raw_file_copy_s(ns.chain, size, Path(fleet.tmp.name))
    return {"wall_s": round(wall, 3), "raw_copy_s": _raw_copy_s(ns.chain, size), "raw_file_copy_s": raw_file,
            "on_holder_share": round(local / ns.chain, 3), "client_bytes": 0 if all(p.uploads is None for p in plans)
            else "uploads", "coordinator_bytes": _relay_bytes(fleet.url),
            "coordinator_cpu_s": round(h.cpu_seconds(fleet.coordinator.pid) - coordinator_cpu0, 3),
            "note": "client_bytes: no plan uploaded anything; coordinator_bytes: its relay's counter"}


async def _fw_fan(client: Any, fleet: Any, ns: argparse.Namespace) -> dict[str, Any]:
    src = await client.submit("shell", args={"cmd": 'echo hello > "$FLEETWIRE_OUTPUT_DIR/y"'}, outputs=["y"])
    await src.result()
    cpu0 = h.cpu_seconds(fleet.coordinator.pid)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(client.submit("echo", args=i, inputs={"x": src.ref("y")}) for i in range(ns.fan)))
    sink = await client.submit("echo", args="sink", after=outs)
    await sink.result()
    wall = time.perf_counter() - t0
    cpu = h.cpu_seconds(fleet.coordinator.pid) - cpu0
    edges = 2 * ns.fan
    return {"edges": edges, "wall_s": round(wall, 3), "us_per_edge": round(wall / edges * 1e6, 1),
            "control_cpu_us_per_edge": round(cpu / edges * 1e6, 1),
            "control_cpu_is": "the coordinator process (each edge: a plan's submit, placement, events and end too)"}


async def _fw_loss(client: Any, fleet: Any, ns: argparse.Namespace) -> dict[str, Any]:
    """Each step writes ``<i> start`` and ``<i> done`` lines to one log (every worker runs on this host), so a
    step's completed runs are counted whoever ran them: its attempts and the rebuilds of its output alike."""
    mid = ns.loss_chain // 2
    log_path = Path(fleet.tmp.name) / "runs.log"

    def step(i: int, body: str) -> dict[str, str]:
        pause = f"sleep {LOSS_PAUSE_S:g}; " if i else ""
        return {"cmd": f'echo "{i} start" >> "{log_path}"; {pause}{body}; echo "{i} done" >> "{log_path}"'}

    numbers = 'seq 1 200000 > "$FLEETWIRE_OUTPUT_DIR/y"'  # 1.2 MiB: past locality's 1 MiB, each step goes to its holder
    plans = [await client.submit("shell", args=step(0, numbers), outputs=["y"])]
    for i in range(1, ns.loss_chain + 1):
        plans.append(await client.submit("shell", args=step(i, _COPY), inputs={"x": plans[-1].ref("y")}, outputs=["y"]))
    await plans[mid].result()
    victim = plans[mid].worker_id
    next(w for w in fleet.workers if w.name == victim).kill()
    t0 = time.perf_counter()
    await asyncio.wait_for(plans[-1].result(), 120)
    after = time.perf_counter() - t0
    seen = collections.Counter(tuple(line.split()) for line in log_path.read_text().splitlines())
    started = [seen[(str(i), "start")] for i in range(len(plans))]
    completed = [seen[(str(i), "done")] for i in range(len(plans))]
    listed = {p.id: p for p in (await client.plans(limit=1000)).plans}
    return {"completed": listed[plans[-1].id].state == "succeeded", "after_kill_s": round(after, 2), "killed": victim,
            "runs_per_step": completed, "starts_per_step": started, "producer_runs": completed[mid],
            "rebuilds": sorted(key for key in listed if ".r" in key),
            "downstream_max_runs": max(completed[mid + 1:], default=0),
            "downstream_max_starts": max(started[mid + 1:], default=0),
            "note": "runs: completed runs of a step (attempts, rebuilds); starts count a run cut by the kill too"}


def _raw_file_copy_s(length: int, size: int, where: Path) -> float:
    """The same bytes copied ``length`` times file to file on the spools' disk (``cat``, as each step does)."""
    source = where / "raw.bin"
    source.write_bytes(os.urandom(size))
    t0 = time.perf_counter()
    for i in range(length):
        target = where / f"raw{i}.bin"
        subprocess.run(["sh", "-c", f'cat "{source}" > "{target}"'], check=True)
        source = target
    return round(time.perf_counter() - t0, 3)


# ---------------------------------------------------------------------------- dask


def _pass_on(data: bytes) -> bytes:
    """A chain step: read the input, write it out again as a new object."""
    return bytes(memoryview(data))


def _make(size: int) -> bytes:
    return os.urandom(size)


def _small(x: Any) -> int:
    return len(x) if isinstance(x, bytes) else 1


def _gather(*parts: Any) -> int:
    return len(parts)


def dask_part(part: str, ns: argparse.Namespace) -> dict[str, Any]:
    try:
        import dask
        from distributed import Client, LocalCluster
    except ImportError as exc:
        return {"excluded": f"not installed ({exc.name}); pip install -r bench/requirements.txt"}
    from peers import non_loopback_sockets

    with dask.config.set({"distributed.worker.daemon": False}), LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None,
        silence_logs=40, memory_limit=0,
    ) as cluster, Client(cluster) as client:
        client.submit(len, b"warm", pure=False).result()
        bad = non_loopback_sockets()
        if bad:
            return {"excluded": f"{len(bad)} sockets beyond 127.0.0.1, e.g. {bad[0]}"}
        setup = {"setup": "LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host=127.0.0.1)",
                 "version": dask.__version__}
        if part == "chain":
            return {**setup, **_dask_chain(client, ns.chain, ns.chain_mib * MIB)}
        if part == "fan":
            return {**setup, **_dask_fan(client, ns.fan)}
        return {**setup, **_dask_loss(client, cluster, ns.loss_chain)}


def _dask_chain(client: Any, length: int, size: int) -> dict[str, Any]:
    """The chain on Dask: the share of steps that ran on the worker holding their input (the task stream's
    worker of each step against its predecessor's); only the last future is held, as a pipeline would."""
    from distributed import get_task_stream, wait

    first = client.submit(_make, size, pure=False)
    wait(first)
    keys = [first.key]
    with get_task_stream(client) as stream:
        t0 = time.perf_counter()
        future = first
        for _ in range(length):
            future = client.submit(_pass_on, future, pure=False)
            keys.append(future.key)
        wait(future)
        wall = time.perf_counter() - t0
    where = {task["key"]: task["worker"] for task in stream.data}
    where[first.key] = next(iter(client.who_has(first)[first.key]), "")
    local = sum(1 for before, key in itertools.pairwise(keys) if where.get(key) == where.get(before))
    return {"wall_s": round(wall, 3), "raw_copy_s": _raw_copy_s(length, size),
            "on_holder_share": round(local / length, 3), "client_bytes": 0,
            "note": "bytes move worker to worker; the scheduler carries none"}


def _dask_fan(client: Any, fan: int) -> dict[str, Any]:
    from distributed import wait

    t0 = time.perf_counter()
    cpu0 = time.process_time()  # the scheduler runs in this process (LocalCluster)
    src = client.submit(_make, 100, pure=False)
    outs = [client.submit(_small, src, pure=False) for _ in range(fan)]
    sink = client.submit(_gather, *outs, pure=False)
    wait(sink)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    edges = 2 * fan
    return {"edges": edges, "wall_s": round(wall, 3), "us_per_edge": round(wall / edges * 1e6, 1),
            "control_cpu_us_per_edge": round(cpu / edges * 1e6, 1),
            "control_cpu_is": "the driver's process: client and scheduler"}


def _slow_pass(data: bytes) -> bytes:
    time.sleep(LOSS_PAUSE_S)
    return bytes(memoryview(data))


def _dask_loss(client: Any, cluster: Any, length: int) -> dict[str, Any]:
    """Kill -9 the worker holding the chain's middle output once it is made; count each step's runs."""
    from distributed import get_task_stream, wait

    mid = length // 2
    with get_task_stream(client) as stream:
        futures = [client.submit(_make, MIB, pure=False)]
        for _ in range(length):
            futures.append(client.submit(_slow_pass, futures[-1], pure=False))
        wait(futures[mid])
        victim = next(iter(client.who_has(futures[mid])[futures[mid].key]))
        os.kill(client.run(os.getpid)[victim], signal.SIGKILL)
        t0 = time.perf_counter()
        wait(futures[-1])
        after = time.perf_counter() - t0
    runs: dict[str, int] = {}
    for task in stream.data:
        runs[task["key"]] = runs.get(task["key"], 0) + 1
    per_step = [runs.get(future.key, 0) for future in futures]
    return {"completed": futures[-1].status == "finished", "after_kill_s": round(after, 2),
            "runs_per_step": per_step, "producer_runs": per_step[mid],
            "downstream_max_runs": max(per_step[mid + 1:], default=0),
            "note": "Dask recomputes lost keys from its graph (lineage) on the surviving worker"}


# ---------------------------------------------------------------------------- ray


def ray_part(part: str, ns: argparse.Namespace) -> dict[str, Any]:
    try:
        import ray
    except ImportError as exc:
        return {"excluded": f"not installed ({exc.name}); pip install -r bench/requirements.txt"}
    if part == "loss":
        return {"excluded": "one node: Ray's objects live in the node's shared store, not in the worker process that "
                            "made them, so killing that process loses nothing (a second node is not run here)"}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    size = ns.chain_mib * MIB
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, logging_level="ERROR",
             configure_logging=False, log_to_driver=False, object_store_memory=max(4 * size, 512 * MIB))
    try:
        bad = _beyond_loopback()
        if bad:
            return {"excluded": f"{len(bad)} sockets beyond 127.0.0.1, e.g. {bad[0]}"}
        setup = {"setup": f"ray.init(num_cpus=2) on 127.0.0.1{_ISOLATED if _only_loopback() else ''}",
                 "version": ray.__version__}
        if part == "chain":
            make, step = ray.remote(_make), ray.remote(_pass_on)
            ref = make.remote(size)
            ray.wait([ref])
            t0 = time.perf_counter()
            for _ in range(ns.chain):
                ref = step.remote(ref)
            ray.wait([ref])
            wall = time.perf_counter() - t0
            return {**setup, "wall_s": round(wall, 3), "raw_copy_s": _raw_copy_s(ns.chain, size),
                    "on_holder_share": 1.0, "note": "one node: every object is in the node's shared store"}
        make, small, gather = ray.remote(_make), ray.remote(_small), ray.remote(_gather)
        ray.get(small.remote(b"warm"))
        procs = _ray_control_processes()
        cpu0 = sum(h.cpu_seconds(pid) for pid in procs)
        t0 = time.perf_counter()
        src = make.remote(100)
        outs = [small.remote(src) for _ in range(ns.fan)]
        ray.get(gather.remote(*outs))
        wall = time.perf_counter() - t0
        cpu = sum(h.cpu_seconds(pid) for pid in procs) - cpu0
        edges = 2 * ns.fan
        return {**setup, "edges": edges, "wall_s": round(wall, 3), "us_per_edge": round(wall / edges * 1e6, 1),
                "control_cpu_us_per_edge": round(cpu / edges * 1e6, 1), "control_cpu_is": "gcs_server and raylet"}
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()


_ISOLATED = " in a network namespace of its own whose only interface is lo (unshare --net)"


def _only_loopback() -> bool:
    import psutil

    return set(psutil.net_if_addrs()) == {"lo"}


def _beyond_loopback() -> list[str]:
    """The sockets of this process tree bound or connected beyond loopback (bench/peers.py). Ray's GCS listens on
    every address; in a network namespace whose only interface is lo (the ray column's child runs in one where it
    can) such a listen reaches nothing but loopback, so it does not count there."""
    from peers import non_loopback_sockets

    bad = non_loopback_sockets()
    if _only_loopback():
        bad = [s for s in bad if not (s.endswith("(listen)") and s.split("] ", 1)[1].startswith(("0.0.0.0:", ":::")))]
    return bad


def _isolated(argv: list[str]) -> list[str]:
    """``argv`` run in a network namespace of its own with only lo up, where this host allows it (root, unshare)."""
    probe = ["unshare", "--net", "sh", "-c", "ip link set lo up"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode == 0:
            return [*probe[:-1], 'ip link set lo up && exec "$@"', "sh", *argv]
    return argv


def _ray_control_processes() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True)
            if any(name in p.name() for name in ("gcs_server", "raylet"))]


# ---------------------------------------------------------------------------- the run


def _raw_copy_s(length: int, size: int) -> float:
    """The same bytes copied ``length`` times in this process's memory: the floor of passing them on."""
    data = os.urandom(size)
    t0 = time.perf_counter()
    for _ in range(length):
        data = bytes(memoryview(data))
    return round(time.perf_counter() - t0, 3)


def run_column(column: str, part: str, ns: argparse.Namespace) -> dict[str, Any]:
    if column == "core":
        return core_fan(ns.fan) if part == "fan" else {"excluded": "the core column measures the fan part only"}
    if column == "fleetwire":
        return fleetwire_parts(part.split(","), ns)
    if column == "dask":
        return dask_part(part, ns)
    return ray_part(part, ns)


def child(column: str, part: str, ns: argparse.Namespace) -> dict[str, Any]:
    """One column of one part (fleetwire: of every part asked for) in a fresh process; its JSON result (or why it
    has none)."""
    python = ns.peer_python if column in ("dask", "ray") else sys.executable
    argv = [python, __file__, "--column", column, "--part", part, "--chain", str(ns.chain), "--chain-mib",
            str(ns.chain_mib), "--fan", str(ns.fan), "--loss-chain", str(ns.loss_chain)]
    if column == "ray":
        argv = _isolated(argv)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=h.bench_env(), cwd=h.ROOT,
                              timeout=ns.timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {ns.timeout_s:g} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)  # type: ignore[no-any-return]
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = []
    keys = {
        "chain": ("wall_s", "raw_copy_s", "raw_file_copy_s", "on_holder_share", "client_bytes", "coordinator_bytes"),
        "fan": ("edges", "us_per_edge", "cpu_us_per_edge", "control_cpu_us_per_edge"),
        "loss": ("completed", "after_kill_s", "producer_runs", "downstream_max_runs", "runs_per_step",
                 "starts_per_step"),
    }
    for part, columns in results.items():
        lines.append(f"== {part}")
        for column, figures in columns.items():
            why = figures.get("excluded") or figures.get("error")
            if why:
                lines.append(f"  {column:<10} excluded: {why}")
                continue
            cells = "  ".join(f"{key}={figures[key]}" for key in keys[part] if key in figures)
            lines.append(f"  {column:<10} {cells}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: chain, fan, loss")
    parser.add_argument("--columns", default=",".join(COLUMNS), help="comma-separated: core, fleetwire, dask, ray")
    parser.add_argument("--chain", type=int, default=10, help="plans in the chain (default 10)")
    parser.add_argument("--chain-mib", type=int, default=256, help="bytes each passes on, MiB (default 256)")
    parser.add_argument("--fan", type=int, default=1000, help="consumers in the fan (default 1000)")
    parser.add_argument("--loss-chain", type=int, default=6, help="plans in the loss part's chain (default 6)")
    parser.add_argument("--peer-python", default=sys.executable, help="the Python that runs the Ray and Dask columns")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="per child process: a peer's column and part, or fleetwire's parts (default 600)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--column", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.column:  # a child: one column of one part
        print(json.dumps(run_column(ns.column, ns.part, ns)), flush=True)
        return 0
    parts, columns = [part for part in PARTS if part in ns.parts.split(",")], ns.columns.split(",")
    unknown = sorted(set(ns.parts.split(",")) - set(PARTS)) + sorted(set(columns) - set(COLUMNS))
    if unknown:
        parser.error(f"no part or column {unknown[0]!r}: parts are {', '.join(PARTS)}; columns {', '.join(COLUMNS)}")
    fleet = child("fleetwire", ",".join(parts), ns) if "fleetwire" in columns else {}
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for part in parts:
        results[part] = {column: fleet.get("parts", {}).get(part, fleet) if column == "fleetwire"
                         else child(column, part, ns) for column in columns}  # fmt: skip
    result = {"bench": "graphs", "machine": h.machine(), "chain": ns.chain, "chain_mib": ns.chain_mib,
              "fan": ns.fan, "results": results}
    h.emit(result, ns.json, table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
