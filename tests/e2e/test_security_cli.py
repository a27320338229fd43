"""End to end: `fleetwire token new`, a coordinator with --token-file, and a SIGHUP that revokes one token."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from protocol import errors
from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


async def _new_token(cluster: Cluster, *args: str) -> tuple[str, str]:
    """(token, token-file entry) printed by `fleetwire token new`."""
    proc = await cluster.run("token", "new", *args)
    assert await proc.wait() == 0
    token, *entry = proc.lines
    assert entry[0] == "[[token]]" and token not in "\n".join(entry)  # the file gets the hash only
    return token, "\n".join(entry) + "\n"


async def test_token_file_roles_and_sighup_revocation(cluster: Cluster, tmp_path: Path) -> None:
    """Tokens made by the CLI open their role's path; after SIGHUP a removed token's session closes 4401."""
    (alice, alice_entry), (bob, bob_entry), (fleet, fleet_entry) = await asyncio.gather(  # three CLIs side by side
        _new_token(cluster, "--name", "alice", "--role", "client"),
        _new_token(cluster, "--name", "bob", "--role", "client"),
        _new_token(cluster, "--name", "fleet", "--role", "worker", "--worker-ids", "edge-*"))
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(alice_entry + bob_entry + fleet_entry)
    coordinator = await cluster.run("coordinator", "--port", "0", "--store", "memory", "--token-file", str(tokens),
                                    name="coordinator")
    cluster.url = (await coordinator.wait_for_line(r"listening on (ws://\S+)")).group(1)
    await cluster.run("worker", "--id", "edge-1", name="edge-1", env=cluster.env(FLEETWIRE_TOKEN=fleet))
    await cluster.procs[-1].wait_for_line("registered")

    session = await connect(f"{cluster.url}/v1/client", additional_headers={"Authorization": f"Bearer {alice}"})
    submit = await cluster.run("submit", "echo", "--args", '"hi"', env=cluster.env(FLEETWIRE_TOKEN=alice))
    assert await submit.wait() == 0 and submit.lines[-1] == '"hi"'

    tokens.write_text(bob_entry + fleet_entry)
    coordinator.stop(signal.SIGHUP)
    with contextlib.suppress(ConnectionClosed):
        while True:
            await asyncio.wait_for(session.recv(), 20)
    assert session.close_code == errors.CLOSE_REVOKED

    refused = await cluster.run("workers", env=cluster.env(FLEETWIRE_TOKEN=alice))
    workers = await cluster.run("workers", env=cluster.env(FLEETWIRE_TOKEN=bob))  # beside it
    assert await refused.wait() == 1
    assert await workers.wait() == 0
    assert any(line.startswith("edge-1 ") and "alive" in line for line in workers.lines)  # the worker stayed
