"""The SDK's session frames dispatched in the connection's ``process_event`` (wireio/frame_sink.py, issue #29).

Against the scripted coordinator of tests/integration/test_client_sdk.py over loopback websockets: the coordinator's
frames reach ``ClientSession.receive_frame`` from the sink, not through websockets' queue and the reader's step; a
dispatch that raises still closes the connection with ``CLOSE_INTERNAL``, as the ``async for`` loop did.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fleetwire import Client
from protocol import errors as codes
from tests.integration.test_client_sdk import CLIENT_TOKEN, FakeCoordinator, coordinator  # noqa: F401 (fixture)
from tests.waiting import until
from wireio.frame_sink import SinkConnection


async def test_the_coordinators_frames_reach_the_session_through_the_sink(
    coordinator: FakeCoordinator,  # noqa: F811
) -> None:
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        ws: Any = client._ws
        assert isinstance(ws, SinkConnection)
        await until(lambda: ws.frame_sink is not None, 5)
        sink = ws.frame_sink
        before = sink.frames
        for i in range(5):
            assert await (await client.submit("echo", args=i)).result() == i
        assert sink.frames >= before + 5  # each plan's reply and events, dispatched where they were read
        assert sink.answered and ws.frame_sink is sink


async def test_a_dispatch_that_raises_in_the_sink_closes_the_connection_with_internal_error(
    coordinator: FakeCoordinator,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with Client(coordinator.url, token=CLIENT_TOKEN) as client:
        ws: Any = client._ws
        await until(lambda: ws.frame_sink is not None, 5)
        sink = ws.frame_sink

        def broken(frame: bytes | str) -> None:
            raise RuntimeError("dispatch failed")

        monkeypatch.setattr(client._session, "receive_frame", broken)
        asyncio.ensure_future(client.submit("echo", args=1)).add_done_callback(lambda f: f.cancelled() or f.exception())
        await until(lambda: ws.close_code is not None, 10)
        assert ws.close_code == codes.CLOSE_INTERNAL and sink.frames >= 1
