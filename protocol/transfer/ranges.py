"""Byte ranges of the data plane's HTTP requests and answers (docs/PROTOCOL.md §Data plane).

An upload from an offset says ``Content-Range: bytes S-E/SIZE`` (E inclusive, the body's length
E - S + 1); a download from an offset says ``Range: bytes=N-`` or ``bytes=N-M`` and its ``206``
answer ``Content-Range: bytes S-E/SIZE``; a range outside the output is answered ``416`` with
``Content-Range: bytes */SIZE``. Parsing refuses anything else with a :class:`RangeError` that
names the header and what was expected. No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["RangeError", "content_range", "parse_content_range", "parse_range", "range_from", "unsatisfied"]


class RangeError(ValueError):
    """A range header that cannot be served: ``status`` (400 or 416) and the headers to answer with."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


def content_range(start: int, end: int, size: int) -> str:
    """``bytes S-E/SIZE`` for bytes [start, end) of ``size``."""
    return f"bytes {start}-{end - 1}/{size}"


def range_from(offset: int) -> str:
    """``bytes=N-``: everything from ``offset``."""
    return f"bytes={offset}-"


def unsatisfied(size: int) -> str:
    """``bytes */SIZE``: the ``Content-Range`` of a ``416``."""
    return f"bytes */{size}"


def parse_content_range(value: str, length: int) -> tuple[int, int]:
    """An upload's ``bytes S-E/SIZE`` -> (S, SIZE), checked against the body's ``length``.

    Raises:
        RangeError: 400, not of that form or not the body's length.
    """
    unit, _, spec = value.partition(" ")
    span, _, total_text = spec.partition("/")
    first, _, last = span.partition("-")
    try:
        start, end, total = int(first), int(last), int(total_text)
    except ValueError:
        raise RangeError(400, f"bad Content-Range {value!r}: expected 'bytes START-END/SIZE'") from None
    if unit != "bytes" or start < 0 or (length and end - start + 1 != length) or total < 0:
        raise RangeError(400, f"bad Content-Range {value!r} for a body of {length} bytes")
    return start, total


def parse_range(value: str, size: int) -> tuple[int, int]:
    """A download's ``bytes=N-`` or ``bytes=N-M`` -> [start, end) within ``size``.

    Raises:
        RangeError: 416 (with ``Content-Range: bytes */SIZE``), not of that form or outside the output.
    """
    unit, _, spec = value.partition("=")
    first, _, last = spec.partition("-")
    try:
        start = int(first)
        end = int(last) + 1 if last else size
    except ValueError:
        raise RangeError(416, f"unsupported Range {value!r}: use 'bytes=START-' or 'bytes=START-END'",
                         {"Content-Range": unsatisfied(size)}) from None
    end = min(end, size)
    if unit != "bytes" or start < 0 or (start >= end and size):
        raise RangeError(416, f"Range {value!r} is outside the output's {size} bytes",
                         {"Content-Range": unsatisfied(size)})
    return start, end
