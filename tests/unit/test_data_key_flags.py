"""The coordinator's data-plane key flags checked at start (``fleetwire coordinator``): kept apart from
test_tickets.py, which imports the core alone and so also runs against the compiled core (tools/build_compiled.py)."""

from __future__ import annotations

import pytest

from fleetwire.cli.main import build_parser
from fleetwire.cli.serve import server_settings


def test_the_coordinator_refuses_a_key_rotation_too_short_for_the_ticket_ttl_at_start() -> None:
    """``fleetwire coordinator --data-ticket-ttl 3600 --data-key-rotation 60``: refused naming both flags (the
    CLI's exit 2 for flags that cannot work together); TTL / 7 is accepted."""
    parser = build_parser()
    ns = parser.parse_args(["coordinator", "--insecure", "--data-ticket-ttl", "3600", "--data-key-rotation", "60"])
    with pytest.raises(ValueError, match="--data-key-rotation 60 is too short for --data-ticket-ttl 3600"):
        server_settings(ns, (), ())
    ns = parser.parse_args(["coordinator", "--insecure", "--data-ticket-ttl", "700", "--data-key-rotation", "101"])
    assert server_settings(ns, (), ()).core.data_key_rotation_s == 101.0


def test_the_start_check_counts_the_publish_delay_and_the_cluster_keys_overlap() -> None:
    """A key lives the TTL plus its successor's publish delay (--worker-reconnect-grace-s + 1 s: 6 s by default),
    and in cluster mode the shared key the TTL plus its publish delay (2 rounds + --lease-ttl + that grace + 1 s)
    and its rounds of overlap (2 rounds + --lease-ttl): 14 s by default. A rotation of exactly TTL / 7 would need a
    ninth key, and is refused naming the overlap and the shortest rotation that works."""
    parser = build_parser()
    single = ["coordinator", "--insecure", "--data-ticket-ttl", "700"]
    ns = parser.parse_args([*single, "--data-key-rotation", "100"])
    with pytest.raises(ValueError, match=r"plus 6 s while .* at least 100\.857 s \(\(TTL \+ 6\) / 7\)"):
        server_settings(ns, (), ())
    cluster = [*single, "--store", "postgresql://fw@127.0.0.1:1/fw"]
    ns = parser.parse_args([*cluster, "--data-key-rotation", "101"])
    with pytest.raises(ValueError, match=r"plus 14 s while .* at least 102 s \(\(TTL \+ 14\) / 7\)"):
        server_settings(ns, (), ())
    ns = parser.parse_args([*cluster, "--data-key-rotation", "102", "--lease-ttl", "3", "--lease-renew", "1"])
    assert server_settings(ns, (), ()).core.data_key_rotation_s == 102.0
    ns = parser.parse_args([*cluster, "--data-key-rotation", "102", "--lease-ttl", "10", "--lease-renew", "2"])
    with pytest.raises(ValueError, match=r"plus 30 s while"):  # 2 x (2 x 1 s + 10 s) + 5 s + 1 s
        server_settings(ns, (), ())
    ns = parser.parse_args([*cluster, "--data-key-rotation", "102", "--worker-reconnect-grace-s", "20"])
    with pytest.raises(ValueError, match=r"plus 29 s while"):  # 2 x (2 x 0.5 s + 3 s) + 20 s + 1 s
        server_settings(ns, (), ())
