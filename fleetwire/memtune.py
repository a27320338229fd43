"""The C allocator's top pad, raised once per process so big buffers stop costing page faults (glibc only).

Why: moving bytes through the ``websockets`` library allocates and frees a buffer or two of
frame size (up to 1 MiB) per frame: the reader's buffer grows by each read, a frame's bytes
are sliced out, masked and serialized into new objects. glibc serves those from the top of its
heap, and with the default ``M_TOP_PAD`` (128 KiB) it returns the top to the kernel as soon as it
is free and takes it back (``brk``) for the next frame: every 4 KiB page of every frame is a
fresh page fault and a zeroed page. Measured on a 2-core VM (bench/data_plane.py, 1 GiB through
one websocket connection, library defaults): 1.0 GB/s and 1.7 CPU-seconds; with a 64 MiB top pad
1.9 GB/s and 1.05 CPU-seconds. fleetwire's coordinator relay, worker and client gain the same way.

What it costs: up to the pad (64 MiB by default) of freed heap stays mapped at the top of the
heap instead of going back to the kernel at once; ``malloc_trim`` and the next big free still
return what lies beyond it. Set ``FLEETWIRE_MALLOC_TOP_PAD`` (bytes, ``0``: leave the allocator as
it is) to change it. Applied by every ``fleetwire`` command (coordinator, worker, CLI) and by the
first :class:`fleetwire.Client` of a process; a no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Final

__all__ = ["DEFAULT_TOP_PAD", "ENV", "tune_allocator"]

ENV: Final = "FLEETWIRE_MALLOC_TOP_PAD"
DEFAULT_TOP_PAD: Final = 64 << 20
_M_TOP_PAD: Final = -2  # glibc's malloc.h
_lock = threading.Lock()
_applied: int | None = None


def tune_allocator() -> int:
    """Raise glibc's ``M_TOP_PAD`` once per process; the pad now in effect (0: untouched).

    Raises:
        ValueError: ``FLEETWIRE_MALLOC_TOP_PAD`` is not a whole number of bytes ≥ 0.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return _applied
        text = os.environ.get(ENV, "").strip()
        try:
            pad = int(text) if text else DEFAULT_TOP_PAD
        except ValueError:
            pad = -1
        if pad < 0 or pad >= 1 << 31:
            raise ValueError(f"{ENV} must be a number of bytes from 0 to 2147483647 (0: leave the allocator "
                             f"as it is); got {text!r}")
        _applied = pad if pad and _mallopt(_M_TOP_PAD, pad) else 0
        return _applied


def _mallopt(option: int, value: int) -> bool:
    if not hasattr(os, "confstr"):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
    except (OSError, ValueError):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
    return bool(libc.mallopt(ctypes.c_int(option), ctypes.c_int(value)))
