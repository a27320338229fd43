"""wireio/frame_sink.py SinkReceive, the one frame sink of the SDK's and worker's connections (SinkConnection) and the
coordinator's (FailFastConnection): whole binary frames to the sink; text frames too only where ``takes_text`` (the
coordinator's hook), where the sink may also refuse a frame; a refusal, a fragment or a text frame it does not take
detaches the sink, and the library's queue gets that frame and every later one; a lost connection detaches it."""

from __future__ import annotations

from typing import Any

import pytest
from websockets.frames import Frame, Opcode

from coordinator.io.frontdoor.connection import FailFastConnection
from wireio.frame_sink import SinkConnection, SinkReceive


class Recorder:
    """A sink that takes what ``take`` says, and records every call."""

    def __init__(self, take: bool = True) -> None:
        self.take = take
        self.calls: list[Any] = []

    def frame(self, data: bytes | bytearray | memoryview, text: bool) -> bool:
        self.calls.append((bytes(data), text))
        return self.take

    def fallback(self) -> None:
        self.calls.append("fallback")

    def lost(self) -> None:
        self.calls.append("lost")


def library_queue(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[Any]:
    """What reaches the library's own ``process_event`` (its message queue) past the sink."""
    queued: list[Any] = []
    base = next(c for c in cls.__mro__ if c is not SinkReceive and "process_event" in vars(c) and c is not cls)
    monkeypatch.setattr(base, "process_event", lambda self, event: queued.append(event))
    return queued


def connection(cls: type, sink: Recorder) -> Any:
    conn = object.__new__(cls)  # no transport: process_event alone
    conn.frame_sink = sink
    return conn


@pytest.mark.parametrize("cls", [SinkConnection, FailFastConnection])
def test_binary_frames_go_to_the_sink_and_a_fragment_detaches_it(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    queued = library_queue(monkeypatch, cls)
    sink = Recorder()
    conn = connection(cls, sink)
    conn.process_event(Frame(Opcode.BINARY, b"one"))
    conn.process_event(Frame(Opcode.BINARY, b"part", fin=False))
    conn.process_event(Frame(Opcode.CONT, b"rest"))
    assert sink.calls == [(b"one", False), "fallback"]
    assert [bytes(f.data) for f in queued] == [b"part", b"rest"] and conn.frame_sink is None


def test_a_text_frame_detaches_the_sdks_sink_and_the_coordinators_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    queued = library_queue(monkeypatch, SinkConnection)
    sdk = Recorder()
    conn = connection(SinkConnection, sdk)
    conn.process_event(Frame(Opcode.TEXT, b"hi"))
    assert sdk.calls == ["fallback"] and [f.data for f in queued] == [b"hi"]
    queued = library_queue(monkeypatch, FailFastConnection)
    door = Recorder()
    conn = connection(FailFastConnection, door)
    conn.process_event(Frame(Opcode.TEXT, b"hi"))
    assert door.calls == [(b"hi", True)] and not queued and conn.frame_sink is door


def test_a_frame_the_coordinators_sink_refuses_goes_to_the_library_and_so_does_every_later_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queued = library_queue(monkeypatch, FailFastConnection)
    door = Recorder(take=False)
    conn = connection(FailFastConnection, door)
    conn.process_event(Frame(Opcode.TEXT, b"\xff"))
    conn.process_event(Frame(Opcode.BINARY, b"later"))
    assert door.calls == [(b"\xff", True), "fallback"]
    assert [f.data for f in queued] == [b"\xff", b"later"]


@pytest.mark.parametrize("cls", [SinkConnection, FailFastConnection])
def test_a_lost_connection_detaches_the_sink_once(monkeypatch: pytest.MonkeyPatch, cls: type) -> None:
    base = next(c for c in cls.__mro__ if c is not SinkReceive and "connection_lost" in vars(c) and c is not cls)
    monkeypatch.setattr(base, "connection_lost", lambda self, exc: None)
    sink = Recorder()
    conn = connection(cls, sink)
    conn.connection_lost(None)
    conn.connection_lost(None)
    assert sink.calls == ["lost"] and conn.frame_sink is None
