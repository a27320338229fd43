"""Two principals submit the same plan id through the SDK, with inputs and outputs (issue #24 part 6;
docs/SEMANTICS.md §Plan ids): each one's plan runs on its own bytes, straight to the worker's data endpoint
(its URL names the key the coordinator made for the second plan) and through the relay, and each gets its
own result and output back. A real coordinator and agent in this process, over loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.auth import hash_token
from coordinator.io.frontdoor.server import CoordinatorServer
from fleetwire import Client
from tests.integration.data_helpers import coordinator_and_data_worker

pytestmark = pytest.mark.timeout(60)

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdefgh"}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    async def shout(ctx: Any, args: Any) -> dict[str, Any]:
        data = ctx.inputs["words"].path.read_bytes()
        ctx.output("loud", data.upper())
        return {"said": data.decode()}

    token_file = tmp_path / "tokens.toml"
    token_file.write_text("".join(f'[[token]]\nname = "{name}"\nrole = "client"\nhash = "{hash_token(token)}"\n'
                                  for name, token in TOKENS.items()))  # fmt: skip
    options = {"token_file": str(token_file)}  # beside the helper's inline worker and client tokens
    async with coordinator_and_data_worker(tmp_path, {"shout": shout}, server_options=options) as (server, _):
        yield server


@pytest.mark.parametrize("relay", [False, True])
async def test_both_principals_plans_of_one_id_move_their_own_bytes(server: CoordinatorServer, relay: bool) -> None:
    """alice's job, then bob's job: bob's gets a key of its own; both upload, run and download their own bytes."""
    async with Client(server.url, token=TOKENS["alice"]) as alice, Client(server.url, token=TOKENS["bob"]) as bob:
        first = await alice.submit("shout", inputs={"words": b"alice's words"}, outputs=["loud"], plan_id="job",
                                   relay=relay)  # fmt: skip
        second = await bob.submit("shout", inputs={"words": b"bob's words"}, outputs=["loud"], plan_id="job",
                                  relay=relay)  # fmt: skip
        assert first.id == second.id == "job"
        key = next(p.id for p in server.core.plans.values() if p.owner == "bob")
        assert key != "job"
        results = await asyncio.wait_for(asyncio.gather(first.result(), second.result()), 30)
        assert results == [{"said": "alice's words"}, {"said": "bob's words"}]
        assert await first.output("loud") == b"ALICE'S WORDS"
        assert await second.output("loud") == b"BOB'S WORDS"
        assert (await bob.get_plan("job")).owner == "bob" and (await alice.get_plan("job")).owner == "alice"
