"""Fixtures shared by integration test modules (tests/conftest.py holds the suite-wide ones)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from websockets.frames import Frame

from coordinator.io.stores.postgres import PgStore


@pytest.fixture
def library_frames(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Frame]]:
    """Every frame websockets' own send serializes, on both ends of a test's connections (wireio/wsmask.py writes
    its frames past the library: test_wsmask, test_wsmask_server)."""
    serialized: list[Frame] = []
    real = Frame.serialize

    def counting(self: Frame, **kwargs: Any) -> bytes:
        serialized.append(self)
        return real(self, **kwargs)

    monkeypatch.setattr(Frame, "serialize", counting)
    yield serialized


@pytest.fixture
async def held_store(pg_dsn: str) -> AsyncIterator[PgStore]:
    """A PostgreSQL store holding every shard's lease (test_pg_store ``hold``: a core that holds them all), open on
    the test's loop (open_async), closed after."""
    from tests.integration.test_pg_store import CLUSTER, hold  # (a test module's helpers: imported when used)

    db = hold(PgStore(pg_dsn, CLUSTER))
    await db.open_async()
    yield db
    await db.close_async()
    db.close()
