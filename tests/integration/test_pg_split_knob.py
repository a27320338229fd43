"""FLEETWIRE_PG_SPLIT_MIN_PLANS: the PostgreSQL store's split threshold (PgStore.split_min_plans, docs/OPERATIONS.md's
environment table; docs/PERFORMANCE.md §C29r) read from the environment."""

from __future__ import annotations

import pytest

from coordinator.io.stores import postgres
from coordinator.io.stores.postgres import PgStore
from tests.integration.test_pg_store import CLUSTER, hold


def test_the_split_threshold_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole number sets it; 0 (never split) is kept; unset or blank is the default; anything else: the default,
    said."""
    monkeypatch.setenv(postgres.SPLIT_MIN_PLANS_ENV, "2000")
    assert postgres.split_min_plans_from_env() == 2000
    monkeypatch.setenv(postgres.SPLIT_MIN_PLANS_ENV, "0")
    assert postgres.split_min_plans_from_env() == 0
    monkeypatch.setenv(postgres.SPLIT_MIN_PLANS_ENV, " ")
    assert postgres.split_min_plans_from_env() == postgres._SPLIT_MIN_PLANS
    monkeypatch.delenv(postgres.SPLIT_MIN_PLANS_ENV)
    assert postgres.split_min_plans_from_env() == postgres._SPLIT_MIN_PLANS
    for bad in ("many", "-1", "1.5"):
        monkeypatch.setenv(postgres.SPLIT_MIN_PLANS_ENV, bad)
        with pytest.warns(UserWarning, match="not a whole number"):
            assert postgres.split_min_plans_from_env() == postgres._SPLIT_MIN_PLANS


def test_a_store_takes_its_split_threshold_from_the_environment(pg_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The store a coordinator opens splits by the variable's threshold (0: its big groups go whole)."""
    monkeypatch.setenv(postgres.SPLIT_MIN_PLANS_ENV, "0")
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert store.split_min_plans == 0
    finally:
        store.close()
    monkeypatch.delenv(postgres.SPLIT_MIN_PLANS_ENV)
    store = hold(PgStore(pg_dsn, CLUSTER))
    try:
        assert store.split_min_plans == postgres._SPLIT_MIN_PLANS
    finally:
        store.close()
