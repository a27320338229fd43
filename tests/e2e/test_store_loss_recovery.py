"""A real coordinator loses its store's tail and every acknowledged plan still ends with its result
(docs/SEMANTICS.md §Recovery from clients and workers).

An SDK client has 300 plans acknowledged (in 30 group commits), the coordinator is killed -9, its
``-wal`` is cut (the acknowledged tail is gone), and it is started again on the same port with
``--accept-store-loss``. The client stays up across it: it resubmits the plans the coordinator lost,
a worker runs them all, and ``/metrics`` counts the recovered ones.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import IO

import pytest

from coordinator.io.stores.store import DB_FILE
from fleetwire import Client

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


class Process:
    """A ``python -m fleetwire ...`` process whose stderr goes to a file (a full pipe would stall it)."""

    def __init__(self, log: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWIRE_")}
        self.log = log
        self._err: IO[str] = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwire", *args], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=self._err, text=True,
        )  # fmt: skip

    def listening(self) -> str:
        """The ws:// URL a coordinator prints once it listens."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (ws://\S+)", line)
        assert m, (line, self.log.read_text())
        return m.group(1)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=15)
        self._err.close()


def coordinator(data_dir: Path, log: Path, *extra: str) -> tuple[Process, str]:
    proc = Process(log, "coordinator", "--insecure", "--data-dir", str(data_dir), "--log-format", "json", *extra)
    return proc, proc.listening()


def metric(http_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


async def test_a_lost_store_tail_still_gives_every_acknowledged_plan_its_result(tmp_path: Path) -> None:
    """kill -9, the -wal cut, --accept-store-loss: the SDK resubmits the acknowledged plans the coordinator
    lost, each ends with its own result exactly once, and /metrics counts the resubmitted ones."""
    data_dir = tmp_path / "data"
    first, url = coordinator(data_dir, tmp_path / "first.log", "--port", "0")
    port = url.rsplit(":", 1)[1]
    procs = [first]
    try:
        async with Client(url, reconnect_base_s=0.05, reconnect_cap_s=0.3, reconnect_give_up_s=60) as client:
            plans = []
            for i in range(30):  # one group commit each: the cut takes the later ones
                plans += await client.submit_many("echo", [{"n": 10 * i + j} for j in range(10)])
            first.stop(signal.SIGKILL)
            wal = data_dir / (DB_FILE + "-wal")
            os.truncate(wal, int(wal.stat().st_size * 0.3))
            second, _ = coordinator(data_dir, tmp_path / "second.log", "--port", port, "--accept-store-loss")
            procs.append(second)
            worker = Process(tmp_path / "worker.log", "worker", "--url", url, "--id", "w1", "--max-concurrency", "50",
                             "--reconnect-base", "0.05", "--reconnect-cap", "0.3")  # fmt: skip
            procs.append(worker)
            async with asyncio.timeout(60):
                results = await asyncio.gather(*(plan.result() for plan in plans))
            recovered = [plan for plan in plans if plan.recovered]
            events = [[event async for event in plan.events()] for plan in recovered]
        assert results == [{"n": n} for n in range(300)]
        assert 0 < len(recovered) < 300, len(recovered)  # the cut took some, not all
        for plan_events in events:
            marker = [e for e in plan_events if e.kind == "recovered"]
            assert len(marker) == 1 and "resubmitted by the client" in marker[0].data["reason"]
            assert [e.kind for e in plan_events].count("succeeded") == 1
        http = url.replace("ws://", "http://")
        assert metric(http, "fleetwire_plans_recovered_from_client_total") == len(recovered)
        assert metric(http, "fleetwire_store_loss_accepted_total") >= 1
    finally:
        for proc in reversed(procs):
            proc.stop()
    assert "plan recovered from its client" in (tmp_path / "second.log").read_text()
