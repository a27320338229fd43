"""Review of 5ce510b (the SQLite store's writer process served on the event loop): its close with groups out.

The bug it found (a strict xfail here first) is fixed in coordinator/io/stores/writer_process.py: WriterProcess.leave()
reads the replies of the groups still out and answers each."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.io.stores.sqlite import SQLiteStore
from coordinator.io.stores.store import DB_FILE
from tests.integration.test_store_writer_process import plan, ready_child, started

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SQLiteStore]:
    opened = SQLiteStore(tmp_path / DB_FILE)
    opened.hand_writes_to_process()
    yield opened
    opened.close()


async def test_a_store_closed_with_groups_out_answers_them_and_the_committers_close_returns(
    store: SQLiteStore,
) -> None:
    """The store closed (in a thread, as CoordinatorServer.stop does) while the loop's groups wait for replies:
    each group is answered, released or failed (commit-before-send: failed is safe), and the committer's close
    after it returns instead of waiting for answers nobody reads any more."""
    seen, committer = started(store, inline_max_records=0)
    ready_child(store)
    for n in range(1, 50):
        committer.submit(plan(f"p{n}", n), n)
    await asyncio.to_thread(store.close)
    async with asyncio.timeout(5):
        await committer.close()
    assert len(seen) == 49 or seen.errors
