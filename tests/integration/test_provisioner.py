"""The provisioner (coordinator/io/ops/provision.py) on a fake clock: backoff, real commands and real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import uvloop

from coordinator.autoscaler import Backoff, PoolNeeds
from coordinator.io.ops.provision import CommandProvider, LocalProvider, ProviderError, Provisioner
from tests.waiting import alive, until

pytestmark = pytest.mark.timeout(30)


class FlakyProvider:
    """A provider that fails its first ``failures`` starts (an in-memory stand-in for the pure retry rule)."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.started: list[list[str]] = []

    async def start(self, pool: str, worker_ids: Sequence[str], needs: PoolNeeds) -> None:
        if self.failures:
            self.failures -= 1
            raise ProviderError("cloud says no")
        self.started.append(list(worker_ids))

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_provisioner_retries_a_failing_provider_with_backoff_and_reports_it() -> None:
    """Failed starts are counted, told to admins, and retried only once the backoff (fake clock) allows."""
    clock = [0.0]
    notes: list[dict[str, Any]] = []
    provider = FlakyProvider(failures=2)
    prov = Provisioner(provider, registry={}, plans={}, max_workers=4, notify=notes.append,
                       backoff=Backoff(base_s=10, cap_s=60), clock=lambda: clock[0])

    async def settle() -> None:
        await prov.settled()

    prov.decided([{"pool": "op=echo", "action": "scale_up", "desired": 2, "alive": 0}])
    await settle()
    assert prov.status.failures == 1 and notes[-1]["action"] == "provider_failed"
    prov.step()  # backoff: not before t=10
    await settle()
    assert prov.status.failures == 1
    clock[0] = 10.0
    prov.step()
    await settle()
    assert prov.status.failures == 2
    clock[0] = 29.0  # second wait is 20 s
    prov.step()
    await settle()
    assert provider.started == []
    clock[0] = 30.0
    prov.step()
    await settle()
    assert len(provider.started) == 1 and len(provider.started[0]) == 2
    assert prov.status.workers["starting"] == 2


async def test_command_provider_passes_pool_count_and_ids_and_fails_on_nonzero() -> None:
    """The start command sees FLEETWIRE_POOL/COUNT/WORKER_IDS; a non-zero exit raises ProviderError with its output."""
    show = f"{sys.executable} -c \"import os; print(os.environ['FLEETWIRE_POOL'], os.environ['FLEETWIRE_COUNT'], " \
           "os.environ['FLEETWIRE_WORKER_IDS']); raise SystemExit(3)\""
    provider = CommandProvider(show, None, timeout_s=30)
    with pytest.raises(ProviderError, match=r"status 3: op=echo 2 auto-1 auto-2"):
        await provider.start("op=echo", ["auto-1", "auto-2"], PoolNeeds())
    await provider.stop("op=echo", ["auto-1"])  # no stop command: nothing to do


async def test_a_local_worker_that_exits_on_its_own_is_replaced_after_the_backoff() -> None:
    """A real local worker process that dies is counted as a provider failure and started again after the backoff."""
    clock = [0.0]
    provider = LocalProvider(lambda worker_id, needs: [sys.executable, "-c", "raise SystemExit(1)"], {})
    prov = Provisioner(provider, registry={}, plans={}, max_workers=2, backoff=Backoff(base_s=10),
                       clock=lambda: clock[0])
    prov.decided([{"pool": "op=echo", "action": "scale_up", "desired": 1, "alive": 0}])
    await prov.settled()
    await provider.procs["auto-1"].wait()
    prov.step()
    assert prov.status.failures == 1 and "auto-1 exited on its own" in prov.status.last_error
    assert "auto-2" not in provider.procs  # the backoff holds the replacement
    clock[0] = 10.0
    prov.step()
    await prov.settled()
    assert "auto-2" in provider.procs
    await prov.close()
    assert provider.procs == {}


GPU_POOL = PoolNeeds(op="train", tags=("cpu", "pool:cpu"), accelerator="gpu", model="llama", gpus=2)


async def test_a_start_command_that_leaves_its_worker_running_succeeds_as_soon_as_it_exits(tmp_path: Path) -> None:
    """`worker &` keeps the command's output pipe open: the start is still done when the command exits 0."""
    pid_file = tmp_path / "pid"
    provider = CommandProvider(f"sleep 60 & echo $! > {pid_file}; echo started", None, timeout_s=20)
    began = time.monotonic()
    await provider.start("op=echo", ["auto-1"], PoolNeeds())
    took = time.monotonic() - began
    pid = int(pid_file.read_text())
    try:
        assert took < 5, f"the start waited {took:.1f} s for a pipe its worker holds"
        assert alive(pid)  # detached, not killed with the command
    finally:
        os.kill(pid, signal.SIGKILL)


async def test_a_start_command_is_told_what_the_pool_needs(tmp_path: Path) -> None:
    """FLEETWIRE_TAGS, FLEETWIRE_ACCELERATOR, FLEETWIRE_MODEL, FLEETWIRE_GPUS and the FLEETWIRE_NEEDS JSON."""
    out = tmp_path / "env.json"
    names = ["FLEETWIRE_TAGS", "FLEETWIRE_ACCELERATOR", "FLEETWIRE_MODEL", "FLEETWIRE_GPUS", "FLEETWIRE_NEEDS"]
    script = f"import json, os; json.dump({{n: os.environ[n] for n in {names!r}}}, open({str(out)!r}, 'w'))"
    provider = CommandProvider(f"{sys.executable} -c \"{script}\"", None, timeout_s=30)
    await provider.start("op=train tags=cpu,pool:cpu", ["auto-1"], GPU_POOL)
    seen = json.loads(out.read_text())
    assert (seen["FLEETWIRE_TAGS"], seen["FLEETWIRE_ACCELERATOR"], seen["FLEETWIRE_MODEL"], seen["FLEETWIRE_GPUS"]) == (
        "cpu,pool:cpu", "gpu", "llama", "2")
    assert PoolNeeds.from_dict(json.loads(seen["FLEETWIRE_NEEDS"])) == GPU_POOL


def test_a_command_gets_no_descriptor_of_the_coordinator_and_a_session_of_its_own(tmp_path: Path) -> None:
    """Under uvloop (the CLI's loop), with a listening server: the command has only fds 0-2, in its own session."""
    out = tmp_path / "seen.json"
    script = (f"import json, os; json.dump([os.getsid(0), sorted(int(f) for f in os.listdir('/proc/self/fd'))], "
              f"open({str(out)!r}, 'w'))")

    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        try:
            await CommandProvider(f"{sys.executable} -c \"{script}\"", None, timeout_s=30).start(
                "op=echo", ["auto-1"], PoolNeeds())
        finally:
            server.close()
            await server.wait_closed()

    uvloop.run(main())
    sid, fds = json.loads(out.read_text())
    assert sid != os.getsid(0)
    assert set(fds) <= {0, 1, 2, 3}, fds  # 3: the listing's own directory handle (and the json file's, closed)


async def test_a_start_command_past_its_timeout_is_killed_with_its_process_group(tmp_path: Path) -> None:
    """It fails naming the timeout, and what it started in the background dies with it."""
    pid_file = tmp_path / "pid"
    provider = CommandProvider(f"sleep 60 & echo $! > {pid_file}; sleep 60", None, timeout_s=1)
    began = time.monotonic()
    with pytest.raises(ProviderError, match=r"start command ran past 1 s and was killed"):
        await provider.start("op=echo", ["auto-1"], PoolNeeds())
    assert time.monotonic() - began < 10
    pid = int(pid_file.read_text())
    await until(lambda: not alive(pid), timeout_s=10)


class GatedProvider:
    """Starts of pool "slow" wait for ``gate``; every call is recorded (the rule under test is the provisioner's)."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.calls: list[tuple[str, str, list[str], PoolNeeds | None]] = []

    async def start(self, pool: str, worker_ids: Sequence[str], needs: PoolNeeds) -> None:
        self.calls.append(("start", pool, list(worker_ids), needs))
        if pool == "slow":
            await self.gate.wait()

    async def stop(self, pool: str, worker_ids: Sequence[str]) -> None:
        self.calls.append(("stop", pool, list(worker_ids), None))

    async def close(self) -> None:
        pass


async def test_a_slow_start_holds_up_neither_a_stop_nor_a_start_for_another_pool() -> None:
    """While pool "slow"'s start is in flight, a drained worker is stopped and pool "fast" gets its workers."""
    provider = GatedProvider()
    prov = Provisioner(provider, registry={}, plans={}, max_workers=8, clock=lambda: 0.0)
    prov.decided([{"pool": "slow", "action": "scale_up", "desired": 1, "alive": 0}])
    prov.decided([{"pool": "fast", "action": "scale_up", "desired": 2, "alive": 0,
                   "needs": {"op": "train", "tags": ["cpu", "pool:cpu"], "accelerator": "gpu", "model": "llama",
                             "gpus": 2}},
                  {"pool": "old", "action": "scale_down", "workers": ["w-9"]}])
    await until(lambda: len(provider.calls) == 3, timeout_s=10)
    assert not provider.gate.is_set()  # the slow start still runs
    assert sorted(c[:3] for c in provider.calls) == [
        ("start", "fast", ["auto-2", "auto-3"]), ("start", "slow", ["auto-1"]), ("stop", "old", ["w-9"])]
    assert next(c[3] for c in provider.calls if c[1] == "fast") == GPU_POOL
    prov.decided([{"pool": "slow", "action": "scale_up", "desired": 2, "alive": 0}])  # waits for the one in flight
    assert len(provider.calls) == 3
    provider.gate.set()
    await prov.settled()
    prov.step()
    await prov.settled()
    assert provider.calls[-1][:3] == ("start", "slow", ["auto-4"])
