"""A shard core's redirect (coordinator/io/cluster/host.py ``ClusterHost.redirect``): a submit of another shard is
moved to that shard's owner as the last scan has it; the shard is looked up by the submit's one required tag
(coordinator/shards.py ``SubmitShards``), not hashed per submit."""

from __future__ import annotations

import pytest

from coordinator import shards as shards_module
from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig, LeaseRow, SubmitShards, pool_shard, submit_shard
from protocol.messages import Moved, Requirements, RoutingHints, Submit

DEAD = "postgresql://nobody@127.0.0.1:1/none"  # never reached: the host waits for it (not started here)


def a_host(config: ClusterConfig) -> ClusterHost:
    return ClusterHost(ServerSettings(port=0, insecure=True, store=DEAD, cluster=config))


def submit(*tags: str, key: str | None = None, plan_id: str | None = "p1") -> Submit:
    return Submit(req_id=1, op="echo", plan_id=plan_id, requirements=Requirements(tags=list(tags)),
                  hints=RoutingHints(session_key=key))  # fmt: skip


def other_pool(shards: int) -> str:
    """A pool whose shard is not shard 0."""
    return next(name for name in (f"pool{i}" for i in range(1000)) if pool_shard(name, shards) != 0)


def test_a_submit_of_another_shard_is_moved_to_whoever_owns_it_now() -> None:
    """Shard 0's core moves a submit of another pool's shard to that shard's owner; after another coordinator takes
    the shard (a new scan), the same pool's next submit is moved there; its own pool's submit is kept."""
    config = ClusterConfig(shards=16)
    host = a_host(config)
    pool = other_pool(config.shards)
    target = pool_shard(pool, config.shards)
    host.rows = [LeaseRow(target, "a", 3, True, "ws://a:1")]
    assert host.redirect(0, "client", submit(f"pool:{pool}")) == Moved(url="ws://a:1", epoch=3, shard=target)
    host.rows = [LeaseRow(target, "b", 4, True, "ws://b:2")]  # another coordinator took it
    assert host.redirect(0, "client", submit(f"pool:{pool}")) == Moved(url="ws://b:2", epoch=4, shard=target)
    assert host.redirect(target, "client", submit(f"pool:{pool}")) is None
    assert host.redirect(0, "client", submit()) is None  # the default pool is shard 0's


@pytest.mark.parametrize("partitions", [(), (("gpu", 4),)])
@pytest.mark.parametrize("tags", [(), ("gpu",), ("pool:gpu",), ("cpu", "pool:gpu"), ("pool:llm",), ("llm",)])
def test_the_shard_looked_up_by_tag_is_submit_shard(tags: tuple[str, ...], partitions: tuple[tuple[str, int], ...]
                                                    ) -> None:  # fmt: skip
    """Every tag shape, with and without a partitioned pool, twice (the second a look-up): submit_shard's answer."""
    lookup = SubmitShards(16, partitions)
    for key in ("k1", "k2", "k3", None):
        msg = submit(*tags, key=key, plan_id=None)
        expected = submit_shard(msg, 16, partitions)
        assert lookup(msg) == expected
        assert lookup(msg) == expected


def test_the_tags_remembered_are_bounded() -> None:
    """Clients choose tags: many distinct ones keep at most SUBMIT_SHARDS_MAX entries, and the answers stay right."""
    lookup = SubmitShards(16)
    for i in range(shards_module.SUBMIT_SHARDS_MAX + 100):
        assert lookup(submit(f"pool:p{i}")) == pool_shard(f"p{i}", 16)
    assert 0 < len(lookup) <= shards_module.SUBMIT_SHARDS_MAX
