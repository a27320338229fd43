"""End to end: `fleetwire submit --pool NAME` runs on the workers started with `fleetwire worker --pool NAME`."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


async def test_submit_pool_runs_on_the_workers_of_that_pool(cluster: Cluster) -> None:
    """A worker started with --pool cpu (tag pool:cpu) runs a plan submitted with --pool cpu; its result is printed."""
    await cluster.coordinator()
    await cluster.worker("w1", "--pool", "cpu")
    submit = await cluster.run("submit", "echo", "--args", '{"via": "pool"}', "--pool", "cpu")
    assert await submit.wait(60) == 0, submit.lines
    assert any('"via"' in line and '"pool"' in line for line in submit.lines), submit.lines
