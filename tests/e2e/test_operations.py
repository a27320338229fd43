"""Operator commands as a person runs them: drain, undrain, plans, workers, completion, unreachable errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import ADMIN_TOKEN, Cluster
from tests.e2e.module_fleet import ON_THE_FLEETS_LOOP, module_fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# One coordinator and worker w1 for the drain tests (tests/e2e/module_fleet.py): the first undrains what it
# drained and submits the only plan; the other two change nothing.
fleet = module_fleet()


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fleetwire", *args]


@ON_THE_FLEETS_LOOP
async def test_drain_holds_new_plans_until_undrain(fleet: Cluster) -> None:
    """`fleetwire drain` makes `workers` show draining and new plans wait; `undrain` lets them run."""
    admin = fleet.env(FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN)  # drain/undrain take it over FLEETWIRE_TOKEN
    drain = await fleet.run("drain", "w1", "--deadline", "60", env=admin)
    assert await drain.wait() == 0
    assert drain.lines == ["worker w1 draining: no new plans; its running plans have 60 s before they are requeued"]

    workers = await fleet.run("workers")
    assert await workers.wait() == 0
    row = next(line for line in workers.lines if line.startswith("w1 "))
    assert "alive, draining" in row
    assert "STATE" in workers.lines[0] and "LAST BEAT" in workers.lines[0]

    submit = await fleet.run("submit", "echo", "--args", "7", "--json")
    plan_id = json.loads((await submit.wait_for_line(r'"state":"queued"')).string)["plan_id"]
    plans = await fleet.run("plans", "--state", "queued", "--json")
    assert await plans.wait() == 0
    listing = json.loads(plans.lines[-1])
    assert listing["queue"] == [plan_id]
    assert listing["plans"][0]["waiting_reason"] == "the only matching worker (w1) is draining"

    undrain = await fleet.run("undrain", "w1", "--json", env=admin)
    assert await undrain.wait() == 0
    assert json.loads(undrain.lines[-1]) == {"worker_id": "w1", "draining": False}
    assert await submit.wait() == 0
    final = json.loads(submit.lines[-1])
    # No NVML, --power-watts or --uj-per-token here: nothing measured the plan, so it has no receipt.
    assert final == {"plan_id": plan_id, "state": "succeeded", "result": 7}

    table = await fleet.run("plans")
    assert await table.wait() == 0
    assert table.lines[0].split()[:3] == ["ID", "OP", "STATE"]
    assert any(plan_id in line and "succeeded" in line for line in table.lines)
    assert table.lines[-1].startswith("1 of 1 plans shown; all: 1 succeeded")


@ON_THE_FLEETS_LOOP
async def test_drain_of_an_unknown_worker_fails_with_the_known_ids(fleet: Cluster) -> None:
    """Draining a worker id that is not registered exits 1 and names the ids that are."""
    proc = await asyncio.create_subprocess_exec(
        *_cli("drain", "nope"), env=fleet.env(FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, err = await proc.communicate()
    assert proc.returncode == 1
    assert "no worker with id 'nope' (registered: w1)" in err.decode()


@ON_THE_FLEETS_LOOP
async def test_drain_with_a_client_token_is_refused_and_drains_nothing(fleet: Cluster) -> None:
    """`fleetwire drain` with only a client token exits 1, saying an admin token is needed; nothing is drained."""
    proc = await asyncio.create_subprocess_exec(
        *_cli("drain", "w1"), env=fleet.env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 1
    assert "needs an admin token" in err.decode() and "[forbidden]" in err.decode()
    workers = await fleet.run("workers", "--json")
    assert await workers.wait() == 0
    rows = json.loads(workers.lines[-1])["workers"]
    assert [(row["id"], row.get("draining", False)) for row in rows] == [("w1", False)]  # false is omitted


def test_unreachable_coordinator_names_the_url_and_what_to_check() -> None:
    """A client command against a closed port exits 1, naming the URL it tried and what to check."""
    proc = subprocess.run(_cli("workers", "--url", "ws://127.0.0.1:9", "--token", "t"), capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 1
    assert "tried: ws://127.0.0.1:9" in proc.stderr and "check: the coordinator is running" in proc.stderr


def test_bash_completion_script_is_valid_bash_and_knows_the_commands() -> None:
    """`fleetwire completion bash` prints a script bash accepts, completing the subcommands and their flags."""
    proc = subprocess.run(_cli("completion", "bash"), capture_output=True, text=True, timeout=30, check=True)
    script = proc.stdout
    for word in ("drain", "undrain", "workers", "submit", "--deadline", "--follow"):
        assert word in script, word
    subprocess.run(["bash", "-n"], input=script, text=True, check=True, timeout=30)
