"""Cluster mode: the CLI against one coordinator sees and acts on plans and workers of every shard (docs/CLUSTER.md)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.typing import Subprotocol

from coordinator.shards import partition_of
from fleetwire import Client
from protocol import errors
from tests.e2e.conftest import ADMIN_TOKEN, CLIENT_TOKEN, WORKER_TOKEN, Cluster, Proc
from tests.e2e.test_cluster import FAST, SHARDS, pool_on, topology

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


async def coordinator(cluster: Cluster, dsn: str, *extra: str) -> tuple[Proc, str]:
    env = cluster.env(FLEETWIRE_WORKER_TOKEN=WORKER_TOKEN, FLEETWIRE_CLIENT_TOKEN=CLIENT_TOKEN,
                      FLEETWIRE_ADMIN_TOKEN=ADMIN_TOKEN, FLEETWIRE_STORE=dsn)  # fmt: skip
    proc = await cluster.run("coordinator", "--port", "0", *FAST, *extra, name="coordinator", env=env)
    url = (await proc.wait_for_line(r"listening on (ws://\S+)")).group(1)
    return proc, url


async def two_coordinators(cluster: Cluster, dsn: str) -> tuple[Proc, str, Proc, str, list[int]]:
    """a and b, split 2 + 2; returns b's shards."""
    a, a_url = await coordinator(cluster, dsn)
    for _ in range(SHARDS):
        await a.wait_for_line("serving shard")
    b, b_url = await coordinator(cluster, dsn)
    for _ in range(SHARDS // 2):
        await b.wait_for_line("serving shard")
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(b_url.replace("ws://", "http://") + "/v1/topology", timeout=5).read()
    )
    b_owner = json.loads(body)["coordinator"]
    rows = await topology(a_url)
    return a, a_url, b, b_url, sorted(s for s, r in rows.items() if r["owner"] == b_owner)


async def cli(cluster: Cluster, *args: str, token: str = CLIENT_TOKEN) -> tuple[int, list[str]]:
    proc = await cluster.run(*args, env=cluster.env(FLEETWIRE_TOKEN=token))
    rc = await proc.wait(60)
    return rc, proc.lines


async def running(plan: Any) -> None:
    async for event in plan.events():
        if event.kind == "running":
            return


async def until(check: Any, timeout_s: float = 20.0) -> Any:
    """Ask ``check()`` again until it gives something true (state only another process can change)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await check()
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


async def test_cli_on_a_non_owner_gets_watches_cancels_and_lists_plans_and_workers_of_any_shard(
    cluster: Cluster, pg_dsn: str
) -> None:
    """Against a's main port only: workers, plans, get, watch and cancel of plans on b's shard all work."""
    _, a_url, _, b_url, b_shards = await two_coordinators(cluster, pg_dsn)
    pool = pool_on(b_shards[0])
    await cluster.worker("w-b", "--url", f"{a_url},{b_url}", "--pool", pool, "--reconnect-base", "0.05")
    async with Client([a_url, b_url], token=CLIENT_TOKEN, pool=pool) as client:
        done = await client.submit("echo", {"n": 1}, tags=[f"pool:{pool}"], plan_id="done-on-b")
        assert await asyncio.wait_for(done.result(), 30) == {"n": 1}
        long = await client.submit("sleep", {"seconds": 60}, tags=[f"pool:{pool}"], plan_id="long-on-b")
        await asyncio.wait_for(running(long), 30)

    async def workers() -> Any:
        async with Client(a_url, token=CLIENT_TOKEN) as c:
            reply = await c.workers()
        return [w.id for w in reply.workers] if reply.workers else None

    assert await until(workers) == ["w-b"]  # its owner writes its registry every lease renewal
    rc, lines = await cli(cluster, "workers", "--url", a_url, "--json")
    assert rc == 0 and [w["id"] for w in json.loads(lines[-1])["workers"]] == ["w-b"]
    rc, lines = await cli(cluster, "plans", "--url", a_url, "--json")  # a client token: its own plans
    listing = json.loads(lines[-1])
    assert rc == 0 and {p["id"] for p in listing["plans"]} == {"done-on-b", "long-on-b"}, listing
    assert listing["counts"] == {"succeeded": 1, "running": 1}, listing  # one of each so far
    rc, lines = await cli(cluster, "watch", "done-on-b", "--url", a_url, "--json")
    assert rc == 0 and json.loads(lines[-1])["result"] == {"n": 1}, lines
    # A submit on a's main port is moved to b's core (the SDK follows), whatever the session did before.
    rc, lines = await cli(cluster, "submit", "echo", "--args", '{"via": "a"}', "--tags", f"pool:{pool}",
                          "--id", "sent-via-a", "--url", a_url, "--json")  # fmt: skip
    assert rc == 0 and json.loads(lines[-1])["result"] == {"via": "a"}, lines
    a_pool = pool_on(next(s for s in range(SHARDS) if s not in b_shards))
    async with Client([a_url, b_url], token=CLIENT_TOKEN, pool=a_pool) as client:
        await client.submit("echo", {}, tags=[f"pool:{a_pool}"], plan_id="queued-on-a")  # no worker: stays queued
    # One session cancels plans of two shards: each cancel is forwarded to its shard's owner.
    rc, lines = await cli(cluster, "cancel", "long-on-b", "queued-on-a", "--url", a_url)
    assert rc == 0 and lines[-2:] == ["plan long-on-b cancelled", "plan queued-on-a cancelled"], lines
    rc, lines = await cli(cluster, "cancel", "nope", "--url", a_url)
    assert rc != 0
    async with Client(a_url, token=ADMIN_TOKEN) as admin:
        info = await admin.get_plan("long-on-b")
        assert info.state == "cancelled" and info.owner
        assert a_url.startswith(admin.url.rsplit("/v1", 1)[0])  # served on a's main port: never moved
    # The dashboard: its page on the main port, its session (JSON, token as a subprotocol) sees every shard.
    status, _ = await asyncio.to_thread(lambda: (urllib.request.urlopen(a_url.replace("ws://", "http://") + "/",
                                                                        timeout=5).status, None))  # fmt: skip
    assert status == 200
    bearer = "fleetwire.bearer." + base64.urlsafe_b64encode(ADMIN_TOKEN.encode()).decode().rstrip("=")
    offered = [Subprotocol("fleetwire.v1.json"), Subprotocol(bearer)]
    async with connect(a_url + "/v1/client", subprotocols=offered) as ws:
        await ws.send(json.dumps([{"type": "subscribe", "req_id": 1, "all": True, "from_seq": 2**53},
                                  {"type": "list_plans", "req_id": 2, "limit": 200}]))  # fmt: skip
        replies = [json.loads(await ws.recv()) for _ in range(2)]
        replies = [r[0] if isinstance(r, list) else r for r in replies]
    assert [r["type"] for r in replies] == ["subscribed", "plans"], replies
    assert {p["id"] for p in replies[1]["plans"]} == {"done-on-b", "long-on-b", "queued-on-a", "sent-via-a"}
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(pg_dsn)
    try:  # a look-up by id is an index scan, built by the coordinators at start
        rows = await conn.fetch("SELECT indexname FROM pg_indexes WHERE tablename = 'fleetwire_plans'")
        indexes = {r[0] for r in rows}
    finally:
        await conn.close()
    assert "fleetwire_plans_by_id" in indexes


async def test_a_watcher_on_a_non_owner_follows_a_plan_to_its_end_through_the_doorbell(
    cluster: Cluster, pg_dsn: str
) -> None:
    """A watch on a's main port of a queued plan of b's shard gets every later event and the result."""
    _, a_url, _, b_url, b_shards = await two_coordinators(cluster, pg_dsn)
    pool = pool_on(b_shards[1])
    async with Client([b_url], token=CLIENT_TOKEN, pool=pool) as client:
        await client.submit("echo", {"k": "v"}, tags=[f"pool:{pool}"], plan_id="waits")  # no worker yet: queued
    async with Client(a_url, token=CLIENT_TOKEN) as viewer:
        watched = await viewer.watch("waits")
        seen: list[str] = []

        async def collect() -> Any:
            async for event in watched.events():
                seen.append(event.kind)
            return await watched.result()

        follower = asyncio.create_task(collect())
        await cluster.worker("w-late", "--url", f"{a_url},{b_url}", "--pool", pool)
        assert await asyncio.wait_for(follower, 30) == {"k": "v"}
        assert seen[0] == "queued" and seen[-1] == "succeeded" and "echo" in seen, seen
        with pytest.raises(Exception, match="no plan"):
            await viewer.watch("never-submitted")


async def test_a_partitioned_pool_puts_workers_by_id_and_sessions_by_key_on_their_partitions_shard(
    cluster: Cluster, pg_dsn: str
) -> None:
    """--pool-partitions gpu=2: each worker serves its id's partition; every plan of a session key runs there."""
    proc, url = await coordinator(cluster, pg_dsn, "--pool-partitions", "gpu=2")
    for _ in range(SHARDS):
        await proc.wait_for_line("serving shard")
    ids = {partition_of(f"g{i}", 2): f"g{i}" for i in range(20)}
    keys = {partition_of(f"chat-{i}", 2): f"chat-{i}" for i in range(20)}
    for worker_id in ids.values():
        await cluster.worker(worker_id, "--url", url, "--pool", "gpu", "--reconnect-base", "0.05")
    for partition, key in sorted(keys.items()):
        async with Client([url], token=CLIENT_TOKEN, pool="gpu", reconnect_base_s=0.05) as client:
            plans = [await client.submit("echo", {"i": i}, tags=["pool:gpu"], session_key=key) for i in range(3)]
            for plan in plans:
                await asyncio.wait_for(plan.result(), 30)
            workers = {(await client.get_plan(plan.id)).worker_id for plan in plans}
        assert workers == {ids[partition]}, (key, workers)


async def new_token(cluster: Cluster, *args: str) -> tuple[str, str]:
    """(token, token-file entry) printed by `fleetwire token new`."""
    proc = await cluster.run("token", "new", *args)
    assert await proc.wait() == 0
    token, *entry = proc.lines
    return token, "\n".join(entry) + "\n"


def first(frame: Any) -> Any:
    """The first message of a msgpack frame (one message, or a list of them)."""
    decoded = msgspec.msgpack.decode(frame)
    return decoded[0] if isinstance(decoded, list) else decoded


async def test_a_revoked_tokens_view_session_is_closed_4401_at_sighup(cluster: Cluster, pg_dsn: str,
                                                                       tmp_path: Path) -> None:  # fmt: skip
    """A main port's view session of a token removed from the token file is closed 4401 at SIGHUP."""
    alice, alice_entry = await new_token(cluster, "--name", "alice", "--role", "client")
    bob, bob_entry = await new_token(cluster, "--name", "bob", "--role", "client")
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(alice_entry + bob_entry)
    proc = await cluster.run("coordinator", "--port", "0", *FAST, "--token-file", str(tokens), name="coordinator",
                             env=cluster.env(FLEETWIRE_STORE=pg_dsn))  # fmt: skip
    url = (await proc.wait_for_line(r"listening on (ws://\S+)")).group(1)
    await proc.wait_for_line("serving shard")
    sessions = [await connect(f"{url}/v1/client", additional_headers={"Authorization": f"Bearer {token}"})
                for token in (alice, bob)]  # fmt: skip
    for ws in sessions:  # both are view sessions of the main port
        await ws.send(msgspec.msgpack.encode([{"type": "list_plans", "req_id": 1}]))
        assert first(await ws.recv())["type"] == "plans"
    tokens.write_text(bob_entry)
    proc.stop(signal.SIGHUP)
    with contextlib.suppress(ConnectionClosed):
        while True:
            await asyncio.wait_for(sessions[0].recv(), 20)
    assert sessions[0].close_code == errors.CLOSE_REVOKED
    await sessions[1].send(msgspec.msgpack.encode([{"type": "list_plans", "req_id": 2}]))
    assert first(await sessions[1].recv())["type"] == "plans"  # bob's stays open
    await sessions[1].close()
