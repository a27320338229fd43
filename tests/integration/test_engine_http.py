"""The inference handler's HTTP client (worker_agent/engine_http.py) over loopback: kept-alive connections,
the engine's close of an idle one, silence, and a stream left before its end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from protocol import errors
from tests.integration.test_inference import _context
from worker_agent.engine_http import EngineClient, EngineProtocolError
from worker_agent.handlers import HandlerError
from worker_agent.inference import InferenceEngine

pytestmark = pytest.mark.timeout(30)

CHAT = {"messages": [{"role": "user", "content": "a b c"}], "model": "m1"}
SSE = (b'data: {"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":"stop"}]}\n\n'
       b"data: [DONE]\n\n")  # fmt: skip
ANSWER = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
          + b"%x\r\n%b\r\n0\r\n\r\n" % (len(SSE), SSE))  # fmt: skip


@pytest.fixture
async def raw_engine() -> AsyncIterator[Callable[..., Any]]:
    """A loopback server whose answer to each request is ``answer(count)`` (None: say nothing); ``close`` after
    it closes the connection, as an engine closes an idle kept-alive one."""
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(answer: Callable[[int], bytes | list[bytes] | None], *, close: bool = False,
                    ) -> tuple[str, list[int]]:  # fmt: skip
        accepted: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(1)
            writers.append(writer)
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    break
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                data = answer(len(accepted))
                if data is None:
                    await asyncio.sleep(10)
                    break
                for piece in [data] if isinstance(data, bytes) else data:  # pieces: written 20 ms apart
                    writer.write(piece)
                    await writer.drain()
                    if not isinstance(data, bytes):
                        await asyncio.sleep(0.02)
                if close:
                    break
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted

    yield start
    for server in servers:
        server.close()
    for writer in writers:
        writer.close()
    await asyncio.sleep(0)  # the transports' close callbacks run


async def test_a_stream_read_to_done_gives_its_connection_back_for_the_next_plan(raw_engine: Any) -> None:
    """Three generate plans in a row take one kept-alive connection to the engine, the body's end coming 20 ms after
    [DONE] (before: a connection each, the stream left at [DONE] before its body's end)."""
    url, accepted = await raw_engine(lambda n: [ANSWER[:-5], ANSWER[-5:]])
    engine = InferenceEngine(url, model="m1", metrics_url=None)
    try:
        for _ in range(3):
            assert (await engine.generate(_context([]), CHAT))["text"] == "hi"
    finally:
        await engine.aclose()
    assert len(accepted) == 1


async def test_an_idle_connection_the_engine_closed_is_retried_on_a_new_one(raw_engine: Any) -> None:
    """An engine that closes each connection after its answer: the next plan finds the kept one closed (or closing)
    and is sent again on a new connection, and succeeds."""
    url, accepted = await raw_engine(lambda n: ANSWER, close=True)
    engine = InferenceEngine(url, model="m1", metrics_url=None)
    try:
        for _ in range(3):
            assert (await engine.generate(_context([]), CHAT))["text"] == "hi"
    finally:
        await engine.aclose()
    assert len(accepted) == 3


async def test_an_engine_silent_past_the_read_timeout_fails_the_plan(raw_engine: Any) -> None:
    """No answer within read_timeout_s: the plan fails engine_error saying the engine sent nothing."""
    url, _ = await raw_engine(lambda n: None)
    engine = InferenceEngine(url, model="m1", metrics_url=None, read_timeout_s=0.2)
    try:
        with pytest.raises(HandlerError) as caught:
            await engine.generate(_context([]), CHAT)
    finally:
        await engine.aclose()
    assert caught.value.code == errors.ENGINE_ERROR and "sent nothing for 0.2 s" in caught.value.message


async def test_a_cut_answer_fails_and_its_connection_is_not_kept(raw_engine: Any) -> None:
    """A body cut before its end: the plan fails engine_error; the next plan gets a new connection."""
    url, accepted = await raw_engine(lambda n: ANSWER[:-20] if n == 1 else ANSWER, close=True)
    client = EngineClient(url, read_timeout_s=5.0)
    with pytest.raises(EngineProtocolError) as caught:
        async with client.post("/v1/chat/completions", b"{}") as response:
            await response.read()
    assert "before its answer's end" in str(caught.value) and not client._idle
    async with client.post("/v1/chat/completions", b"{}") as response:
        assert b"[DONE]" in await response.read()
    client.close()
    assert client.connections_made == 2 and len(accepted) == 2
