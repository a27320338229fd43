"""The PostgreSQL store calls asyncpg's private protocol only for the releases it knows that call in."""

from __future__ import annotations

from coordinator.io.stores.postgres import PROTOCOL_CALL_RELEASES, protocol_call_known


def test_known_releases_take_the_protocol_call() -> None:
    for major, minor in PROTOCOL_CALL_RELEASES:
        assert protocol_call_known(f"{major}.{minor}.0")
        assert protocol_call_known(f"{major}.{minor}.3.dev0")


def test_other_releases_run_as_prepared_statements() -> None:
    for version in ("0.28.0", "0.33.0", "1.0.0", "", "unknown", "0"):
        assert not protocol_call_known(version), version
