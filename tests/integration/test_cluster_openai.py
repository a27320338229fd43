"""The OpenAI door through cluster coordinators (docs/OPENAI.md §Cluster mode), on a real PostgreSQL.

Two in-process cluster hosts (coordinator/io/cluster/host.py) share two shard slots, one each; three
worker agents of the default pool front fake vLLM engines. The official ``openai`` client is
pointed at each host's main port: the one serving the default pool's shard answers in process,
the other forwards each request to it (coordinator/io/cluster/openai_route.py). Skipped without
PostgreSQL (tests/pg.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from coordinator.core import CoreConfig
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.placement.placer import PlacementConfig
from coordinator.shards import DEFAULT_SHARD, POOL_TAG, ClusterConfig, pool_shard
from tests.integration.test_inference import fake_engine
from tests.integration.test_openai_door import engine_of, post, raw_http
from tests.waiting import until as wait_until
from worker_agent import Agent
from worker_agent.inference import InferenceEngine
from worker_agent.telemetry import Telemetry

pytestmark = pytest.mark.timeout(120)

WORKER, CLIENT = "worker-token-0123456789", "client-token-0123456789"
MODEL = "m1"
CLUSTER = ClusterConfig(shards=2, lease_ttl_s=3.0, lease_renew_s=1.0)


@dataclass
class Cluster:
    hosts: list[ClusterHost]
    engines: list[Any] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def owner(self, shard: int) -> ClusterHost:
        return next(host for host in self.hosts if shard in host.servers)

    def other(self, shard: int) -> ClusterHost:
        return next(host for host in self.hosts if shard not in host.servers)


def client(host: ClusterHost, key: str = CLIENT) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{host.port}/v1", api_key=key, max_retries=0,
                              http_client=httpx.AsyncClient(trust_env=False))  # fmt: skip


@pytest.fixture
async def cluster(pg_dsn: str) -> AsyncIterator[Cluster]:
    """Two cluster hosts holding one shard each (kv_aware), and three workers of the default pool with engines."""
    settings = ServerSettings(port=0, store=pg_dsn, cluster=CLUSTER, worker_tokens=(WORKER,),
                              client_tokens=(CLIENT,), core=CoreConfig(placement=PlacementConfig(policy="kv_aware")))
    running = Cluster([])
    try:
        for _ in range(2):
            host = ClusterHost(settings)
            await host.start()
            running.hosts.append(host)
        await wait_until(lambda: all(len(h.servers) == 1 and not h.cores.moving for h in running.hosts), timeout_s=60)
        entry = running.other(DEFAULT_SHARD)  # the workers too come in by the other host's main port: moved
        for i in range(3):
            fake = fake_engine.FakeEngine(name=f"e{i}", model=MODEL).start()
            running.engines.append(fake)
            engine = InferenceEngine(fake.url, metrics_interval_s=60.0)
            agent = Agent(entry.url, WORKER, worker_id=f"w{i}", telemetry=Telemetry(engine=engine))
            agent.add_handler("generate", engine.generate)
            running.agents.append(agent)
            running.tasks.append(asyncio.create_task(agent.run()))
        door = running.owner(DEFAULT_SHARD).door_of(DEFAULT_SHARD)
        assert door is not None
        registry = door.driver.core.registry

        def ready() -> bool:  # the door's model table is rebuilt now and then: wait until it lists all three
            listed = door.models.listing(time.monotonic())["data"]
            return len(list(registry)) == 3 and [m["fleetwire"]["workers"] for m in listed if m["id"] == MODEL] == [3]

        await wait_until(ready, timeout_s=30)
        yield running
    finally:
        for agent in running.agents:
            agent.stop()
        await asyncio.wait_for(asyncio.gather(*running.tasks, return_exceptions=True), 15)
        for host in running.hosts:
            await host.stop()
        for fake in running.engines:
            fake.stop()


async def test_the_openai_client_through_either_cluster_coordinator(cluster: Cluster) -> None:
    """Through the main port of the default pool's owner (in process) and of the other coordinator (forwarded):
    models listed, a completion, a stream with usage, 401 and 404 as OpenAI answers them, and a four-turn chat
    kept on one engine."""
    owner, other = cluster.owner(DEFAULT_SHARD), cluster.other(DEFAULT_SHARD)
    for host in (owner, other):
        async with client(host) as oai:
            models = await oai.models.list()
            assert [m.id for m in models.data] == [MODEL]
            assert models.data[0].model_extra["fleetwire"]["workers"] == 3
            chat = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two"}])
            assert (chat.choices[0].message.content or "").startswith("two one [from e")
            stream = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x y"}],
                                                       stream=True, stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("y x [from e")
            assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 5
            with pytest.raises(openai.NotFoundError) as missing:
                await oai.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
            assert missing.value.code == "model_not_found"
            messages: list[Any] = [{"role": "system", "content": f"You answer in reverse, {host.port}. " * 12}]
            served = []
            for turn in range(4):
                messages.append({"role": "user", "content": f"turn {turn} " + "words to reverse " * 10})
                answer = await oai.chat.completions.create(model=MODEL, messages=messages)
                text = answer.choices[0].message.content or ""
                served.append(engine_of(text))
                messages.append({"role": "assistant", "content": text})
            assert len(set(served)) == 1, served
        async with client(host, "wrong-key-0123456789") as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
    assert owner.openai is not None and other.openai is not None
    assert owner.openai.stats.forwarded == 0 and other.openai.stats.forwarded == 8  # the 401 is the main port's own
    assert other.openai.stats.answers == owner.openai.stats.answers == {200: 7, 404: 1, 401: 1}


async def test_a_shard_port_answers_421_for_another_shards_pool_and_keeps_serving(cluster: Cluster) -> None:
    """A request of the default pool sent straight to another shard's own port, whose pool's worker serves the
    model too, is 421 naming where the default pool is served; that shard serves on (the plan used to be submitted
    into its core: a commit of another shard's plan, refused by the fence, which stopped the shard)."""
    other_shard = next(shard for shard in range(CLUSTER.shards) if shard != DEFAULT_SHARD)
    pool = next(f"pool-{i}" for i in range(100) if pool_shard(f"pool-{i}", CLUSTER.shards) == other_shard)
    server = cluster.owner(other_shard).servers[other_shard]
    fake = fake_engine.FakeEngine(name="ep", model=MODEL).start()
    cluster.engines.append(fake)
    engine = InferenceEngine(fake.url, metrics_interval_s=60.0)
    agent = Agent(cluster.hosts[0].url, WORKER, worker_id="wp", tags=[POOL_TAG + pool],
                  telemetry=Telemetry(engine=engine))  # fmt: skip
    agent.add_handler("generate", engine.generate)
    cluster.agents.append(agent)
    cluster.tasks.append(asyncio.create_task(agent.run()))
    assert server.openai is not None
    door = server.openai
    await wait_until(lambda: door.models.serves(MODEL, time.monotonic()), timeout_s=30)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a b"}]}).encode()
    answer = await raw_http(server.port, post("/v1/chat/completions", body))
    assert answer.startswith(b"HTTP/1.1 421 ") and b"shard 0" in answer and b"main port" in answer
    pooled = post("/v1/chat/completions", body, extra=f"x-fleetwire-pool: {pool}\r\n")
    answer = await raw_http(server.port, pooled)  # its own pool: served here
    assert answer.startswith(b"HTTP/1.1 200 ") and b"b a [from ep]" in answer
    assert server.fatal is not None and not server.fatal.done() and other_shard in cluster.owner(other_shard).servers
    nobody = post("/v1/chat/completions", body, extra="x-fleetwire-pool: pool-of-nobody\r\n")
    answer = await raw_http(cluster.owner(DEFAULT_SHARD).port, nobody)  # a pool of no worker: 404 from its shard
    assert answer.startswith(b"HTTP/1.1 404 ") and b"of pool 'pool-of-nobody'" in answer
