"""The relay's memory, and who gets it (issue #24, the relay hog): :class:`RelayRoom`.

What it owns: the three limits on the relayed streams' windows held (``max_bytes`` in all,
``--relay-max-bytes``; ``principal_bytes`` for one principal's sessions; ``session_bytes`` for one
client session: protocol/relay.py ``default_shares``, half and a quarter), the bytes each
principal and session holds, and the *line* of streams waiting for room. What it does not: the
streams themselves, their credit, and what their parties are told (coordinator/relay.py).

Rules:

* A window is held whole or not at all, and only while all three limits stay met; every stream's
  window is the same (``min(window_bytes, session_bytes, principal_bytes, max_bytes)``), so a
  stream that waits always fits once others give theirs back.
* The line is served oldest first, but a stream whose own session or principal is full does not
  hold up the others behind it (:meth:`RelayRoom.served`).
* Why a stream has no room names the limit it would pass and the flag that sets it.

Pure: no clock, no I/O; the relay hands each stream in.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from protocol.relay import MAX_CHUNK_BYTES, default_shares

__all__ = ["RelayRoom", "RoomHolder"]


class RoomHolder(Protocol):
    """What the room reads of a stream: its key, its client session, its principal and its window."""

    @property
    def key(self) -> tuple[str, int, str, str]: ...
    @property
    def client(self) -> int: ...
    @property
    def principal(self) -> str: ...
    @property
    def window(self) -> int: ...


H = TypeVar("H", bound=RoomHolder)
_Who = TypeVar("_Who", str, int)


class RelayRoom(Generic[H]):
    """The windows held and the streams waiting for room.

    Args:
        window_bytes: a stream's window asked for (the window each gets is at most every limit).
        max_bytes: the windows held by all streams together.
        principal_bytes: ... by one principal's streams (0: half of ``max_bytes``).
        session_bytes: ... by one client session's streams (0: a quarter of ``max_bytes``).

    Raises:
        ValueError: a limit or the window is smaller than one chunk.
    """

    def __init__(self, *, window_bytes: int, max_bytes: int, principal_bytes: int = 0, session_bytes: int = 0) -> None:
        default_principal, default_session = default_shares(max_bytes)
        principal_bytes = principal_bytes or default_principal
        session_bytes = session_bytes or default_session
        if min(window_bytes, max_bytes, principal_bytes, session_bytes) < MAX_CHUNK_BYTES:
            raise ValueError(f"the relay's window, max bytes and shares must be at least one chunk ({MAX_CHUNK_BYTES} "
                             "bytes)")  # fmt: skip
        self.max_bytes = max_bytes
        self.principal_bytes = principal_bytes
        self.session_bytes = session_bytes
        self.window_bytes = min(window_bytes, session_bytes, principal_bytes, max_bytes)  # every stream's window
        self.reserved = 0  # the windows held, together
        self._line: dict[tuple[str, int, str, str], H] = {}  # streams waiting for room, oldest first
        self._held_by_principal: dict[str, int] = {}
        self._held_by_session: dict[int, int] = {}

    @property
    def waiting(self) -> int:
        """Streams waiting in line for room."""
        return len(self._line)

    def no_room(self, stream: H) -> str | None:
        """Why ``stream``'s window cannot be held now (naming the limit), or None."""
        window = stream.window
        held = self._held_by_session.get(stream.client, 0)
        if held + window > self.session_bytes:
            return (f"this session's relayed streams hold {held} bytes, and a stream's window of {window} would pass "
                    f"its share of {self.session_bytes} (--relay-session-bytes)")  # fmt: skip
        held = self._held_by_principal.get(stream.principal, 0)
        if held + window > self.principal_bytes:
            return (f"principal {stream.principal!r}'s relayed streams hold {held} bytes, and a stream's window of "
                    f"{window} would pass its share of {self.principal_bytes} (--relay-principal-bytes)")  # fmt: skip
        if self.reserved + window > self.max_bytes:
            return (f"the relay holds {self.reserved} bytes of windows, and one more of {window} would pass its "
                    f"{self.max_bytes} (--relay-max-bytes)")  # fmt: skip
        return None

    def hold(self, stream: H) -> None:
        """Count ``stream``'s window as held (there is room: :meth:`no_room`)."""
        window = stream.window
        self.reserved += window
        self._held_by_principal[stream.principal] = self._held_by_principal.get(stream.principal, 0) + window
        self._held_by_session[stream.client] = self._held_by_session.get(stream.client, 0) + window

    def give_back(self, stream: H) -> None:
        """``stream``'s window held no more (its stream ended): :meth:`served` may find room for the line."""
        window = stream.window
        self.reserved -= window
        _take(self._held_by_principal, stream.principal, window)
        _take(self._held_by_session, stream.client, window)

    def wait(self, stream: H) -> int:
        """``stream`` in line for room, behind the others; how many streams are ahead of it."""
        self._line[stream.key] = stream
        return len(self._line) - 1

    def leave_line(self, stream: H) -> None:
        """A waiting ``stream`` ended."""
        del self._line[stream.key]

    def served(self) -> list[H]:
        """The waiting streams that fit now, oldest first, each out of the line and its window held."""
        found: list[H] = []
        for stream in list(self._line.values()):
            if self.reserved + self.window_bytes > self.max_bytes:
                break
            if self.no_room(stream) is None:
                del self._line[stream.key]
                self.hold(stream)
                found.append(stream)
        return found


def _take(held: dict[_Who, int], who: _Who, window: int) -> None:
    """Give back ``who``'s ``window`` (its entry goes once it holds nothing)."""
    left = held[who] - window
    if left:
        held[who] = left
    else:
        del held[who]
