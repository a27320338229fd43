"""A graceful stop closes the listening socket before it waits for pending commits (server.py ``stop``)."""

from __future__ import annotations

import asyncio

import pytest

from protocol.messages import Ack
from tests.integration.test_ack_rides import frame, stopping_on_a_pending_commit

pytestmark = pytest.mark.timeout(30)


async def test_a_connection_during_the_stops_wait_for_commits_is_refused() -> None:
    """While the stop waits for a commit still pending (flush_acks), a new TCP connection is refused; the open
    worker still reads its ack once the commit ends."""
    async with stopping_on_a_pending_commit() as (srv, worker, stopping):
        assert not stopping.done()  # still in the wait for the held commit
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", srv.port)
    assert await frame(worker) == [Ack(seq=2)]
