"""pg_commit.reopen: both PostgreSQL committers' retry of a lost store connection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from coordinator.io.stores.pg_commit import reopen


class Flaky:
    """A store whose connection opens on the ``fails + 1``-th try."""

    description = "flaky"

    def __init__(self, fails: int) -> None:
        self.fails, self.tries = fails, 0
        self.on_lost: Callable[[], None] | None = None

    async def open_async(self, on_lost: Callable[[], None] | None = None) -> None:
        self.tries += 1
        if self.tries <= self.fails:
            raise OSError("connection refused")
        self.on_lost = on_lost


def test_retries_until_the_connection_opens() -> None:
    store = Flaky(fails=2)

    def kick() -> None:
        pass

    assert asyncio.run(reopen(store, kick, lambda: False)) is True
    assert store.tries == 3 and store.on_lost is kick


def test_stops_trying_once_stopped() -> None:
    store = Flaky(fails=10**6)
    stop_after = 2

    def stopped() -> bool:
        return store.tries >= stop_after

    assert asyncio.run(reopen(store, lambda: None, stopped)) is False
    assert store.tries == stop_after


def test_a_stopped_committer_does_not_try() -> None:
    store = Flaky(fails=0)
    assert asyncio.run(reopen(store, lambda: None, lambda: True)) is False
    assert store.tries == 0
