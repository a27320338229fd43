"""End to end: real coordinator, worker and client processes started through the CLI."""

from __future__ import annotations

import json
import signal

import pytest

from tests.e2e.conftest import Cluster
from tests.e2e.module_fleet import ON_THE_FLEETS_LOOP, module_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# One coordinator and worker w1 for the cancel and failed-plan tests (tests/e2e/module_fleet.py): each looks
# only at its own plan.
fleet = module_fleet("--allow-shell")


async def test_up_submit_follow_workers(cluster: Cluster) -> None:
    """`fleetwire up` prints export lines that let `submit --follow` and `workers` work from another shell."""
    up = await cluster.run("up", "--port", "0", "--workers", "2", name="up")
    url = (await up.wait_for_line(r"export FLEETWIRE_URL=(\S+)")).group(1)
    token = (await up.wait_for_line(r"export FLEETWIRE_TOKEN=(\S+)")).group(1)
    await up.wait_for_line("Press Ctrl-C")
    env = cluster.env(FLEETWIRE_URL=url, FLEETWIRE_TOKEN=token)

    submit = await cluster.run("submit", "echo", "--args", '{"hello": 1}', "--follow", env=env)
    assert await submit.wait() == 0
    out = submit.lines
    assert out[0].startswith("plan ") and out[0].endswith(" submitted")
    assert any("] queued" in line for line in out)
    assert any("] succeeded" in line for line in out)
    assert out[-2].startswith("energy unknown (no receipt")  # these workers measure nothing: no receipt sent
    assert json.loads(out[-1]) == {"hello": 1}

    workers = await cluster.run("workers", env=env)
    assert await workers.wait() == 0
    table = "\n".join(workers.lines)
    assert "local-1" in table and "local-2" in table and "LAST BEAT" in table
    assert workers.lines[-1].startswith("2 workers (")

    up.stop(signal.SIGINT)
    assert await up.wait(30) == 0


@ON_THE_FLEETS_LOOP
async def test_submit_then_cancel(fleet: Cluster) -> None:
    """A long plan cancelled from another process ends cancelled; submit exits 3, cancel exits 0."""
    submit = await fleet.run("submit", "sleep", "--args", '{"seconds": 30}')
    plan_id = (await submit.wait_for_line(r"plan (\S+) submitted")).group(1)
    cancel = await fleet.run("cancel", plan_id)
    assert await cancel.wait() == 0
    assert cancel.lines == [f"plan {plan_id} cancelled"]
    assert await submit.wait() == 3


@ON_THE_FLEETS_LOOP
async def test_failed_plan_exit_status_and_json(fleet: Cluster) -> None:
    """A shell plan exiting non-zero streams its stdout, fails with handler_error, and submit exits 1."""
    submit = await fleet.run("submit", "shell", "--args", '{"cmd": "echo hi; exit 3"}', "--follow", "--json")
    assert await submit.wait() == 1
    lines = [json.loads(line) for line in submit.lines]
    assert any(line.get("kind") == "stdout" and line.get("data") == "hi" for line in lines)
    assert lines[-1]["state"] == "failed" and lines[-1]["error"]["code"] == "handler_error"


async def test_kill_9_worker_plan_completes_elsewhere(cluster: Cluster) -> None:
    """kill -9 of the worker running a plan: it stops being alive, the plan is requeued and finishes on another."""
    await cluster.coordinator("--heartbeat-interval", "0.3", "--heartbeat-timeout", "1.2",
                              "--worker-reconnect-grace-s", "1")  # fmt: skip
    doomed = await cluster.worker("doomed", "--max-concurrency", "1")
    submit = await cluster.run("submit", "sleep", "--args", '{"seconds": 1}', "--follow", "--json")
    running = await submit.wait_for_line(r'"kind":"running"')
    assert '"worker_id":"doomed"' in running.string
    # Killed before the survivor starts: on a loaded machine that start outlasted the 1 s plan (it succeeded).
    doomed.stop(signal.SIGKILL)
    await cluster.worker("survivor", "--max-concurrency", "1")
    requeued = json.loads((await submit.wait_for_line(r'"kind":"requeued"')).string)
    assert requeued["data"]["attempt"] == 2
    workers = await cluster.run("workers", "--json")
    assert await workers.wait() == 0
    rows = {w["id"]: w for w in json.loads(workers.lines[-1])["workers"]}
    assert "doomed" not in rows or not rows["doomed"]["alive"]

    leased = json.loads((await submit.wait_for_line(r'"kind":"leased"')).string)
    assert leased["data"]["worker_id"] == "survivor"
    assert await submit.wait() == 0
    assert json.loads(submit.lines[-1])["state"] == "succeeded"


async def test_coordinator_refuses_to_start_without_tokens(cluster: Cluster) -> None:
    """Without tokens or --insecure the coordinator exits 2 with a message saying what to set."""
    proc = await cluster.run("coordinator", "--port", "0", env=cluster.env())
    assert await proc.wait() == 2
