"""End to end: energy and carbon receipts through the CLI (real coordinator, worker and client processes)."""

from __future__ import annotations

import json
import re

import pytest

from tests.e2e.conftest import ADMIN_TOKEN, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_submit_follow_shows_the_receipt_and_plans_by_principal_sums_it(cluster: Cluster) -> None:
    """`submit --follow` prints one energy line (estimated on a host without NVML) and `--json` carries the
    receipt; `plans --since 1h --by principal` sums the finished plans' joules and gCO2e."""
    await cluster.coordinator()
    await cluster.worker("w1", "--power-watts", "40", "--carbon-zone", "FR")

    # The two CLIs run side by side (each is mostly its process's start).
    submit = await cluster.run("submit", "echo", "--args", '{"n": 1}', "--follow")
    submit_json = await cluster.run("submit", "echo", "--args", "2", "--follow", "--json")
    assert await submit.wait() == 0
    line = next(line for line in submit.lines if line.startswith("energy "))
    assert re.fullmatch(r"energy \d+\.\d J \(estimated\), [0-9.e-]+ gCO2e", line), line
    assert json.loads(submit.lines[-1]) == {"n": 1}  # the result stays the last line

    assert await submit_json.wait() == 0
    final = json.loads(submit_json.lines[-1])
    receipt = final["receipt"]
    assert final["state"] == "succeeded" and receipt["estimated"] is True and receipt["source"] == "power_model"
    assert receipt["intensity_g_per_kwh"] == 56.0  # FR in the built-in table

    plans = await cluster.run("plans", "--since", "1h", "--by", "principal", "--json",
                              env=cluster.env(FLEETWIRE_TOKEN=ADMIN_TOKEN))  # fmt: skip
    assert await plans.wait() == 0
    rows = json.loads(plans.lines[-1])["rows"]
    assert len(rows) == 1 and rows[0]["plans"] == 2 and rows[0]["estimated"] == 2 and rows[0]["no_receipt"] == 0
    assert rows[0]["joules"] >= receipt["joules"]
