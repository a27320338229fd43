"""Pool partitions (coordinator/shards.py): a pool split over K shards, workers by id, plans by session key."""

from __future__ import annotations

import collections

import pytest

from coordinator.records import PlanCreated
from coordinator.shards import (
    ClusterConfig,
    parse_partitions,
    partition_of,
    partition_shard,
    pool_shard,
    shard_of,
    submit_shard,
    worker_shard,
)
from protocol.messages import Requirements, RoutingHints, Submit

SHARDS = 16
GPU = (("gpu", 4),)


def submit(tags: list[str], *, session: str | None = None, plan_id: str | None = None) -> Submit:
    return Submit(req_id=1, op="echo", requirements=Requirements(tags=tags), plan_id=plan_id,
                  hints=RoutingHints(session_key=session))  # fmt: skip


def test_parse_partitions_reads_pool_counts_and_names_a_bad_item() -> None:
    """`gpu=4, llm=2` parses sorted; an item without a count, a count < 1 or a pool given twice is refused by name."""
    assert parse_partitions("gpu=4, llm=2") == (("gpu", 4), ("llm", 2))
    assert parse_partitions("") == ()
    for bad, named in (("gpu", "'gpu'"), ("gpu=0", "'gpu=0'"), ("=3", "'=3'"), ("gpu=x", "'gpu=x'")):
        with pytest.raises(ValueError, match=named):
            parse_partitions(bad)
    with pytest.raises(ValueError, match="given twice"):
        parse_partitions("gpu=2,gpu=3")


def test_more_partitions_than_shards_is_refused() -> None:
    """A pool cannot be split over more shards than the cluster has."""
    with pytest.raises(ValueError, match=r"gpu=5.*4 shard"):
        ClusterConfig(shards=4, partitions=(("gpu", 5),)).check()
    ClusterConfig(shards=4, partitions=(("gpu", 4),)).check()


def test_partitions_take_the_pools_shard_and_the_next_ones() -> None:
    """Partition i of a pool is the pool's own shard plus i (mod shards): K distinct shards."""
    base = pool_shard("gpu", SHARDS)
    shards = {partition_shard("gpu", i, SHARDS) for i in range(4)}
    assert partition_shard("gpu", 0, SHARDS) == base
    assert shards == {(base + i) % SHARDS for i in range(4)} and len(shards) == 4


def test_workers_spread_over_the_partitions_by_id() -> None:
    """Workers of a split pool land on its K shards by hash of their id, about evenly; others are unchanged."""
    counts = collections.Counter(worker_shard(["pool:gpu"], f"w{i}", SHARDS, GPU) for i in range(4000))
    allowed = {partition_shard("gpu", i, SHARDS) for i in range(4)}
    assert set(counts) == allowed
    assert min(counts.values()) > 800  # 1000 each on average
    assert worker_shard(["pool:gpu"], "w1", SHARDS, GPU) == worker_shard(["pool:gpu"], "w1", SHARDS, GPU)
    assert worker_shard(["pool:cpu"], "w1", SHARDS, GPU) == pool_shard("cpu", SHARDS)
    assert worker_shard([], "w1", SHARDS, GPU) == 0  # the default pool stays on shard 0


def test_a_session_key_keeps_every_plan_of_a_session_on_one_shard() -> None:
    """Plans with one session key share a shard whatever their ids; that shard is the key's partition."""
    shards = {submit_shard(submit(["pool:gpu"], session="chat-42", plan_id=f"p{i}"), SHARDS, GPU) for i in range(50)}
    assert shards == {partition_shard("gpu", partition_of("chat-42", 4), SHARDS)}
    spread = {submit_shard(submit(["pool:gpu"], session=f"chat-{i}"), SHARDS, GPU) for i in range(200)}
    assert len(spread) == 4


def test_a_plan_without_a_session_key_goes_by_its_id_and_the_store_agrees() -> None:
    """No session key: the plan id picks the partition (none: partition 0); shard_of gives the same shard."""
    s = submit(["gpu", "fast"], plan_id="abc")
    assert submit_shard(s, SHARDS, GPU) == partition_shard("gpu", partition_of("abc", 4), SHARDS)
    assert submit_shard(submit(["gpu"]), SHARDS, GPU) == pool_shard("gpu", SHARDS)
    created = PlanCreated("abc", "alice", 1, s)
    assert shard_of(created, SHARDS, GPU) == submit_shard(s, SHARDS, GPU)
    assert shard_of(created, SHARDS) == pool_shard("gpu", SHARDS)  # not split: the pool's shard
