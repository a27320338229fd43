"""Relayed chunks decoded without copying their bytes, and passed on as the frame they came in.

A ``data_chunk`` that a relay hop decodes only to check and pass on need not have its ``data``
copied out of the frame: :class:`DataChunkView` is :class:`~protocol.messages.DataChunk` (the same
tag, the same fields, an instance of it) whose ``data`` msgspec decodes from msgpack as a
``memoryview`` into the frame instead of a new ``bytes``. :func:`with_chunk_views` swaps it into
a decoding union; only msgpack codecs should use it (a JSON frame's base64 is decoded into a new
buffer anyway).

A chunk that came alone in its frame and goes on alone needs no encoding at all when that frame
is byte for byte what encoding the chunk would give: :func:`own_frame` checks it (the bytes
around ``data`` against the chunk encoded with a one-byte placeholder: a few hundred bytes
compared, none of the data copied) and gives the frame back, so a writer sends it as is (the
coordinator's relay: coordinator/io/frontdoor/connection.py). So the receiver reads exactly what the relay
checked: a frame with other fields, duplicated keys or another integer width is encoded afresh.

No I/O.
"""

from __future__ import annotations

from typing import Any, Union, get_args

import msgspec

from protocol.messages import DataChunk

__all__ = ["DataChunkView", "compact", "frame_into", "own_frame", "with_chunk_views"]

#: Bytes a passed-on chunk's frame may have besides its data (its names and offsets).
MAX_OVERHEAD = 1024
_ENCODER = msgspec.msgpack.Encoder()
_MARK = b"\xa4data\xc4\x01\x00"  # the key "data" and a one-byte bin: where the placeholder sits


class DataChunkView(DataChunk, tag="data_chunk"):
    """A ``data_chunk`` whose ``data`` is a view into the frame it was decoded from (msgpack)."""

    data: memoryview = memoryview(b"")  # type: ignore[assignment]


def with_chunk_views(union: Any, encoding: str = "msgpack") -> Any:
    """``union`` (e.g. ``FromClient``) with ``DataChunk`` decoded as :class:`DataChunkView` by a msgpack codec;
    ``union`` as it is for another ``encoding`` (JSON's base64 is decoded into a new buffer anyway)."""
    if encoding != "msgpack":
        return union
    return Union[tuple(DataChunkView if member is DataChunk else member for member in get_args(union))]


def compact(msg: Any, max_overhead: int = MAX_OVERHEAD) -> Any:
    """``msg``, or a copy whose ``data`` is its own ``bytes`` when its view would keep a much larger frame alive.

    A relay that holds a window of chunks must hold that many bytes, not that many frames: a chunk
    that shared its frame with other bulk (other messages, unknown fields) is copied out of it.
    """
    data = getattr(msg, "data", None)
    if type(data) is memoryview and memoryview(data.obj).nbytes - data.nbytes > max_overhead:
        return msgspec.structs.replace(msg, data=data.tobytes())
    return msg


def own_frame(msg: Any, max_overhead: int = MAX_OVERHEAD) -> bytes | None:
    """The msgpack frame ``msg`` was decoded from, when it held ``msg`` alone; else None.

    ``msg`` must be a :class:`DataChunkView` from a msgpack decoder (its ``data`` views the frame);
    code that builds a chunk builds a :class:`~protocol.messages.DataChunk`.
    """
    if type(msg) is not DataChunkView:
        return None
    data = msg.data
    if type(data) is not memoryview:
        return None
    frame, size = data.obj, data.nbytes
    if type(frame) is not bytes or not size or not 0 < len(frame) - size <= max_overhead:
        return None
    shape = _ENCODER.encode(msgspec.structs.replace(msg, data=b"\x00"))
    at = shape.find(_MARK)
    if at < 0:
        return None
    head = shape[: at + 5] + _bin_header(size)
    tail = shape[at + len(_MARK) :]
    if len(frame) != len(head) + size + len(tail) or not frame.startswith(head) or not frame.endswith(tail):
        return None
    return frame


def frame_into(buffer: bytearray, msg: DataChunk, size: int) -> tuple[memoryview, memoryview]:
    """The msgpack frame of ``msg`` with ``size`` bytes of data, laid out in ``buffer`` with its data left to fill.

    Returns the frame (a view of the start of ``buffer``) and the view of its data (what the
    sender reads its bytes into, so they are never encoded, i.e. copied, again). The frame is
    byte for byte what encoding ``msg`` with those bytes gives (``msg.data`` is ignored).

    Raises:
        ValueError: ``size`` is not positive (an empty ``data`` is left out of the frame), or ``buffer`` is
            shorter than the frame (``size`` + :data:`MAX_OVERHEAD` is always enough).
    """
    if size < 1:
        raise ValueError(f"a chunk's data must have a byte at least, not {size}")
    shape = _ENCODER.encode(msgspec.structs.replace(msg, data=b"\x00"))
    at = shape.find(_MARK)
    if at < 0:
        raise ValueError("data_chunk encoded without its data field")
    head = shape[: at + 5] + _bin_header(size)
    tail = shape[at + len(_MARK) :]
    end = len(head) + size + len(tail)
    if end > len(buffer):
        raise ValueError(f"a frame of {end} bytes does not fit a buffer of {len(buffer)}")
    frame = memoryview(buffer)[:end]
    frame[: len(head)] = head
    frame[end - len(tail) :] = tail
    return frame, frame[len(head) : end - len(tail)]


def _bin_header(size: int) -> bytes:
    """msgpack's header of a ``bin`` of ``size`` bytes, in its shortest form (as msgspec writes it)."""
    if size < 1 << 8:
        return bytes((0xC4, size))
    if size < 1 << 16:
        return b"\xc5" + size.to_bytes(2, "big")
    return b"\xc6" + size.to_bytes(4, "big")
