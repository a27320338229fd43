"""The cluster's shared data-plane key (coordinator/io/cluster/shared_keys.py): rotated on ``--data-key-rotation``,
the previous one accepted for the tickets' life, derived from ``--cluster-secret-file`` (not from the database alone),
and a coordinator with another secret refused at start.

Two in-process cluster hosts on one real PostgreSQL database (tests/pg.py; skipped without one), each serving one
shard, with a fake wall clock (``ClusterHost.wall``) and explicit syncs (``sync_shared_keys``) instead of waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.core import CoreConfig
from coordinator.graphs.lineage import Source
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.cluster.shared_keys import ClusterSecretMismatch, SharedKey, accepted, key_times, parse, sync
from coordinator.io.frontdoor.server import ServerSettings
from fleetwire import Client, OutputRef
from fleetwire.cli.shards import run_cluster_coordinator
from protocol.tickets import FileClaim, TicketClaims, TicketError, sign, verify, worker_key
from tests.integration.data_helpers import digest
from tests.integration.test_cluster_graphs import two_shards
from tests.integration.test_cluster_view_all import CLUSTER
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

SECRET = b"the cluster's secret, 32 bytes.."
OTHER = b"another secret of 32 bytes......"
TTL_S = 100.0
ROTATION_S = 1000.0
T0 = 2_000_000_000.0  # the fake wall clock's start (Unix seconds)
SOURCE = Source("p1", 1, "w1", "y", 10, "")
_WAIT_EVENT = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1"
_DATA_KEYS = "SELECT value FROM fleetwire_meta WHERE key = 'data_keys'"
PUBLISH_S = key_times(
    ticket_ttl_s=TTL_S,
    lease_ttl_s=CLUSTER.lease_ttl_s,
    scan_s=CLUSTER.scan_s,
    reconnect_grace_s=CoreConfig().worker_reconnect_grace_s,
).publish_s  # the hosts' (ClusterHost.sync_shared_keys)


def settings(dsn: str) -> ServerSettings:
    core = CoreConfig(data_ticket_ttl_s=TTL_S, data_key_rotation_s=ROTATION_S)
    return ServerSettings(port=0, insecure=True, store=dsn, cluster=CLUSTER, core=core)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def two_hosts(dsn: str, clock: Clock) -> AsyncIterator[tuple[ClusterHost, ClusterHost]]:
    """Two hosts with the same secret, each serving one of the two shards."""
    hosts: list[ClusterHost] = []
    try:
        for _ in range(2):
            host = ClusterHost(settings(dsn), cluster_secret=SECRET)
            host.wall = clock
            hosts.append(host)
            await host.start()
        await until(lambda: all(len(h.servers) == 1 and not h.cores.moving for h in hosts), timeout_s=60)
        yield hosts[0], hosts[1]
    finally:
        for host in reversed(hosts):
            await host.stop()


def sign_pull(host: ClusterHost) -> str:
    """A pull ticket for worker ``w1`` signed with the shared key by ``host``'s core."""
    [server] = host.servers.values()
    return server.core.data.pull_ticket(SOURCE, time.monotonic(), shared=True)


def accepts(host: ClusterHost, ticket: str) -> bool:
    """Whether worker ``w1`` of ``host``'s core (its ``data_keys``) accepts ``ticket``; TicketError when refused."""
    [server] = host.servers.values()
    keys = {key.kid: key.key for key in server.core.data.worker_keys("w1")}
    verify(ticket, keys, wall=time.time(), worker="w1", plan="p1", attempt=1, direction="get", name="y")
    return True


def kid(ticket: str) -> str:
    return ticket.split(".")[1]


async def test_a_ticket_of_one_coordinator_is_accepted_by_the_other_across_a_rotation_then_refused(
    pg_dsn: str,
) -> None:
    """The core that makes the next key keeps signing with the previous one until the new one is published (a
    round and a lease's life on the database's clock), so the other core's workers accept its tickets before that
    core read the row; then both sign with the new key, the previous one accepted for the tickets' life more."""
    clock = Clock()
    async with two_hosts(pg_dsn, clock) as (a, b):
        first = sign_pull(a)
        assert accepts(b, first) and accepts(a, sign_pull(b))
        assert kid(sign_pull(b)) == kid(first)

        clock.now += ROTATION_S  # due: the first core to sync makes the new key, the other learns it
        await a.sync_shared_keys()
        [new, previous] = parse(await a.db(lambda conn: conn.fetchval(_DATA_KEYS)))
        assert previous.kid == kid(first) and new.kid != kid(first)
        assert kid(sign_pull(a)) == kid(first)  # published, not signing yet
        assert accepts(b, sign_pull(a))  # b has not synced: it accepts a's ticket all the same
        await b.sync_shared_keys()  # no restart
        assert kid(sign_pull(b)) == kid(first)  # b did not mint one of its own, nor signs with the new one yet

        clock.now += PUBLISH_S  # published: every core has had its rounds
        await a.sync_shared_keys()
        await b.sync_shared_keys()
        second = sign_pull(a)
        assert kid(second) == kid(sign_pull(b)) == new.kid
        assert accepts(b, second) and accepts(a, sign_pull(b))
        assert accepts(b, first) and accepts(a, first)  # the previous key: the tickets it signed still live

        clock.now += TTL_S + 2 * CLUSTER.scan_s + CLUSTER.lease_ttl_s  # past the overlap
        await a.sync_shared_keys()
        await b.sync_shared_keys()
        for host in (a, b):
            with pytest.raises(TicketError, match="unknown ticket key"):
                accepts(host, first)
            assert accepts(host, second)


async def test_the_database_alone_does_not_give_the_key(pg_dsn: str) -> None:
    clock = Clock()
    async with two_hosts(pg_dsn, clock) as (a, b):
        genuine = sign_pull(a)
        assert accepts(b, genuine)
        rows = dict(await a.db(lambda conn: conn.fetch("SELECT key, value FROM fleetwire_meta")))
        assert "data_secret" not in rows
        [stored] = parse(rows["data_keys"])
        assert stored.kid == kid(genuine)
        claims = TicketClaims("p1", 1, "w1", "get", {"y": FileClaim(10)}, time.time() + 60)
        for master in (bytes.fromhex(stored.seed), stored.seed.encode(), bytes.fromhex(stored.check)):
            forged = sign(claims, stored.kid, worker_key(master, "w1"))
            with pytest.raises(TicketError, match="bad ticket signature"):
                accepts(b, forged)


async def test_a_coordinator_with_another_secret_or_none_is_refused_at_start(
    pg_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = ClusterHost(settings(pg_dsn), cluster_secret=SECRET)
    await first.start()
    try:
        await until(lambda: len(first.servers) == CLUSTER.shards and not first.cores.starting, timeout_s=60)
        for secret, why in ((OTHER, "does not match"), (None, "has none")):
            other = ClusterHost(settings(pg_dsn), cluster_secret=secret)
            try:
                with pytest.raises(ClusterSecretMismatch, match=why):
                    await other.start()
                assert not other.servers
            finally:
                assert other.control is not None
                other.control.close()
        secret_file = tmp_path / "secret"
        secret_file.write_bytes(OTHER + b"\n")
        assert await run_cluster_coordinator(settings(pg_dsn), "test", None, str(secret_file)) == 2
        err = capsys.readouterr().err
        assert "does not match" in err and "warning" not in err
        assert await run_cluster_coordinator(settings(pg_dsn), "test", None, None) == 2
        err = capsys.readouterr().err
        assert "fleetwire: warning: no --cluster-secret-file" in err and "has none" in err
    finally:
        await first.stop()


async def test_one_key_is_minted_for_one_slot_when_cores_rotate_at_once(pg_dsn: str) -> None:
    host = ClusterHost(settings(pg_dsn), cluster_secret=SECRET)  # makes the schema; its control connection's
    try:
        conns = [await asyncpg_connect(pg_dsn) for _ in range(4)]
        try:
            rounds: list[list[list[SharedKey]]] = []
            for n in range(2):  # the first key, then one rotation: each core at once
                wall = T0 + n * ROTATION_S
                seen = await asyncio.gather(
                    *(sync(conn, SECRET, wall=wall, rotation_s=ROTATION_S, keep_s=TTL_S) for conn in conns)
                )
                rounds.append([keys for keys, _ in seen])
        finally:
            for conn in conns:
                await conn.close()
        for each in rounds:
            assert len({keys[0].kid for keys in each}) == 1
        made: list[SharedKey] = rounds[1][0]
        assert [key.kid for key in made] == [rounds[1][0][0].kid, rounds[0][0][0].kid]
    finally:
        assert host.control is not None
        host.control.close()


async def asyncpg_connect(dsn: str) -> Any:
    import asyncpg

    return await asyncpg.connect(dsn)


async def test_a_rotation_cut_off_mid_way_leaves_the_previous_key_and_one_new_key(pg_dsn: str) -> None:
    """A core that dies holding the row's lock (its transaction never commits): the next core's rotation waits for
    the lock, then makes one key, and the previous one stays accepted (its live tickets stay valid)."""
    host = ClusterHost(settings(pg_dsn), cluster_secret=SECRET)  # makes the schema
    dying, other, watch = [await asyncpg_connect(pg_dsn) for _ in range(3)]
    try:
        [first], _ = await sync(other, SECRET, wall=T0, rotation_s=ROTATION_S, keep_s=TTL_S)
        tx = dying.transaction()
        await tx.start()
        await dying.fetchval("SELECT value FROM fleetwire_meta WHERE key = 'data_keys' FOR UPDATE")
        await dying.execute("UPDATE fleetwire_meta SET value = 'half:written' WHERE key = 'data_keys'")
        rotating = asyncio.ensure_future(sync(other, SECRET, wall=T0 + ROTATION_S, rotation_s=ROTATION_S, keep_s=TTL_S))
        for _ in range(2000):  # up to 10 s: the rotation waits for the dead core's lock
            if await watch.fetchval(_WAIT_EVENT, other.get_server_pid()) == "Lock":
                break
            await asyncio.sleep(0.005)
        else:
            pytest.fail("the rotation did not wait for the row's lock")
        assert not rotating.done()
        dying.terminate()  # the core is gone: its transaction is rolled back
        keys, _ = await asyncio.wait_for(rotating, 30)
        assert [key.kid for key in keys][1:] == [first.kid] and keys[0].kid != first.kid
    finally:
        await other.close()
        await watch.close()
        assert host.control is not None
        host.control.close()


async def test_the_former_never_rotated_secret_becomes_the_previous_key_and_leaves_the_database(pg_dsn: str) -> None:
    host = ClusterHost(settings(pg_dsn), cluster_secret=SECRET)  # makes the schema
    conn = await asyncpg_connect(pg_dsn)
    try:
        legacy = "ab" * 32
        await conn.execute("INSERT INTO fleetwire_meta (key, value) VALUES ('data_secret', $1)", legacy)
        keys, _ = await sync(conn, SECRET, wall=T0, rotation_s=ROTATION_S, keep_s=TTL_S)
        assert [key.seed for key in keys][1:] == [legacy] and keys[1].check == ""  # tickets it signed stay valid
        assert keys[1].kid == "c" + hashlib.sha256(bytes.fromhex(legacy)).hexdigest()[:8]  # the kid it had
        assert await conn.fetchval("SELECT count(*) FROM fleetwire_meta WHERE key = 'data_secret'") == 0
        assert [kid for kid, _ in accepted(keys, SECRET, T0 + TTL_S + 1, TTL_S)] == [keys[0].kid]  # then dropped
    finally:
        await conn.close()
        assert host.control is not None
        host.control.close()


async def test_without_a_secret_the_key_is_the_stored_seed_judged_by_the_databases_clock(pg_dsn: str) -> None:
    """No --cluster-secret-file: the behaviour before it (the stored value is the key; the host warns at start), the
    keys' age read on the database's clock when no clock is given (every core judges by the same one)."""
    host = ClusterHost(settings(pg_dsn))  # makes the schema
    conn = await asyncpg_connect(pg_dsn)
    try:
        [key], wall = await sync(conn, None, wall=None, rotation_s=ROTATION_S, keep_s=TTL_S)
        assert key.check == "" and key.made_at == wall and abs(wall - time.time()) < 60
        assert accepted([key], None, wall, TTL_S) == [(key.kid, bytes.fromhex(key.seed))]
        again, _ = await sync(conn, None, wall=None, rotation_s=ROTATION_S, keep_s=TTL_S)
        assert again == [key]  # not due
    finally:
        await conn.close()
        assert host.control is not None
        host.control.close()


async def test_workers_learn_a_rotation_without_a_restart_and_a_cross_shard_pull_verifies_with_the_new_key(
    pg_dsn: str, tmp_path: Path
) -> None:
    """Two hosts each serving one shard, a worker per shard (tests/integration/test_cluster_graphs.py): the shared key
    rotates (made by one host, learned by the other) and the old one is dropped after its overlap; then a consumer
    on shard 1 pulls a producer's output from shard 0's worker with a ticket signed by the new key, which that worker
    got in data_keys (no restart of anything)."""
    gate = asyncio.Event()
    async with two_shards(pg_dsn, tmp_path, gate, hosts=2) as (hosts, pools):
        clock = Clock()
        for host in hosts:
            clock.now = time.time()
            host.wall = clock
        old = {host.servers[shard].core.data.shared for host in hosts for shard in host.servers}
        core = CoreConfig()
        clock.now += core.data_key_rotation_s
        for host in hosts:
            await host.sync_shared_keys()
        clock.now += PUBLISH_S + core.data_ticket_ttl_s + 2 * CLUSTER.scan_s + CLUSTER.lease_ttl_s  # past the overlap
        for host in hosts:
            await host.sync_shared_keys()
        new = {host.servers[shard].core.data.shared for host in hosts for shard in host.servers}
        assert len(old) == len(new) == 1 and old != new
        [(kid_now, _)] = new
        for host in hosts:
            for server in host.servers.values():
                assert [key.kid for key in server.core.data.worker_keys("w0")][-1:] == [kid_now]  # the old one gone
        urls = [h.url for h in hosts]
        async with Client(urls, pool=pools[0]) as first, Client(urls, pool=pools[1]) as second:
            a = await first.submit("make", {}, outputs=["y"], tags=[f"pool:{pools[0]}"], plan_id="a")
            b = await second.submit("take", inputs={"x": OutputRef("a", "y")}, tags=[f"pool:{pools[1]}"], plan_id="b")
            gate.set()
            assert await asyncio.wait_for(b.result(), 60) == digest(await a.output("y"))
            via = {e.data["name"]: e.data["via"] for e in b._stream.events if e.kind == "input_received"}
            assert via == {"x": "pull"}


async def test_a_consumer_placed_by_the_core_that_rotated_the_key_is_never_refused_by_a_holder_on_another_core(
    pg_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Core A (shard 1's) makes the next shared key while core B (shard 0's, the holder's) has not read it yet: B's
    rounds are held back, the clock stands still. A keeps signing with the previous key until the new one is
    published (every core has had a round and a lease's life to tell its workers), so the consumer A places pulls
    from B's worker at its first attempt, no ticket refused (before, A signed with the new key at once and every
    placement was refused by the holder until B's next round). Then, the publication past, B reads the row and
    both sign with the new key."""
    gate = asyncio.Event()
    async with two_shards(pg_dsn, tmp_path, gate, hosts=2) as (hosts, pools):
        a = next(host for host in hosts if 1 in host.servers)  # the consumer's core
        b = next(host for host in hosts if 0 in host.servers)  # the holder's core
        clock = Clock()
        clock.now = time.time()  # the keys were made on the database's clock
        for host in hosts:
            host.wall = clock
        [old] = {host.servers[shard].core.data.shared for host in hosts for shard in host.servers}
        assert old is not None
        b_sync = b.sync_shared_keys

        async def held_back() -> None:
            """B's rounds do not reach the row."""

        monkeypatch.setattr(b, "sync_shared_keys", held_back)
        clock.now += CoreConfig().data_key_rotation_s
        await a.sync_shared_keys()  # due: A makes the new key (its own rounds would too)
        keys = parse(await a.db(lambda conn: conn.fetchval(_DATA_KEYS)))
        new_kid = keys[0].kid
        assert [key.kid for key in keys] == [new_kid, old[0]]
        assert new_kid in [key.kid for key in a.servers[1].core.data.worker_keys("w1")]  # published on A
        assert new_kid not in [key.kid for key in b.servers[0].core.data.worker_keys("w0")]  # B has not read it
        urls = [h.url for h in hosts]
        async with Client(urls, pool=pools[0]) as first, Client(urls, pool=pools[1]) as second:
            made = await first.submit("make", {}, outputs=["y"], tags=[f"pool:{pools[0]}"], plan_id="a")
            taken = await second.submit("take", inputs={"x": OutputRef("a", "y")}, tags=[f"pool:{pools[1]}"],
                                        plan_id="b", max_attempts=1)  # fmt: skip
            gate.set()
            assert await asyncio.wait_for(taken.result(), 60) == digest(await made.output("y"))
            info = await second.get_plan("b")
            assert (taken.worker_id, info.attempt, info.history) == ("w1", 1, [])  # no attempt refused
        assert a.servers[1].core.data.shared == old  # A signed with the previous key meanwhile

        clock.now += PUBLISH_S  # published: B has had its rounds
        monkeypatch.setattr(b, "sync_shared_keys", b_sync)
        for host in (b, a):
            await host.sync_shared_keys()
        for host, shard, worker in ((a, 1, "w1"), (b, 0, "w0")):
            data = host.servers[shard].core.data
            assert data.shared is not None and data.shared[0] == new_kid
            assert {key.kid for key in data.worker_keys(worker)} >= {new_kid, old[0]}  # the previous one still lives
