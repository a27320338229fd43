"""Shared fleets end to end (issue #27's done-when): two client tokens of two teams, one worker of 2 slots.

Real processes through the CLI: a coordinator with a token file naming alice (team ml) and bob (team web),
one worker of 2 slots. Alice floods; bob's handful ends within a few plan lengths of his submit. Alice
holds every slot with preemptible plans; bob's plan does not wait past the preemption grace. ``fleetwire
usage --json`` shows both (an admin token), or only bob (bob's token).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import pytest

from fleetwire import Client
from fleetwire.plan import Plan
from tests.e2e.conftest import ADMIN_TOKEN, Cluster
from tests.waiting import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef0"
PLAN_S = 0.5  # one flood plan's length
GRACE_S = 3.0


def token_file(directory: Path) -> Path:
    path = directory / "tokens.toml"
    entries = [("alice", ALICE, "ml"), ("bob", BOB, "web")]
    text = "".join(
        f'[[token]]\nname = "{name}"\nrole = "client"\nteam = "{team}"\n'
        f'hash = "sha256:{hashlib.sha256(token.encode()).hexdigest()}"\n\n'
        for name, token, team in entries
    )
    path.write_text(text)
    return path


async def kinds_of(plan: Plan, into: list[str]) -> None:
    """Collect the plan's event kinds until it ends."""
    async for event in plan.events():
        into.append(event.kind)


async def usage_json(cluster: Cluster, token: str) -> dict[str, dict[str, object]]:
    proc = await cluster.run("usage", "--json", "--token", token, name="usage")
    assert await proc.wait(60) == 0
    doc = json.loads(proc.lines[-1])
    return {row["name"]: row for row in doc["rows"]}


async def test_two_teams_share_one_worker(cluster: Cluster) -> None:
    """A trickle is served within a few plan lengths of a flood; preemptible plans yield within the grace;
    the usage ledger shows both principals to an admin and only its own to a client."""
    tokens = token_file(Path(cluster.data_dir))
    await cluster.coordinator("--token-file", str(tokens), "--store", "memory",
                              "--preemption-grace", str(GRACE_S), "--preemption-min-run", "0.5")  # fmt: skip
    await cluster.worker("w1", "--max-concurrency", "2")
    async with Client(cluster.url, token=ALICE) as alice, Client(cluster.url, token=BOB) as bob:
        # 1. alice floods 40 plans of 0.5 s (10 s of work on 2 slots); then bob submits 4.
        flood = await alice.submit_many("sleep", [{"seconds": PLAN_S}] * 40)
        # The flood takes the slots first, as a flood does.
        await until(lambda: sum(plan.state in ("running", "succeeded") for plan in flood) >= 2, timeout_s=30)
        start = time.monotonic()
        trickle = [await bob.submit("sleep", {"seconds": PLAN_S}) for _ in range(4)]
        for plan in trickle:
            await asyncio.wait_for(plan.result(), 60)
        bob_s = time.monotonic() - start
        # Fair share gives bob one of the two slots: 4 plans in about 4 plan lengths. First come, first
        # served would make him wait for the 36-odd plans of alice's still queued (about 9 s).
        assert bob_s < 8 * PLAN_S, f"bob's 4 plans took {bob_s:.2f} s"
        # The rest of the flood (about 6 s more of work) is cancelled, not waited for; the ledger must count
        # exactly the flood plans that succeeded and those cancelled.
        flood_ends = [await alice.cancel(plan.id) for plan in flood]
        flood_succeeded = sum(info.state == "succeeded" for info in flood_ends)
        flood_cancelled = sum(info.state == "cancelled" for info in flood_ends)
        assert flood_succeeded >= 2 and flood_succeeded + flood_cancelled == 40, [i.state for i in flood_ends]
        # 2. alice holds both slots with preemptible plans; bob's plan waits at most the grace (+ a tick).
        held = [await alice.submit("sleep", {"seconds": 120}, preemptible=True) for _ in range(2)]
        kinds: dict[str, list[str]] = {plan.id: [] for plan in held}
        watchers = [asyncio.ensure_future(kinds_of(plan, kinds[plan.id])) for plan in held]
        await until(lambda: all(plan.state == "running" for plan in held), timeout_s=30)
        await asyncio.sleep(0.75)  # past --preemption-min-run (0.5 s)
        start = time.monotonic()
        waiting = await bob.submit("sleep", {"seconds": 0.1})
        await asyncio.wait_for(waiting.result(), 60)
        waited_s = time.monotonic() - start
        assert waited_s < GRACE_S + 2.0, f"bob's plan waited {waited_s:.2f} s behind preemptible plans"
        for plan in held:
            await alice.cancel(plan.id)
        await asyncio.wait_for(asyncio.gather(*watchers), 30)
        preempted = [plan_id for plan_id, seen in kinds.items() if "preempted" in seen]
        assert len(preempted) == 1, kinds  # one slot was needed: one plan was preempted
        assert kinds[preempted[0]].index("requeued") > kinds[preempted[0]].index("preempted")
    # 3. the ledger: an admin sees both principals, bob only himself.
    rows, own = await asyncio.gather(usage_json(cluster, ADMIN_TOKEN), usage_json(cluster, BOB))
    assert {"alice", "bob"} <= set(rows)
    assert rows["alice"]["team"] == "ml" and rows["bob"]["team"] == "web"
    assert rows["alice"]["succeeded"] == flood_succeeded and rows["bob"]["succeeded"] == 5
    assert rows["alice"]["preemptions"] == 1 and rows["alice"]["cancelled"] == flood_cancelled + 2
    assert float(rows["bob"]["slot_seconds"]) >= 4 * PLAN_S
    assert list(own) == ["bob"]
