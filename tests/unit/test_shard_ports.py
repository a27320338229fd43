"""`--shard-ports`: what it takes, and the ranges and modes it refuses with a line naming it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from coordinator.io.cluster.host import ClusterHost
from coordinator.io.frontdoor.server import ServerSettings
from coordinator.shards import ClusterConfig
from fleetwire.cli.shards import parse_shard_ports


def test_a_range_or_a_first_port_for_every_shard() -> None:
    """FIRST-LAST as given; FIRST alone: --shards ports from FIRST."""
    assert parse_shard_ports("9100-9131", 16) == (9100, 9131)
    assert parse_shard_ports("9100", 16) == (9100, 9115)


@pytest.mark.parametrize(("text", "says"), [
    ("ports", "--shard-ports takes a port range FIRST-LAST"),
    ("9100-x", "--shard-ports takes a port range FIRST-LAST"),
    ("9200-9100", "--shard-ports 9200-9100: ports run from 1 to 65535"),
    ("65530", "--shard-ports 65530-65545: ports run from 1 to 65535"),
])
def test_a_malformed_range_is_refused_naming_it(text: str, says: str) -> None:
    """Not numbers, reversed, or past 65535: a ValueError saying so."""
    with pytest.raises(ValueError, match=says):
        parse_shard_ports(text, 16)


def test_a_range_smaller_than_the_shard_count_is_refused() -> None:
    """A coordinator alone serves every shard, so the range must hold one port per shard."""
    settings = ServerSettings(port=0, insecure=True, store="postgresql://nobody@127.0.0.1:1/none",
                              cluster=ClusterConfig(shards=4))
    with pytest.raises(ValueError, match="at least 4 ports"):
        ClusterHost(settings, shard_ports=(9100, 9102))


def test_shard_ports_without_cluster_mode_exits_2() -> None:
    """A single coordinator has no shard cores: the flag is refused before anything listens."""
    done = subprocess.run([sys.executable, "-m", "fleetwire", "coordinator", "--insecure", "--store", "memory",
                           "--port", "0", "--shard-ports", "9100"], capture_output=True, text=True, timeout=60,
                          check=False)  # fmt: skip
    assert done.returncode == 2 and "--shard-ports is for cluster mode" in done.stderr, done.stderr
