"""The caller's inputs as sources the transports read, sized and hashed before the submit (docs/PROTOCOL.md §11).

:func:`prepare_inputs` turns what the caller gave (``bytes``, ``memoryview``, ``pathlib.Path``,
a binary file) into :class:`InputSource` s with their size and digest (``blake3:``), computed in
a pass over the content before the submit (a file in a thread, a big one mapped and hashed on
every core; a file that cannot seek, such as stdin, is copied to a temporary file on the way).
Nothing holds more than one chunk of a file in memory. An :class:`InputSource` is read again
from any offset (resumes, new attempts) until the plan ends: by chunks for the relay, by
``sendfile`` (a file) or slices (a buffer) on the direct path's socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import pathlib
import socket
import tempfile
from collections.abc import AsyncIterator, Mapping
from typing import IO, Any

from fleetwire.data import CHUNK_BYTES, DataTransferError, Progress
from protocol.messages import InputSpec
from protocol.tickets import DIGEST_DEFAULT, name_problem, new_hasher_of

__all__ = ["PARALLEL_HASH_BYTES", "TRANSFER_CHUNK", "InputSource", "InputValue", "prepare_inputs"]

TRANSFER_CHUNK = 4 << 20  # what a transfer thread moves per call (bounded memory, few calls)
PARALLEL_HASH_BYTES = 16 << 20  # inputs this big are hashed on every core before the submit, a window at a time
InputValue = bytes | bytearray | memoryview | pathlib.Path | IO[bytes]


class InputSource:
    """One input's content, readable again from any offset (for resumes and new attempts)."""

    def __init__(self, name: str, size: int, digest: str, *, data: memoryview | None = None,
                 path: pathlib.Path | None = None, temporary: bool = False) -> None:
        self.name = name
        self.size = size
        self.digest = digest
        self._data = data
        self._path = path
        self._temporary = temporary

    def spec(self) -> InputSpec:
        return InputSpec(name=self.name, size=self.size, digest=self.digest)

    @property
    def data(self) -> memoryview | None:
        """The content when it is in memory; None: it is a file (:attr:`path`) or was let go."""
        return self._data

    @property
    def path(self) -> pathlib.Path | None:
        """The file the content is read from; None: it is in memory (:attr:`data`)."""
        return self._path

    async def chunks(self, offset: int, chunk: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        """The content from ``offset``, one chunk at a time."""
        if self._data is not None:
            for start in range(offset, self.size, chunk):
                yield bytes(self._data[start : start + chunk])
            return
        assert self._path is not None
        file = await asyncio.to_thread(open, self._path, "rb")
        try:
            file.seek(offset)
            remaining = self.size - offset
            while remaining > 0:
                data = await asyncio.to_thread(file.read, min(chunk, remaining))
                if not data:
                    raise DataTransferError(f"input {self.name!r}: {self._path} shrank while uploading")
                remaining -= len(data)
                yield data
        finally:
            file.close()

    def send(self, sock: socket.socket, offset: int, length: int, progress: Progress | None = None) -> None:
        """Send ``length`` bytes from ``offset`` on a blocking socket (``sendfile`` for a file). Any thread.

        ``progress(name, done, size)`` is called after each :data:`TRANSFER_CHUNK`.
        """
        end = offset + length
        if self._data is not None:
            view = self._data
            for start in range(offset, end, TRANSFER_CHUNK):
                stop = min(end, start + TRANSFER_CHUNK)
                sock.sendall(view[start:stop])
                if progress is not None:
                    progress(self.name, stop, self.size)
            return
        assert self._path is not None
        with open(self._path, "rb") as file:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(file.fileno(), offset, length, os.POSIX_FADV_SEQUENTIAL)
            for start in range(offset, end, TRANSFER_CHUNK):
                count = min(end - start, TRANSFER_CHUNK)
                if sock.sendfile(file, start, count) != count:
                    raise DataTransferError(f"input {self.name!r}: {self._path} shrank while uploading")
                if progress is not None:
                    progress(self.name, start + count, self.size)

    def close(self) -> None:
        """The plan ended: let go of the content (a temporary copy is removed)."""
        self._data = None
        if self._temporary and self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()


def _hash_file(path: pathlib.Path) -> tuple[int, str]:
    """Size and digest in one pass: a big file mapped and hashed on every core (blake3), else read in big chunks.

    Mapped a window at a time (:data:`PARALLEL_HASH_BYTES`; unmapped before the next, so the
    process's resident memory grows by one window, not by the file): no copy out of the page
    cache, and blake3 splits each window over threads (1 GiB: ~0.15 s on 2 cores, where reads into
    a buffer on one core took ~0.34 s).
    """
    size = path.stat().st_size
    if size >= PARALLEL_HASH_BYTES and path.is_file():
        with contextlib.suppress(OSError, ValueError):  # a file that cannot be mapped is read as below
            return size, _hash_mapped(path, size)
    hasher, size = new_hasher_of(DIGEST_DEFAULT), 0
    buffer = bytearray(TRANSFER_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while got := file.readinto(view):
            hasher.update(view[:got])
            size += got
    return size, f"{DIGEST_DEFAULT}:{hasher.hexdigest()}"


def _hash_mapped(path: pathlib.Path, size: int) -> str:
    """The digest of ``size`` bytes of ``path``, mapped a window at a time and hashed on every core.

    Raises:
        OSError, ValueError: it cannot be mapped, or its size changed under the hash.
    """
    hasher = new_hasher_of(DIGEST_DEFAULT, parallel=True)
    with open(path, "rb", buffering=0) as file:
        for offset in range(0, size, PARALLEL_HASH_BYTES):
            length = min(PARALLEL_HASH_BYTES, size - offset)
            with mmap.mmap(file.fileno(), length, offset=offset, access=mmap.ACCESS_READ) as window:
                hasher.update(window)
        if os.fstat(file.fileno()).st_size != size:
            raise ValueError("the file changed size while it was hashed")
    return f"{DIGEST_DEFAULT}:{hasher.hexdigest()}"


def _copy_stream(name: str, stream: IO[bytes]) -> InputSource:
    """A non-seekable file (stdin, a pipe) copied to a temporary file while hashing."""
    hasher, size = new_hasher_of(DIGEST_DEFAULT), 0
    fd, temp = tempfile.mkstemp(prefix="fleetwire-input-")
    with os.fdopen(fd, "wb") as out:
        while chunk := stream.read(CHUNK_BYTES):
            hasher.update(chunk)
            out.write(chunk)
            size += len(chunk)
    return InputSource(name, size, f"{DIGEST_DEFAULT}:{hasher.hexdigest()}", path=pathlib.Path(temp), temporary=True)


def _prepare_one(name: str, value: Any) -> InputSource:
    if isinstance(value, bytes | bytearray | memoryview):
        view = memoryview(value).cast("B")
        hasher = new_hasher_of(DIGEST_DEFAULT, parallel=view.nbytes >= PARALLEL_HASH_BYTES)
        hasher.update(view)
        return InputSource(name, view.nbytes, f"{DIGEST_DEFAULT}:{hasher.hexdigest()}", data=view)
    if isinstance(value, pathlib.Path):
        size, digest = _hash_file(value)
        return InputSource(name, size, digest, path=value)
    if hasattr(value, "read"):
        file_name = getattr(value, "name", None)
        if isinstance(file_name, str) and os.path.isfile(file_name) and value.seekable():
            size, digest = _hash_file(pathlib.Path(file_name))
            return InputSource(name, size, digest, path=pathlib.Path(file_name))
        return _copy_stream(name, value)
    kind = type(value).__name__
    raise TypeError(f"input {name!r} must be bytes, memoryview, pathlib.Path or a binary file, not {kind}")


async def prepare_inputs(inputs: Mapping[str, InputValue]) -> dict[str, InputSource]:
    """Sizes and digests of the inputs (big ones hashed in threads, all at once: hashlib releases the GIL).

    Raises:
        ValueError: a bad name. TypeError: a value of another type. OSError: a file that cannot be read.
    """
    for name in inputs:
        problem = name_problem(name, "input name")
        if problem is not None:
            raise ValueError(problem)
    sources: dict[str, InputSource] = {}
    big: dict[str, InputValue] = {}
    for name, value in inputs.items():
        if isinstance(value, bytes | bytearray | memoryview) and len(value) < CHUNK_BYTES:
            sources[name] = _prepare_one(name, value)
        else:
            big[name] = value
    if len(big) == 1:
        [(name, value)] = big.items()
        sources[name] = await asyncio.to_thread(_prepare_one, name, value)
    elif big:
        prepared = await asyncio.gather(*(asyncio.to_thread(_prepare_one, n, v) for n, v in big.items()),
                                        return_exceptions=True)  # every thread is done before anything is raised
        for source in prepared:
            if isinstance(source, BaseException):
                for other in prepared:
                    if isinstance(other, InputSource):
                        other.close()  # a copied stream's temporary file
                raise source
        sources.update((source.name, source) for source in prepared if isinstance(source, InputSource))
    return {name: sources[name] for name in inputs}
