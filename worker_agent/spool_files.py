"""One plan attempt's files in the worker's spool: inputs as they arrive, outputs kept (docs/SEMANTICS.md §Data plane).

Theory of operation:

* An :class:`InputFile` is one named input of one plan attempt, declared with its size and
  digest. Its bytes arrive in order, possibly over several connections (resume):
  :attr:`InputFile.received` is the acknowledged offset. Small inputs stay in memory
  (``path`` None); larger ones go to a file. The digest is computed as the bytes arrive; the
  last byte settles the input (:meth:`InputFile.finish`): ``verified``, or ``failed``
  (``input_mismatch``) with an error that names it. What a verdict about it means for a
  transfer is protocol/transfer/upload.py's (it reads an ``InputFile`` as its ``InputFacts``).
* A digest that does not match when the last byte arrived is taken for damage in transit: the
  input's bytes are dropped and it starts again from offset 0 (:meth:`InputFile.restart`), at
  most :data:`INPUT_RESTARTS` times; the next mismatch fails it ``input_mismatch``.
* Storing: :meth:`InputFile.store` on the loop for small chunks; :meth:`InputFile.store_off_loop`
  writes and hashes a batch in two threads at once (file writes and hashlib release the GIL),
  whole aligned chunks of a direct upload with ``O_DIRECT``, the rest with paced writeback
  (wireio/writeback.py). Both the HTTP endpoint and the relay end store through it.
* An :class:`OutputFile` is a file a handler left, copied into the spool with its size and digest.
* :class:`InputReader` is one input as its handler sees it (``ctx.inputs[name]``).
* :func:`open_confined` reads a plan's outputs back without following a symbolic link;
  :func:`remove_file` and :func:`remove_tree` unlink big files and scratch trees off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import os
import shutil
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Final, Literal

import protocol
from protocol.tickets import new_hasher
from wireio.writeback import DIRECT_ALIGN, O_DIRECT, WriteBehind, page_aligned, pwrite_all

__all__ = [
    "CHUNK",
    "DISK_FULL",
    "INPUTS_UNAVAILABLE",
    "INPUT_MISMATCH",
    "INPUT_RESTARTS",
    "UNLINK_AWAY_BYTES",
    "InputFile",
    "InputReader",
    "OutputFile",
    "SpoolError",
    "open_confined",
    "private_opener",
    "remove_file",
    "remove_tree",
    "safe_name",
]

DISK_FULL: Final = "worker_disk_full"
INPUT_MISMATCH: Final = "input_mismatch"
INPUTS_UNAVAILABLE: Final = "inputs_unavailable"
INPUT_RESTARTS: Final = 2  # an input whose digest did not match starts again from 0 this many times
CHUNK: Final = 1 << 20
UNLINK_AWAY_BYTES: Final = 8 << 20  # a spool file this big is unlinked in a thread (see remove_file)

InputState = Literal["receiving", "verified", "failed"]


class SpoolError(Exception):
    """An input or output could not be kept: ``code`` is the plan's failure code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class InputFile:
    """One declared input of one plan attempt, as it arrives."""

    def __init__(self, name: str, size: int, digest: str, path: Path | None, clock: Any = time.monotonic) -> None:
        self.name = name
        self.size = size
        self.digest = digest
        self.path = path  # None: held in memory
        self.buffer: bytearray | None = bytearray() if path is None else None
        self.received = 0
        self.state: InputState = "receiving"
        self.error: protocol.ErrorInfo | None = None
        self.busy = False  # an upload is writing it now
        self.restarts = 0  # times its bytes were dropped for a digest mismatch and it started again from 0
        self.mismatch = ""  # the last mismatch, while it is being sent again
        self.via = "direct"  # how its bytes came: "direct" (the HTTP endpoint) or "relay" (worker_agent/relay.py)
        self.settled = asyncio.Event()
        self.progressed_at = clock()  # when its last bytes were stored (or it was declared)
        self._clock = clock
        self._hasher = new_hasher(digest)
        self._file: BinaryIO | None = None
        self._behind: WriteBehind | None = None  # the file's writeback pacing (direct uploads)
        self._direct_fd: int | None = None  # the file opened with O_DIRECT (aligned blocks of direct uploads)
        self._direct_ok = bool(O_DIRECT)  # False once the file system refused O_DIRECT
        self.direct_bytes = 0  # of what was written, the bytes that went by O_DIRECT
        self._file_stale = False  # O_DIRECT wrote since the buffered file last wrote: seek it first

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes at :attr:`received` (on the event loop).

        Raises:
            SpoolError: ``worker_disk_full`` (the input has failed).
        """
        try:
            self.store(data)
        except OSError as exc:
            self.write_failed(exc)

    def store(self, data: bytes | bytearray | memoryview) -> None:
        """Append bytes at :attr:`received`: write and hash them, nothing else. Any thread, one at a time.

        Raises:
            OSError: the write failed (then call :meth:`write_failed` on the event loop).
        """
        self.put(data)
        self.hash(data)
        self.advance(len(data))

    def put(self, data: bytes | bytearray | memoryview, *, write_behind: bool = False, direct_io: bool = False) -> None:
        """The writing half of :meth:`store` (a thread may run it while another runs :meth:`hash`).

        ``write_behind``: pace the file's writeback as it grows (wireio/writeback.py), so a big
        input does not pile up in the page cache; it may wait for the disk, so only from a thread.
        ``direct_io``: write ``data`` with ``O_DIRECT`` when it can be (page-aligned memory, a
        whole number of pages, at a page-aligned offset; a file system that takes it): the disk
        reads it straight from the buffer, with no copy into the page cache and nothing to write
        back (0.03-0.06 CPU s per GiB, where a paced buffered write costs ~0.28). The rest (a
        short last chunk, a resume at an odd offset) is written as ``write_behind`` says.
        """
        if self.buffer is not None:
            self.buffer += data
        elif direct_io and self._direct_ok and self._put_direct(data):
            return
        else:
            if self._file is None:
                assert self.path is not None
                self._file = open(self.path, "r+b" if self.received else "wb", opener=private_opener)
                self._file.seek(self.received)
            elif self._file_stale:  # past what went by O_DIRECT (each chunk advanced once stored)
                self._file.seek(self.received)
            self._file_stale = False
            self._file.write(data)
            if write_behind:
                if self._behind is None:
                    self._behind = WriteBehind(self._file.fileno(), self.received)
                self._behind.wrote(self.received + len(data))

    def _put_direct(self, data: bytes | bytearray | memoryview) -> bool:
        """Write ``data`` at :attr:`received` with ``O_DIRECT``: True, or False when it cannot be (nothing written)."""
        view = memoryview(data).cast("B")
        if self.received % DIRECT_ALIGN or view.nbytes % DIRECT_ALIGN or not view.nbytes or not page_aligned(view):
            return False
        assert self.path is not None
        if self._direct_fd is None:
            flags = os.O_WRONLY | os.O_CREAT | O_DIRECT | (os.O_TRUNC if not self.received else 0)
            try:
                self._direct_fd = os.open(self.path, flags, 0o600)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: this file system has no O_DIRECT (tmpfs, some FUSE)
                    raise
                self._direct_ok = False
                return False
        if self._file is not None:
            self._file.flush()  # what the buffered file holds goes first
        try:
            pwrite_all(self._direct_fd, view, self.received)
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: O_DIRECT opened but not written here
                raise
            os.close(self._direct_fd)  # what it wrote of the chunk, if any, the buffered write writes again
            self._direct_fd, self._direct_ok = None, False
            return False
        self.direct_bytes += view.nbytes
        self._file_stale = True  # the buffered file's position is behind what O_DIRECT wrote
        return True

    def hash(self, data: bytes | bytearray | memoryview) -> None:
        """The hashing half of :meth:`store`."""
        self._hasher.update(data)

    def advance(self, count: int) -> None:
        """Both halves of :meth:`store` are done for ``count`` more bytes: they are acknowledged."""
        self.received += count
        self.progressed_at = self._clock()

    async def store_off_loop(self, batch: Sequence[bytes | bytearray | memoryview], *, direct_io: bool = False) -> None:
        """Append ``batch`` at :attr:`received`, written in one thread while another hashes it, then acknowledge it.

        Both threads are done before anything is raised (the file is never closed under a write),
        and nothing is acknowledged then. The writes are paced (``write_behind``); ``direct_io``:
        whole aligned chunks go with ``O_DIRECT`` (see :meth:`put`).

        Raises:
            OSError: the write failed (then :meth:`write_failed`). ValueError: the file was closed meanwhile.
        """
        results = await asyncio.gather(asyncio.to_thread(self._put_all, batch, direct_io),
                                       asyncio.to_thread(self._hash_all, batch), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        self.advance(sum(len(data) for data in batch))

    def _put_all(self, batch: Sequence[bytes | bytearray | memoryview], direct_io: bool) -> None:
        for data in batch:
            self.put(data, write_behind=True, direct_io=direct_io)

    def _hash_all(self, batch: Sequence[bytes | bytearray | memoryview]) -> None:
        for data in batch:
            self._hasher.update(data)

    def write_failed(self, exc: OSError) -> None:
        """A :meth:`store` failed: a full disk fails the input (``SpoolError``); anything else is raised again."""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self.fail(DISK_FULL, f"input {self.name!r}: the worker's disk is full ({exc.strerror})")
            raise SpoolError(DISK_FULL, self.error.message if self.error else "disk full") from None
        raise exc

    def pause(self) -> None:
        """The upload stopped (dropped or partial): close the file, keep what was written."""
        self._behind = None
        if self._direct_fd is not None:
            os.close(self._direct_fd)
            self._direct_fd = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def finish(self) -> None:
        """All declared bytes arrived: check the digest and settle the input."""
        self.pause()
        got = f"{self.digest.partition(':')[0]}:{self._hasher.hexdigest()}"
        if got != self.digest:
            mismatch = f"input {self.name!r}: digest {got} does not match the declared {self.digest}"
            if self.restarts < INPUT_RESTARTS:
                self.restart(mismatch)
                return
            self.fail(INPUT_MISMATCH, f"{mismatch} ({self.restarts + 1} times: the bytes sent are not those declared)")
            return
        self.state = "verified"
        self.settled.set()

    def restart(self, mismatch: str) -> None:
        """The bytes did not have the declared digest (damaged in transit?): drop them and start again from 0."""
        self.pause()
        self.restarts += 1
        self.mismatch = (f"{mismatch}; its {self.received} bytes were dropped: send it again from offset 0 "
                         f"(retry {self.restarts} of {INPUT_RESTARTS})")
        if self.buffer is not None:
            self.buffer = bytearray()
        # A file is truncated by its next write from 0 (opened "wb", or O_DIRECT with O_TRUNC): unlinking it in
        # a thread (remove_file) could remove the file that write makes.
        self._hasher = new_hasher(self.digest)
        self._file_stale = False
        self.received = 0
        self.progressed_at = self._clock()

    def fail(self, code: str, message: str) -> None:
        """Settle the input as failed (its bytes are dropped)."""
        self.pause()
        self.state = "failed"
        self.error = protocol.ErrorInfo(code=code, message=message, detail={"input": self.name})
        self.buffer = None
        if self.path is not None:
            remove_file(self.path, self.received)
        self.settled.set()

    def discard(self) -> None:
        """Drop the bytes (the attempt ended)."""
        self.pause()
        self.buffer = None
        if self.path is not None:
            remove_file(self.path, self.received)


class OutputFile:
    """One output a handler left, kept for download."""

    __slots__ = ("digest", "expires_at", "name", "path", "size")

    def __init__(self, name: str, path: Path, size: int, digest: str, expires_at: float) -> None:
        self.name = name
        self.path = path
        self.size = size
        self.digest = digest
        self.expires_at = expires_at

    def spec(self) -> protocol.OutputSpec:
        return protocol.OutputSpec(name=self.name, size=self.size, digest=self.digest)


def remove_file(path: Path, size: int) -> asyncio.Future[None] | None:
    """Unlink a spool file; one of :data:`UNLINK_AWAY_BYTES` or more in a thread when called on an event loop.

    Freeing a big file's blocks and cached pages takes a while (about 10 ms per 64 MiB): on the
    agent's loop it would hold up everything else there, such as the ``done`` of the plan whose
    input it was (sent after its inputs are dropped) and other plans' transfers. Returns the
    thread's future (None: unlinked already).
    """
    if size >= UNLINK_AWAY_BYTES:
        with contextlib.suppress(RuntimeError):  # no running loop (or it is closing): unlink here
            return asyncio.get_running_loop().run_in_executor(None, _unlink, path)
    _unlink(path)
    return None


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def remove_tree(path: Path) -> None:
    """Remove a directory and what is in it (a plan's scratch: in a thread when called on an event loop)."""
    if not os.path.lexists(path):
        return
    try:
        asyncio.get_running_loop().run_in_executor(None, functools.partial(shutil.rmtree, path, ignore_errors=True))
    except RuntimeError:  # no running loop: here
        shutil.rmtree(path, ignore_errors=True)


def private_opener(path: str, flags: int) -> int:
    """``open``'s opener for spool files: mode 0600 whatever the umask."""
    return os.open(path, flags, 0o600)


def open_confined(directory: Path, relative: str, *, owner: int | None = None) -> BinaryIO:
    """Open the regular file ``relative`` below ``directory`` for reading, never following a link.

    Each component is opened with ``O_NOFOLLOW`` from the one before (no symbolic link, no
    ``..``, nothing absolute: the path cannot leave ``directory``); a FIFO or device is refused
    without blocking. ``owner``: the uid the file must belong to (a plan user's outputs).

    Raises:
        ValueError: the path leaves ``directory``, passes a link, or names no regular file of
            ``owner``; the message says which. FileNotFoundError: nothing there.
    """
    parts = relative.split("/")
    if relative.startswith("/") or not relative or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"path {relative!r} is not a plain relative path inside the output directory "
                         "(no '..', no leading '/', no empty part)")  # fmt: skip
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(directory, nofollow | os.O_DIRECTORY)  # a plan (user) owning its parent may have linked it
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ValueError(f"the output directory {directory.name!r} is a symbolic link or not a directory") from None
        raise
    try:
        for part in parts[:-1]:
            try:
                following = os.open(part, nofollow | os.O_DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise ValueError(f"path {relative!r}: {part!r} is a symbolic link or not a directory") from None
                raise
            os.close(fd)
            fd = following
        try:
            file_fd = os.open(parts[-1], nofollow | os.O_NONBLOCK, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"path {relative!r} is a symbolic link; outputs must be regular files") from None
            raise
    finally:
        os.close(fd)
    info = os.fstat(file_fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"path {relative!r} is not a regular file"
    elif owner is not None and info.st_uid != owner:
        problem = f"path {relative!r} belongs to uid {info.st_uid}, not the plan's user (uid {owner})"
    if problem is not None:
        os.close(file_fd)
        raise ValueError(problem)
    return os.fdopen(file_fd, "rb")


def safe_name(name: str) -> str:
    """A file-system-safe spelling of a validated name or plan id (no separators, no dot-dot)."""
    return "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in name).replace("..", "%2e.")


class InputReader:
    """One input as its handler sees it: ``.size``, ``.digest``, ``.read(n)``, ``async for chunk``, ``.path``."""

    def __init__(self, entry: InputFile, spool_dir: Callable[[], Path]) -> None:
        self._entry = entry
        self._dir = spool_dir  # the attempt's directory (made when first asked for)
        self._written: Path | None = None  # an in-memory input written out for .path, removed by close()
        self._offset = 0
        self._file: BinaryIO | None = None
        self.name = entry.name
        self.size = entry.size
        self.digest = entry.digest

    @property
    def path(self) -> Path:
        """A file holding the input (an in-memory input is written out on first use)."""
        entry = self._entry
        if entry.path is None:
            if self._written is None:
                path = self._dir() / f"in-{safe_name(entry.name)}"
                with open(path, "wb", opener=private_opener) as file:
                    file.write(entry.buffer or b"")
                self._written = path
            return self._written
        return entry.path

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes from the current position (all the rest with ``-1``)."""
        entry = self._entry
        if entry.buffer is not None:
            end = entry.size if n < 0 else min(entry.size, self._offset + n)
            data = bytes(entry.buffer[self._offset : end])
        else:
            if self._file is None:
                self._file = open(self.path, "rb")
                self._file.seek(self._offset)
            data = self._file.read(n)
        self._offset += len(data)
        return data

    def chunks(self, size: int = CHUNK) -> Iterator[bytes]:
        """The content in chunks of at most ``size`` bytes, from the start."""
        self._offset = 0
        if self._file is not None:
            self._file.seek(0)
        while chunk := self.read(size):
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks():
            yield chunk

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._written is not None:
            _unlink(self._written)
            self._written = None
