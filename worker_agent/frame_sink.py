"""The worker agent's session frames dispatched where they are read (issue #29): ``wireio/frame_sink.py``.

:class:`FrameSink` here is that one with the session's codec: each frame decoded and its messages dispatched in the
connection's ``process_event`` (:class:`SinkConnection`), past websockets' queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from protocol import Codec
from wireio.frame_sink import FrameSink as _FrameSink
from wireio.frame_sink import SinkConnection

__all__ = ["FrameSink", "SinkConnection"]


class FrameSink(_FrameSink):
    """A session's frames decoded with ``codec`` and each message given to ``dispatch`` (which never awaits)."""

    def __init__(self, codec: Codec, dispatch: Callable[[Any], None]) -> None:
        super().__init__(dispatch, codec.decode, text=codec.text)
