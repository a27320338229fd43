"""The worker's data endpoint alone: one input up and one output down, and the CPU each side spends.

    python bench/data_endpoint.py                        # 1 GiB, 2 rounds, files in a temporary directory
    python bench/data_endpoint.py --size 64M --rounds 3 --dir /dev/shm --json

No coordinator and no plan: a ``DataServer`` (worker_agent/dataplane.py) runs in a child process
of its own with a spool under ``--dir``; this process signs the tickets and plays the client with
the SDK's ``DirectTransport`` (fleetwire/direct.py): the input is a file (``sendfile``), the output
is written to a file through ``download_to`` with its digest checked. Each round reports MB/s
(10^6 bytes per second) and the CPU seconds (user + system) of the server process and of this
one during the transfer. On a shared machine the CPU seconds are the steadier figure: they say
what the path costs, MB/s says what the machine gave it. bench/data_plane.py measures the whole
path (coordinator, worker, plan) beside the websocket ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from protocol.messages import DataKey
from protocol.tickets import FileClaim, TicketClaims, sign, worker_key

MASTER = b"b" * 32
WORKER = "bench"


def _cpu() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


async def serve(spool_dir: str, output_path: str) -> None:
    """The child: a data endpoint with ``output_path`` as output ``out`` of plan p1 attempt 1; answers CPU asks."""
    from worker_agent.dataplane import DataServer
    from worker_agent.spool import Spool

    spool = Spool(spool_dir)
    server = DataServer(spool, worker_id=WORKER)
    server.set_keys([DataKey(kid="k1", key=worker_key(MASTER, WORKER))])
    await server.start()
    output = spool.add_output("p1", 1, "out", output_path)
    print(json.dumps({"port": server.port, "digest": output.digest}), flush=True)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):  # one line in, this process's CPU out
        print(json.dumps(_cpu()), flush=True)
    await server.close()
    spool.close()


def _ticket(direction: str, name: str, size: int, digest: str, attempt: int) -> str:
    claims = TicketClaims("p1", attempt, WORKER, direction, {name: FileClaim(size, digest)},  # type: ignore[arg-type]
                          time.time() + 600)
    return sign(claims, "k1", worker_key(MASTER, WORKER))


def _start_server(work: Path, path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--serve", str(work / "spool"), "--file", str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


async def run(path: Path, size: int, work: Path, rounds: int) -> list[dict[str, Any]]:
    from fleetwire.data import Grant, OutputCheck
    from fleetwire.direct import DirectTransport
    from fleetwire.inputs import prepare_inputs

    child = _start_server(work, path)
    assert child.stdin is not None and child.stdout is not None
    try:
        line = child.stdout.readline()
        while not line.startswith("{"):  # the endpoint's log lines come first
            line = child.stdout.readline()
        info = json.loads(line)
        url = f"http://127.0.0.1:{info['port']}"

        def server_cpu() -> tuple[float, float]:
            assert child.stdin is not None and child.stdout is not None
            child.stdin.write("cpu\n")
            child.stdin.flush()
            return tuple(json.loads(child.stdout.readline()))  # type: ignore[return-value]

        source = (await prepare_inputs({"in": path}))["in"]
        transport = DirectTransport()
        results = []
        for attempt in range(2, rounds + 2):
            figures: dict[str, Any] = {"round": attempt - 1}
            grant = Grant("p1", attempt, url, _ticket("put", "in", size, source.digest, attempt))
            get = _ticket("get", "out", size, info["digest"], 1)
            target = work / "out.bin"
            for direction in ("in", "out"):
                s0, c0, t0 = server_cpu(), _cpu(), time.perf_counter()
                if direction == "in":
                    await transport.upload(grant, source)
                else:
                    await transport.download_to(Grant("p1", 1, url, get, get), "out", target,
                                                OutputCheck("out", info["digest"]))
                elapsed = time.perf_counter() - t0
                s1, c1 = server_cpu(), _cpu()
                figures[direction] = {
                    "mb_s": round(size / elapsed / 1e6, 1), "s": round(elapsed, 3),
                    "server_cpu_s": round(s1[0] - s0[0] + s1[1] - s0[1], 3),
                    "client_cpu_s": round(c1[0] - c0[0] + c1[1] - c0[1], 3),
                }
            target.unlink()
            results.append(figures)
        await transport.aclose()
        return results
    finally:
        child.stdin.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1G", help="bytes moved each way (K, M, G: binary), default 1G")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each one input up and one output down")
    parser.add_argument("--dir", help="where the file, the spool and the download go (default: a temporary dir)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--file", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.serve:
        asyncio.run(serve(ns.serve, ns.file))
        return 0
    size = parse_size(ns.size)
    with tempfile.TemporaryDirectory(prefix="fw-endpoint-bench-", dir=ns.dir) as tmp:
        work = Path(tmp)
        path = work / "input.bin"
        block = bytearray(os.urandom(8 << 20))
        with open(path, "wb") as out:
            for n, start in enumerate(range(0, size, len(block))):
                block[:8] = n.to_bytes(8, "little")
                out.write(block[: min(len(block), size - start)])
        results = asyncio.run(run(path, size, work, ns.rounds))
    if ns.json:
        print(json.dumps({"bench": "data_endpoint", "size": size, "rounds": results}))
        return 0
    print(f"data endpoint, {size / (1 << 20):g} MiB each way, load {os.getloadavg()[0]:.1f}")
    print(f"{'round':>5} {'dir':>3} {'MB/s':>7} {'s':>7} {'server cpu s':>12} {'client cpu s':>12}")
    for figures in results:
        for direction in ("in", "out"):
            f = figures[direction]
            print(f"{figures['round']:>5} {direction:>3} {f['mb_s']:>7.0f} {f['s']:>7.2f} {f['server_cpu_s']:>12.2f} "
                  f"{f['client_cpu_s']:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
