"""Fixtures shared by every test layer: a real PostgreSQL server (tests/pg.py) for the cluster-mode tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.no_nvml import pynvml as no_nvml
from tests.pg import PostgresServer, missing_reason, postgres_server


@pytest.fixture(scope="session", autouse=True)
def _no_real_nvml() -> Iterator[None]:
    """No test meets a GPU host's real NVML (tests/no_nvml/pynvml.py says why); a test's own fake still wins."""
    saved = sys.modules.get("pynvml")
    sys.modules["pynvml"] = no_nvml  # type: ignore[assignment]
    yield
    if saved is None:
        sys.modules.pop("pynvml", None)
    else:
        sys.modules["pynvml"] = saved


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (skips with the reason when PostgreSQL or asyncpg is missing)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    with postgres_server() as server:
        yield server


@pytest.fixture
def pg_dsn(postgres: PostgresServer) -> str:
    """The DSN of a fresh, empty database on the session's PostgreSQL server."""
    return postgres.new_database()
