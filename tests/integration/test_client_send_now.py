"""The client's submits leave in the loop turn they were made, without waking the session's writer task.

fleetwire/client.py ``_send_now``/``_flush``: while the writer is parked with nothing queued, a callback of
the same turn writes every submit made in it as one frame (as the writer would have coalesced them); what
is queued while the writer runs, or a connection that would make a sender wait, still goes through it.
Against the scripted coordinator of tests/integration/test_client_sdk.py over loopback websockets.
"""

from __future__ import annotations

import asyncio

import pytest

from fleetwire import Client, submits
from tests.integration.test_client_sdk import CLIENT_TOKEN, FakeCoordinator, coordinator  # noqa: F401 (fixture)
from tests.waiting import until


async def test_sequential_submits_leave_without_waking_the_writer(coordinator: FakeCoordinator) -> None:  # noqa: F811
    """A caller's submits one at a time: each its own frame, in order, and the writer task is never woken."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        await until(lambda: client._parked, 5)
        rounds = client.writer_rounds
        for i in range(5):
            assert await (await client.submit("echo", args=i)).result() == i
        assert client.writer_rounds == rounds
    assert [frame for frame in coordinator.frames if "submit" in frame] == [["submit"]] * 5
    assert [s.args for s in coordinator.submits] == [0, 1, 2, 3, 4]


async def test_submits_of_one_turn_share_one_frame_and_a_busy_writer_takes_later_ones(
    coordinator: FakeCoordinator,  # noqa: F811
) -> None:
    """Submits made in the same turn go as one frame; one queued while the writer is woken goes through it."""
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        await until(lambda: client._parked, 5)
        plans = await asyncio.gather(*(client.submit("echo", args=i) for i in range(10)))
        assert [await plan.result() for plan in plans] == list(range(10))
        client._outbox_ready.set()  # the writer woken (as by another request): the next submit waits for it
        rounds = client.writer_rounds
        plan = await client.submit("echo", args=10)
        assert await plan.result() == 10 and client.writer_rounds == rounds + 1
    assert [frame for frame in coordinator.frames if "submit" in frame] == [["submit"] * 10, ["submit"]]


async def test_a_lone_submit_waits_on_a_future_of_its_own_not_a_batch(
    coordinator: FakeCoordinator,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``submit`` of one plan: the session's request with a plain future (``Client._submit_one``), not
    ``submit_many``'s batch waiter; answered, nothing is left pending, and a duplicate's flag still comes back."""

    def no_batch(*_args: object) -> None:
        raise AssertionError("a lone submit went through submits.await_accepted")

    monkeypatch.setattr(submits, "await_accepted", no_batch)
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        plan = await client.submit("echo", args=1, plan_id="lone-1")
        assert await plan.result() == 1 and not plan.duplicate
        assert client.session.pending_requests == 0
