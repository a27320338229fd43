"""One real fleet (a coordinator and one worker) for the tests of a module that need the same one.

Each e2e test used to start its own coordinator and worker: two interpreter starts (~1.7 s quiet) per test,
though several tests of a file only submit their own plans to the same fleet and look at nothing else. Such
a file declares the fleet once; its tests take it as ``fleet`` and run on the module's event loop::

    fleet = module_fleet("--allow-shell", "--data-listen", "127.0.0.1:0")

    @ON_THE_FLEETS_LOOP
    async def test_something(fleet: Cluster) -> None: ...

Only for tests that read nothing of the fleet's state beyond their own plans (no plan counts, no worker
kills, no drains left behind); the others keep the ``cluster`` fixture and a fleet of their own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from tests.e2e.conftest import Cluster

# The fleet's processes are read by tasks of the module's event loop: its tests run on that loop.
ON_THE_FLEETS_LOOP = pytest.mark.asyncio(loop_scope="module")


def module_fleet(*worker_args: str, coordinator_args: tuple[str, ...] = ()) -> Callable[..., Any]:
    """A module-scoped fixture: a coordinator (``coordinator_args``) and worker ``w1`` (``worker_args``)."""

    @pytest_asyncio.fixture(scope="module", loop_scope="module")
    async def fleet() -> AsyncIterator[Cluster]:
        cluster = Cluster()
        try:
            await cluster.coordinator(*coordinator_args)
            await cluster.worker("w1", *worker_args)
            yield cluster
        finally:
            await cluster.close()

    return fleet
