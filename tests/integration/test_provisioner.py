"""The provisioner (coordinator/io/provision.py) on a fake clock: backoff, real commands and real processes."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import pytest

from coordinator.autoscaler import Backoff
from coordinator.io.provision import CommandProvider, LocalProvider, ProviderError, Provisioner

pytestmark = pytest.mark.timeout(30)


class FlakyProvider:
    """A provider that fails its first ``failures`` starts (an in-memory stand-in for the pure retry rule)."""

    name = "flaky"

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.started: list[list[str]] = []

    async def start(self, pool: str, worker_ids: Sequence[str]) -> None:
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
        await provider.start("op=echo", ["auto-1", "auto-2"])
    await provider.stop("op=echo", ["auto-1"])  # no stop command: nothing to do


async def test_a_local_worker_that_exits_on_its_own_is_replaced_after_the_backoff() -> None:
    """A real local worker process that dies is counted as a provider failure and started again after the backoff."""
    clock = [0.0]
    provider = LocalProvider(lambda worker_id: [sys.executable, "-c", "raise SystemExit(1)"], {})
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
