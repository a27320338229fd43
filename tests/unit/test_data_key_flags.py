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
    ns = parser.parse_args(["coordinator", "--insecure", "--data-ticket-ttl", "700", "--data-key-rotation", "100"])
    assert server_settings(ns, (), ()).core.data_key_rotation_s == 100.0
