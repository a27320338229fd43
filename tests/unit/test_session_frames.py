"""The coordinator's per-session writer cuts a large backlog into frames peers accept."""

from __future__ import annotations

from typing import Any

import msgspec

from coordinator.io.frontdoor.connection import MAX_OUT_FRAME_BYTES, Session
from protocol import Codec
from protocol.messages import Event, ToClient


def _split(batch: list[Any]) -> list[bytes]:
    session = Session(conn_id=1, ws=None, codec=Codec("msgpack", ToClient, "client"))  # type: ignore[arg-type]
    return session._frames(batch)


def _decoded(frames: list[bytes]) -> list[Any]:
    codec = Codec("msgpack", ToClient, "coordinator")
    return [msg for frame in frames for msg in codec.decode(frame)]


def test_small_batch_is_one_frame() -> None:
    """A batch under the limit goes out as exactly one frame."""
    batch = [Event(plan_id="p", kind="log", data="x" * 100, seq=i) for i in range(50)]
    frames = _split(batch)
    assert len(frames) == 1 and _decoded(frames) == batch


def test_large_backlog_is_cut_under_the_limit_in_order() -> None:
    """A backlog above the limit becomes several frames, each within it, with every message in order."""
    batch = [Event(plan_id="p", kind="log", data="y" * 4096, seq=i) for i in range(400)]
    frames = _split(batch)
    assert len(frames) >= 3
    assert all(len(frame) <= MAX_OUT_FRAME_BYTES for frame in frames)
    assert _decoded(frames) == batch


def test_messages_larger_than_their_estimate_still_fit() -> None:
    """Payloads the size estimate cannot see (nested data) are still split under the limit."""
    batch = [Event(plan_id="p", kind="log", data={"blob": "z" * 8192}, seq=i) for i in range(200)]
    frames = _split(batch)
    assert all(len(frame) <= MAX_OUT_FRAME_BYTES for frame in frames)
    assert [m.seq for m in _decoded(frames)] == list(range(200))
    assert msgspec.msgpack.decode(frames[0])[0]["data"]["blob"] == "z" * 8192
