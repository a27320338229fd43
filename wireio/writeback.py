"""Write-behind for big files written once and read at most once: they do not pile up in the page cache.

Why: a buffered ``write`` of a big file leaves every byte in the page cache, dirty until the
kernel writes it back. On the machines we measured on (a VM, ext4), once a GiB or two had piled
up that way every further ``write`` cost about 2.5 CPU seconds per GiB and ran at ~300 MB/s
(the first GiB: ~0.2 s), so a 1 GiB upload or download was bound by its own disk writes, at a
fraction of what the socket carries. Writing the file back as it is written, and dropping the
pages that are on disk already, keeps the page cache from growing: ~0.2 CPU s per GiB, about 2
GB/s, whatever was written before.

How: :class:`WriteBehind` follows one file's writes. Each time :data:`WINDOW` more bytes were
written it starts their writeback (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which only
queues it); once more than :data:`LAG` windows are under way it waits for the oldest one's
writeback to end and drops it from the cache (``posix_fadvise(POSIX_FADV_DONTNEED)``). So at
most ``LAG + 2`` windows of a file (40 MiB) are dirty or cached at any time, and the disk has
``LAG`` windows of slack before the writer waits for it. This is not durability (nothing waits
for the disk's own cache and no metadata is synced; a crash may lose the file): it only paces
writeback.

The wait blocks: call :meth:`WriteBehind.wrote` from the thread that writes, never from an event
loop. Where ``sync_file_range`` is missing (not Linux) or the file does not support it (a pipe),
it does nothing. A file read again soon after it was written (a handler's input) is read from the
disk, not the cache.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import os
from typing import Any, Final

__all__ = ["DIRECT_ALIGN", "LAG", "O_DIRECT", "WINDOW", "WriteBehind", "page_aligned", "pwrite_all"]

WINDOW: Final = 8 << 20
LAG: Final = 2
_WRITE: Final = 2  # SYNC_FILE_RANGE_WRITE
_WAIT_ALL: Final = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER
_UNSUPPORTED: Final = (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF)

#: ``O_DIRECT`` where the platform has it (else 0): the bypass of the page cache that the worker's spool and
#: the SDK's relayed downloads use for whole aligned blocks (worker_agent/spool_files.py, wireio/chunkwrite.py).
O_DIRECT: Final = getattr(os, "O_DIRECT", 0)
#: ``O_DIRECT``'s alignment of memory, file offset and length: a page (every block size divides it).
DIRECT_ALIGN: Final = 4096

_sync_file_range: Any = None
_looked_up = False


def _syscall() -> Any:
    """libc's ``sync_file_range`` (ctypes releases the GIL around it), or None where there is none."""
    global _sync_file_range, _looked_up
    if not _looked_up:
        _looked_up = True
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError, AttributeError, ImportError):
                function = ctypes.CDLL(None, use_errno=True).sync_file_range
                function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                function.restype = ctypes.c_int
                _sync_file_range = function
    return _sync_file_range


class WriteBehind:
    """Paces the writeback of one file written in order from ``offset`` (see the module docstring).

    Args:
        fd: the file's descriptor (opened for writing).
        offset: where the writes start.
        window: bytes between two writeback steps.
        lag: windows whose writeback may be under way at once (the oldest is waited for and dropped).
    """

    __slots__ = ("_fd", "_kicked", "_lag", "_started", "_sync", "_window")

    def __init__(self, fd: int, offset: int = 0, window: int = WINDOW, lag: int = LAG) -> None:
        self._fd = fd
        self._window = window
        self._lag = lag
        self._started = offset  # bytes before this have had their writeback started
        self._kicked: collections.deque[tuple[int, int]] = collections.deque()  # (offset, length) not yet dropped
        self._sync = _syscall()

    @property
    def active(self) -> bool:
        """Whether it paces anything here (False: not Linux, or a file that does not support it)."""
        return self._sync is not None

    def wrote(self, end: int) -> None:
        """The file's bytes up to ``end`` are written: step the writeback once a window more is. May block.

        Raises:
            OSError: the writeback failed (``ENOSPC``, ``EIO``): the written bytes are not on disk.
        """
        if self._sync is None or end - self._started < self._window:
            return
        self._call(self._started, end - self._started, _WRITE)
        self._kicked.append((self._started, end - self._started))
        self._started = end
        while self._sync is not None and len(self._kicked) > self._lag:
            offset, length = self._kicked.popleft()
            self._call(offset, length, _WAIT_ALL)
            os.posix_fadvise(self._fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _call(self, offset: int, length: int, flags: int) -> None:
        if self._sync(self._fd, offset, length, flags) == 0:
            return
        import ctypes

        code = ctypes.get_errno()
        if code in _UNSUPPORTED:
            self._sync = None  # this file (or file system) does not do it: plain writes
            return
        raise OSError(code, os.strerror(code))


def page_aligned(view: memoryview) -> bool:
    """Whether ``view``'s memory starts on a :data:`DIRECT_ALIGN` boundary (read-only memory: not known, so no)."""
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return False
    return address % DIRECT_ALIGN == 0


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (``pwrite`` until done; a write that takes nothing is ``ENOSPC``).

    Raises:
        OSError: as ``pwrite`` does (``EINVAL``: the file system refused an ``O_DIRECT`` write).
    """
    written = 0
    while written < view.nbytes:
        count = os.pwrite(fd, view[written:], offset + written)
        if count <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written += count
