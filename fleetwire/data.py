"""Plans' inputs and outputs in the SDK: sources, transports, uploads and downloads (docs/PROTOCOL.md §Data plane).

Theory of operation:

* :func:`prepare_inputs` turns what the caller gave (``bytes``, ``memoryview``, ``pathlib.Path``,
  a binary file) into :class:`InputSource` s with their size and digest (``blake3:``), computed
  in a pass over the content before the submit (a file in a thread; a file that cannot seek,
  such as stdin, is copied to a temporary file on the way). Nothing holds more than one chunk
  of a file in memory.
* The coordinator never carries the bytes. Once a plan is leased its stream gets ``data_ready``
  (per attempt) with the worker's data URL and a ``put`` ticket; :class:`Uploads` (one task per
  plan) uploads every input there through a :class:`Transport`. A newer attempt (its worker
  died) gets the inputs again: the sources are kept until the plan ends.
* :class:`DirectTransport` speaks HTTP/1.1 to the worker: a ``PUT`` with ``Content-Range`` and
  ``Expect: 100-continue`` (the first from offset 0, asking nothing first: a ``409`` from the head
  says another offset), then on a ``409`` or a dropped connection ``HEAD`` (httpx) for the
  acknowledged offset and a ``PUT`` from there. Downloads are ``GET`` with ``Range``, resumed the
  same way. Each transfer runs on a socket and thread of its own (:class:`_SocketCall`).
* The relay (fleetwire/relay.py ``RelayTransport``) carries the same bytes through the
  coordinator: it implements :class:`Transport`; the client's default ``AutoTransport`` picks it
  when a grant has no URL or the direct dial fails.
* What a worker's answer asks of a transfer (docs/PROTOCOL.md §Data plane): ``401`` mid-transfer
  (a ticket key the worker no longer has: the coordinator restarted, or rotated twice) fetches a
  fresh ticket through :attr:`Grant.refresh` and goes on from the byte reached, at most
  :data:`TICKET_REFRESHES` times; ``409`` after a whole input (its digest did not match: the
  worker dropped its bytes) sends it again from 0, logged; ``503`` (the worker holds too many
  uploads not yet assigned to it) waits and asks again; ``410`` (the attempt was cancelled,
  ended, revoked or is not the worker's) ends that attempt's transfer. A downloaded output whose
  digest does not match is fetched again from 0, at most :data:`MISMATCH_RETRIES` times, logged,
  before :class:`OutputMismatch` is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import mmap
import os
import pathlib
import queue
import select
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol
from urllib.parse import quote

from protocol.messages import DataGrant, Event, InputSpec
from protocol.tickets import DIGEST_DEFAULT, name_problem, new_hasher, new_hasher_of
from wireio.chunkwrite import ChunkWriter
from wireio.writeback import WriteBehind

if TYPE_CHECKING:  # httpx (and what it pulls in) loads with the first DirectTransport, not with the SDK
    import httpx

__all__ = [
    "CHUNK_BYTES",
    "DataTransferError",
    "DirectTransport",
    "Grant",
    "InputSource",
    "InputValue",
    "OutputCheck",
    "OutputMismatch",
    "Progress",
    "Transport",
    "Uploads",
    "fetch_to",
    "prepare_inputs",
    "refetch_on_mismatch",
]

log = logging.getLogger("fleetwire.data")

CHUNK_BYTES = 1 << 20
TRANSFER_CHUNK = 4 << 20  # what a transfer thread moves per call (bounded memory, few calls)
CONTINUE_WAIT_S = 1.0  # how long a PUT waits for "100 Continue" before sending its body anyway
SETTLE_S = 10.0  # how long a succeeded plan's last upload may take to read the worker's answer
WRITES_AHEAD = 4  # batches of a download by chunks waiting for the disk (about 4 MiB)
WRITE_BUFFERS = 8  # buffers of a direct download: some filling, some written and hashed, some spare
IDLE_CONNECTIONS = 4  # keep-alive data connections kept per worker endpoint between transfers
IDLE_S = 15.0  # how long one is kept (the worker drops it after its upload stall timeout, 30 s by default)
TICKET_REFRESHES = 2  # fresh tickets one transfer asks for after 401s (a coordinator restart: new keys)
MISMATCH_RETRIES = 2  # downloads of an output again after its digest did not match (damage in transit)
PARALLEL_HASH_BYTES = 16 << 20  # inputs this big are hashed on every core before the submit, a window at a time
WRITE_BUFFER_BYTES = 1 << 20  # small: what is left to write and hash once the last byte arrived is small too
InputValue = bytes | bytearray | memoryview | pathlib.Path | IO[bytes]
Progress = Callable[[str, int, int], None]
"""``progress(name, done_bytes, size)``: how far a transfer got (called from a transfer thread)."""


class DataTransferError(Exception):
    """An upload or download failed for good (``status``: the HTTP answer, 0 for none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class OutputMismatch(DataTransferError):
    """An output's bytes arrived whole but do not have the digest its worker reported: nothing was kept."""


class OutputCheck:
    """Hashes an output's bytes as they arrive and checks them against the digest its worker reported.

    ``digest`` comes from the plan's ``succeeded`` event (``outputs``: ``[size, digest]``); with
    ``""`` (a worker that reported none) nothing is checked. :meth:`update` may run in a thread.
    """

    def __init__(self, name: str, digest: str) -> None:
        self.name = name
        self.digest = digest
        self._hasher = new_hasher(digest) if digest else None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._hasher is not None:
            self._hasher.update(data)

    def restart(self) -> None:
        """The download starts again from byte 0 (another path)."""
        if self.digest:
            self._hasher = new_hasher(self.digest)

    def verify(self) -> None:
        """Raises:
            OutputMismatch: the bytes received do not have the reported digest.
        """
        if self._hasher is None:
            return
        got = f"{self.digest.partition(':')[0]}:{self._hasher.hexdigest()}"
        if got != self.digest:
            raise OutputMismatch(
                f"output {self.name!r}: the bytes received have digest {got}, not {self.digest} as its worker "
                "reported when the plan succeeded (damaged on the worker's disk or on the way); nothing was kept"
            )


@dataclass(frozen=True, slots=True)
class Grant:
    """Where a plan attempt's bytes are and the ticket to present there (``data_ready`` or ``data_grant``)."""

    plan_id: str
    attempt: int
    url: str
    ticket: str
    get_ticket: str = ""
    refresh: Callable[[], Awaitable[Grant]] | None = field(default=None, compare=False, repr=False)
    """Asks the coordinator for a fresh grant of the same direction (``Client.data_ticket``); None: no way to."""
    key: str = ""
    """The plan's key on the worker when it is not ``plan_id`` (docs/PROTOCOL.md §5 *Plan ids*): the URL names it."""

    @classmethod
    def from_event(cls, event: Event, refresh: Callable[[], Awaitable[Grant]] | None = None) -> Grant:
        data = event.data or {}
        return cls(event.plan_id, int(data.get("attempt", event.attempt)), data.get("url", ""),
                   data.get("ticket", ""), data.get("get_ticket", ""), refresh, str(data.get("key") or ""))

    @classmethod
    def from_reply(cls, reply: DataGrant, refresh: Callable[[], Awaitable[Grant]] | None = None) -> Grant:
        return cls(reply.plan_id, reply.attempt, reply.url, reply.ticket, reply.ticket, refresh, reply.key)

    async def renewed(self, what: str, refused: DataTransferError) -> Grant:
        """A fresh ticket to the same attempt's bytes, after ``refused`` (a 401: its key is gone).

        Raises:
            DataTransferError: ``refused`` again, when there is no way to ask for one or the plan has
            moved on to another attempt (whose bytes are elsewhere).
        """
        if self.refresh is None:
            raise refused
        fresh = await self.refresh()
        if fresh.attempt != self.attempt or fresh.plan_id != self.plan_id:
            raise refused
        log.info("fleetwire: %s: the worker refused the ticket (%s); going on with a fresh one", what, refused)
        return fresh

    def resource(self, kind: str, name: str) -> str:
        plan = self.key or self.plan_id  # the worker knows the plan by its key
        return f"{self.url}/v1/data/{quote(plan, safe='')}/{self.attempt}/{kind}/{quote(name, safe='')}"


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


class Transport(Protocol):
    """How the SDK moves a plan's bytes: :class:`DirectTransport` (to the worker), or a relay."""

    async def upload(self, grant: Grant, source: InputSource) -> None:
        """Send the whole input (resuming from what the worker already acknowledged)."""
        ...

    def download(self, grant: Grant, name: str) -> AsyncIterator[bytes]:
        """The output's bytes, in chunks."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def _error_text(response: httpx.Response) -> str:
    try:
        return str(response.json().get("error") or response.text)
    except ValueError:
        return response.text or response.reason_phrase


class DirectTransport:
    """Client <-> worker over HTTP(S), straight to the worker's data endpoint.

    Args:
        ca_file: CA to trust for an ``https`` data endpoint (default: system CAs).
        connect_timeout_s: how long a connect may take.
        stall_timeout_s: a transfer with no progress this long is dropped and resumed.
        max_resumes: resumes after dropped connections before the transfer fails.
    """

    def __init__(self, *, ca_file: str | None = None, connect_timeout_s: float = 10.0, stall_timeout_s: float = 60.0,
                 max_resumes: int = 8) -> None:
        import httpx

        timeout = httpx.Timeout(stall_timeout_s, connect=connect_timeout_s)
        # One context for httpx (an SSLContext, not the CA file's path: ``verify=<str>`` is deprecated) and the
        # transfer sockets; without a CA file, the system's CAs (the sockets' context is made when first needed).
        self._tls: ssl.SSLContext | None = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self._http = httpx.AsyncClient(timeout=timeout, verify=self._tls or True, http2=False)
        self.max_resumes = max_resumes
        self._connect_timeout_s = connect_timeout_s
        self._stall_timeout_s = stall_timeout_s
        self._idle = _IdleConnections()
        self.progress: Progress | None = None
        """Called as bytes move, ``progress(name, done, size)``, from a transfer thread (rich is thread-safe)."""

    async def aclose(self) -> None:
        self._idle.close()
        await self._http.aclose()

    async def offset(self, grant: Grant, name: str) -> tuple[int, str]:
        """The worker's acknowledged offset and state of an input."""
        response = await self._http.head(grant.resource("inputs", name), headers=_auth(grant.ticket))
        if response.status_code != 200:
            status = response.status_code
            gone = " (the attempt is no longer live on that worker)" if status == 410 else ""
            raise DataTransferError(f"input {name!r}: {status} {response.reason_phrase} from {grant.url}{gone}", status)
        return int(response.headers.get("upload-offset", "0")), response.headers.get("upload-state", "receiving")

    async def upload(self, grant: Grant, source: InputSource) -> None:
        import httpx

        failures = 0
        ask = False  # the first PUT goes from 0 unasked: its "Expect: 100-continue" learns any other offset
        while True:
            try:
                offset = 0
                if ask:
                    offset, state = await self.offset(grant, source.name)
                    if state == "verified":
                        return
                    if state == "failed":
                        raise DataTransferError(f"input {source.name!r} was refused by the worker", 422)
                ask = True
                status, body = await self._put(grant, source, offset)
            except (httpx.TransportError, OSError, asyncio.IncompleteReadError) as exc:
                failures += 1
                if failures > self.max_resumes or _untrusted(exc):
                    raise DataTransferError(f"input {source.name!r}: {type(exc).__name__}: {exc}") from None
                await asyncio.sleep(min(2.0, 0.05 * 2**failures))
                continue
            if status in (200, 201):
                return
            if status in (204, 409, 503):  # a part arrived / another offset / not yet: ask again
                failures += 1
                if failures > self.max_resumes:
                    raise DataTransferError(f"input {source.name!r}: {_body_error(body)}", status)
                if status == 409 and _restarted(body):  # its digest did not match: the worker dropped its bytes
                    log.warning("fleetwire: input %r of plan %s: %s", source.name, grant.plan_id, _body_error(body))
                if status == 503:  # refused from the head: the next PUT goes from 0 unasked again
                    ask = False
                    await asyncio.sleep(min(2.0, 0.25 * 2**failures))
                continue
            raise DataTransferError(f"input {source.name!r}: {_body_error(body)}", status)

    async def _put(self, grant: Grant, source: InputSource, offset: int) -> tuple[int, bytes]:
        """One ``PUT`` of the input from ``offset``, on a socket of its own in a thread of its own.

        The body goes by ``sendfile`` for a file (zero-copy; the digest came from the pass before
        the submit) and by ``sendall`` of memoryview slices for a buffer: no copy, no per-chunk
        work on the event loop. Cancelling closes the socket, which ends the thread. The request
        says ``Expect: 100-continue``: the worker answers a wrong offset, a bad ticket or a failed
        input from the head, before any body byte is sent (so the first ``PUT`` needs no ``HEAD``).
        """
        import httpx

        url = httpx.URL(grant.resource("inputs", source.name))
        length = source.size - offset
        head = [f"PUT {url.raw_path.decode('ascii')} HTTP/1.1", f"Host: {url.netloc.decode('ascii')}",
                f"Authorization: Bearer {grant.ticket}", f"Content-Length: {length}"]
        if length:
            head.append(f"Content-Range: bytes {offset}-{source.size - 1}/{source.size}")
            head.append("Expect: 100-continue")
        request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
        tls = self._tls_context() if url.scheme == "https" else None
        call = _SocketCall(url.host, url.port or (443 if tls else 80), tls, url.host, self._connect_timeout_s,
                           self._stall_timeout_s, self._idle)
        progress = self.progress
        return await call.run(functools.partial(_put_body, request=request, source=source, offset=offset,
                                                length=length, progress=progress))

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    async def download_to(self, grant: Grant, name: str, path: str | os.PathLike[str],
                          check: OutputCheck | None = None) -> pathlib.Path:
        """Write an output to ``path`` (through a partial file renamed at the end), resuming with ``Range``.

        The bytes go socket -> a reused buffer -> the file, then ``check``'s hash, in threads of
        their own (:class:`_FileWriter`): bounded memory, no per-chunk work on the event loop; the
        file is written behind (wireio/writeback.py), so a big download does not fill the page
        cache. A digest that does not match ``check`` raises :class:`OutputMismatch` and leaves no file.
        """
        import httpx

        target = pathlib.Path(path)
        partial = target.with_name(f".{target.name}.partial")
        url = httpx.URL(grant.resource("outputs", name))
        tls = self._tls_context() if url.scheme == "https" else None
        received, size, failures, refreshes = 0, -1, 0, 0
        file = await asyncio.to_thread(open, partial, "wb")
        try:
            while size < 0 or received < size:
                head = [f"GET {url.raw_path.decode('ascii')} HTTP/1.1", f"Host: {url.netloc.decode('ascii')}",
                        f"Authorization: Bearer {grant.get_ticket or grant.ticket}"]
                if received:
                    head.append(f"Range: bytes={received}-")
                request = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1")
                progress = [received, size]
                report = None if self.progress is None else functools.partial(self.progress, name)
                call = _SocketCall(url.host, url.port or (443 if tls else 80), tls, url.host, self._connect_timeout_s,
                                   self._stall_timeout_s, self._idle)
                try:
                    status, body = await call.run(functools.partial(_get_body, request=request, file=file,
                                                                    progress=progress, report=report, check=check))
                except OSError as exc:
                    received, size = progress
                    failures += 1
                    if failures > self.max_resumes or _untrusted(exc):
                        raise DataTransferError(f"output {name!r}: {type(exc).__name__}: {exc}") from None
                    await asyncio.sleep(min(2.0, 0.05 * 2**failures))
                    continue
                received, size = progress
                if status == 401 and refreshes < TICKET_REFRESHES:  # its key is gone (a coordinator restart)
                    refreshes += 1
                    refused = DataTransferError(f"output {name!r}: {_body_error(body)}", status)
                    grant = await grant.renewed(f"output {name!r}", refused)
                    url = httpx.URL(grant.resource("outputs", name))
                    continue
                if status not in (200, 206):
                    raise DataTransferError(f"output {name!r}: {_body_error(body)}", status)
            if check is not None:
                check.verify()
        except BaseException:
            file.close()
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
        file.close()
        await asyncio.to_thread(shutil.move, partial, target)
        return target

    async def download(self, grant: Grant, name: str) -> AsyncIterator[bytes]:
        import httpx

        url = grant.resource("outputs", name)
        received, size, failures, refreshes = 0, None, 0, 0
        while size is None or received < size:
            headers = _auth(grant.get_ticket or grant.ticket)
            if received:
                headers["Range"] = f"bytes={received}-"
            try:
                async with self._http.stream("GET", url, headers=headers) as response:
                    if response.status_code not in (200, 206):
                        await response.aread()
                        refused = DataTransferError(f"output {name!r}: {_error_text(response)}", response.status_code)
                        if response.status_code != 401 or refreshes >= TICKET_REFRESHES:
                            raise refused
                        refreshes += 1  # its key is gone (a coordinator restart): a fresh ticket, from here
                        grant = await grant.renewed(f"output {name!r}", refused)
                        url = grant.resource("outputs", name)
                        continue
                    if size is None:
                        size = received + int(response.headers.get("content-length", "0"))
                    async for chunk in response.aiter_raw(CHUNK_BYTES):
                        received += len(chunk)
                        if self.progress is not None:
                            self.progress(name, received, size)
                        yield chunk
            except httpx.TransportError as exc:
                failures += 1
                if failures > self.max_resumes or _untrusted(exc):
                    raise DataTransferError(f"output {name!r}: {type(exc).__name__}: {exc}") from None
                await asyncio.sleep(min(2.0, 0.05 * 2**failures))


def _untrusted(exc: BaseException) -> bool:
    """Whether ``exc`` is the data endpoint's certificate failing verification (or from under httpx's wrapper):
    no retry makes it pass, so the transfer fails at once (the client's ``AutoTransport`` then uses the relay)."""
    seen: BaseException | None = exc
    for _ in range(4):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _restarted(body: bytes) -> bool:
    """Whether a ``409`` says the worker dropped the input's bytes (a digest mismatch) and waits for them from 0."""
    try:
        decoded = json.loads(body)
    except ValueError:
        return False
    return isinstance(decoded, dict) and bool(decoded.get("restart"))


def _body_error(body: bytes) -> str:
    try:
        decoded = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace") or "no answer"
    return str(decoded.get("error") if isinstance(decoded, dict) else decoded)


class _SocketCall:
    """A blocking exchange on a socket of its own in a thread of its own, cancellable from the loop.

    A dedicated thread (not the loop's default executor): an upload holds it for as long as it
    lasts. Cancelling the awaiting task shuts the socket down, so the thread's send or receive
    fails at once and the thread ends. The connection is an idle keep-alive one to the same
    endpoint when ``idle`` has one (no connect, no TLS handshake), and goes back there when the
    exchange says it may (its answer read whole, no ``Connection: close``).
    """

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, server_name: str, connect_timeout_s: float,
                 stall_timeout_s: float, idle: _IdleConnections | None = None) -> None:
        self._address = (host, port)
        self._tls = tls
        self._server_name = server_name
        self._connect_timeout_s = connect_timeout_s
        self._stall_timeout_s = stall_timeout_s
        self._idle = idle
        self._sock: socket.socket | None = None
        self._closed = False

    async def run(self, exchange: Callable[[socket.socket], tuple[int, bytes, bool]]) -> tuple[int, bytes]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[tuple[int, bytes]] = loop.create_future()

        def settle(result: tuple[int, bytes] | None, error: BaseException | None) -> None:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
            else:
                assert result is not None
                done.set_result(result)

        def work() -> None:
            try:
                result = self._exchange(exchange)
            except BaseException as exc:  # handed to the awaiting task
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(settle, None, exc)
                return
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, result, None)

        threading.Thread(target=work, name="fleetwire-data", daemon=True).start()
        try:
            return await done
        finally:
            self._abort()

    def _exchange(self, exchange: Callable[[socket.socket], tuple[int, bytes, bool]]) -> tuple[int, bytes]:
        key = (*self._address, self._tls is not None)
        sock = self._idle.take(key) if self._idle is not None else None
        if sock is None:
            sock = socket.create_connection(self._address, timeout=self._connect_timeout_s)
        keep = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None and not isinstance(sock, ssl.SSLSocket):
                sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
            sock.settimeout(self._stall_timeout_s)
            self._sock = sock
            if self._closed:
                raise ConnectionAbortedError("the transfer was cancelled")
            status, body, keep = exchange(sock)
            return status, body
        finally:
            self._sock = None  # first: a cancel from now on does not shut down a connection given back
            if keep and not self._closed and self._idle is not None:
                self._idle.give(key, sock)
            else:
                sock.close()

    def _abort(self) -> None:
        self._closed = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class _IdleConnections:
    """Keep-alive connections to workers' data endpoints, idle between transfers (used from transfer threads).

    At most :data:`IDLE_CONNECTIONS` per endpoint, each for :data:`IDLE_S`. One is taken only if
    nothing can be read from it (an idle HTTP/1.1 connection has nothing to say; a closed one
    reads as end of file), so a connection the worker dropped meanwhile is not used.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int, bool], list[tuple[float, socket.socket]]] = {}
        self._closed = False

    def take(self, key: tuple[str, int, bool]) -> socket.socket | None:
        while True:
            with self._lock:
                entries = self._idle.get(key)
                if not entries:
                    return None
                since, sock = entries.pop()
            if time.monotonic() - since < IDLE_S and _quiet(sock):
                return sock
            sock.close()

    def give(self, key: tuple[str, int, bool], sock: socket.socket) -> None:
        with self._lock:
            entries = self._idle.setdefault(key, [])
            if not self._closed and len(entries) < IDLE_CONNECTIONS:
                entries.append((time.monotonic(), sock))
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            entries = [sock for idle in self._idle.values() for _, sock in idle]
            self._idle.clear()
        for sock in entries:
            sock.close()


def _quiet(sock: socket.socket) -> bool:
    """Whether nothing can be read from ``sock`` right now (neither bytes nor an end of file)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _read_response(sock: socket.socket, *, keep_body: bool = True,
                   data: bytes = b"") -> tuple[int, dict[str, str], bytes, bytes]:
    """Status, headers, and what came after the head (its body when ``keep_body``, else the first bytes).

    A ``100 Continue`` (late: the body went without waiting for it) is skipped. ``data``: bytes already read.
    """
    head, _, rest = _read_head(sock, data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        raise ConnectionError(f"not an HTTP answer: {lines[0][:80]!r}")
    if parts[1] == "100":
        return _read_response(sock, keep_body=keep_body, data=rest)
    headers = {}
    for line in lines[1:]:
        key, _, value = line.partition(":")
        headers[key.strip().lower()] = value.strip()
    if not keep_body:
        return int(parts[1]), headers, b"", rest
    length = int(headers.get("content-length", "0") or 0)
    body = bytearray(rest)
    while len(body) < length:
        more = sock.recv(length - len(body))
        if not more:
            break
        body += more
    return int(parts[1]), headers, bytes(body[:length]), b""


def _read_head(sock: socket.socket, data: bytes) -> bytes:
    """``data`` and what ``sock`` sends after it, until a whole answer head (up to a blank line) is in it."""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            raise ConnectionResetError("the worker closed the connection before answering")
        data += more
        if len(data) > 1 << 16:
            raise ConnectionError("the worker's answer has an oversized head")
    return data


def _put_body(sock: socket.socket, request: bytes, source: InputSource, offset: int, length: int,
              progress: Progress | None) -> tuple[int, bytes, bool]:
    """Send a ``PUT`` and its body: (status, body, whether the connection may be used again)."""
    sock.sendall(request)
    if length:
        answer = _await_continue(sock)
        if answer is not None:  # refused from the head: no body byte was sent (and the worker closes)
            return *answer, False
    source.send(sock, offset, length, progress)
    status, headers, body, _ = _read_response(sock)
    return status, body, _keep_alive(headers)


def _keep_alive(headers: dict[str, str]) -> bool:
    return headers.get("connection", "").lower() != "close"


def _await_continue(sock: socket.socket) -> tuple[int, bytes] | None:
    """After an ``Expect: 100-continue`` head: None to send the body (``100``, or no answer within
    :data:`CONTINUE_WAIT_S`: a server or proxy that ignores ``Expect``), else the final answer."""
    stall = sock.gettimeout()
    sock.settimeout(CONTINUE_WAIT_S)
    try:
        first = sock.recv(65536)
    except TimeoutError:
        return None
    finally:
        sock.settimeout(stall)
    if not first:
        raise ConnectionResetError("the worker closed the connection before answering")
    first = _read_head(sock, first)
    if first.startswith((b"HTTP/1.1 100 ", b"HTTP/1.0 100 ")):
        return None  # nothing follows a 100 before the body is sent
    status, _, body, _ = _read_response(sock, data=first)
    return status, body


def _get_body(sock: socket.socket, request: bytes, file: IO[bytes], progress: list[int],
              report: Callable[[int, int], None] | None, check: OutputCheck | None = None) -> tuple[int, bytes, bool]:
    """Send a ``GET``; write the body to ``file`` at ``progress[0]``, keeping ``progress`` = [received, size].

    Returns (status, the body of an error answer, whether the connection may be used again).
    """
    sock.sendall(request)
    status, headers, _, first = _read_response(sock, keep_body=False)
    if status not in (200, 206):
        length = int(headers.get("content-length", "0") or 0)
        body = bytearray(first)
        while len(body) < length and (more := sock.recv(length - len(body))):
            body += more
        return status, bytes(body[:length]), False
    remaining = int(headers.get("content-length", "0") or 0)
    if progress[1] < 0:
        progress[1] = progress[0] + remaining
    file.seek(progress[0])
    keep = _keep_alive(headers) and len(first) <= remaining  # nothing read past the body
    if first:
        file.write(first[:remaining])
        if check is not None:
            check.update(first[:remaining])
        progress[0] += min(len(first), remaining)
        remaining -= min(len(first), remaining)
    with _FileWriter(file, check) as writer:
        while remaining > 0:
            view = writer.buffer()
            got = 0
            while got < len(view) and got < remaining:  # fill a whole buffer: few handoffs
                n = sock.recv_into(view[got:], min(len(view) - got, remaining - got))
                if not n:
                    break
                got += n
            if got:
                writer.write(view[:got])
                progress[0] += got
                remaining -= got
                if report is not None:
                    report(progress[0], progress[1])
            if remaining and got < len(view):
                raise ConnectionResetError(f"the worker closed the download at byte {progress[0]}")
    return status, b"", keep


class _FileWriter:
    """Writes buffers to a file and hashes them, in two threads of their own, while the caller fills the next.

    A filled buffer goes to the writer thread (``write``, then the file's write-behind,
    wireio/writeback.py) and to the hasher thread (``check``) at once, and is free again once
    both are done with it: the write and the hash of one buffer and the filling of the next
    overlap (file writes, hashlib and ``recv_into`` all release the GIL). At most
    :data:`WRITE_BUFFERS` buffers of :data:`WRITE_BUFFER_BYTES` in all; small buffers keep what is
    left to do after the last byte arrived (the fixed cost at the end of a download) small.
    """

    def __init__(self, file: IO[bytes], check: OutputCheck | None = None) -> None:
        self._file = file
        self._check = check
        self._end = file.tell()  # where the next write lands
        self._behind = WriteBehind(file.fileno(), self._end)  # a big download does not pile up in the page cache
        self._free: queue.Queue[memoryview] = queue.Queue()
        for _ in range(WRITE_BUFFERS):
            self._free.put(memoryview(bytearray(WRITE_BUFFER_BYTES)))
        self._full: queue.Queue[memoryview | None] = queue.Queue()  # to write
        self._to_hash: queue.Queue[memoryview | None] = queue.Queue()
        self._written: queue.Queue[memoryview | None] = queue.Queue()  # written (the hasher frees them, in order)
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._write, name="fleetwire-data-write", daemon=True)]
        if check is not None:
            self._threads.append(threading.Thread(target=self._hash, name="fleetwire-data-hash", daemon=True))

    def __enter__(self) -> _FileWriter:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._full.put(None)
        self._to_hash.put(None)
        for thread in self._threads:
            thread.join()
        if self._error is not None and exc[0] is None:
            raise self._error

    def buffer(self) -> memoryview:
        """A free buffer (waits while all are being written or hashed)."""
        if self._error is not None:
            raise self._error
        return self._free.get()

    def write(self, part: memoryview) -> None:
        self._full.put(part)
        if self._check is not None:
            self._to_hash.put(part)

    def _write(self) -> None:
        while (part := self._full.get()) is not None:
            try:
                if self._error is None:
                    self._file.write(part)
                    self._end += len(part)
                    self._behind.wrote(self._end)
            except BaseException as exc:  # reported to the filling thread
                self._error = exc
            finally:
                if self._check is not None:
                    self._written.put(part)
                else:
                    self._free.put(memoryview(part.obj))  # type: ignore[arg-type]
        self._written.put(None)

    def _hash(self) -> None:
        assert self._check is not None
        while (part := self._to_hash.get()) is not None:
            try:
                if self._error is None:
                    self._check.update(part)
            except BaseException as exc:  # reported to the filling thread
                self._error = exc
            finally:
                self._written.get()  # the writer is done with it too (both take the buffers in the same order)
                self._free.put(memoryview(part.obj))  # type: ignore[arg-type]


def _auth(ticket: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ticket}"}


class Uploads:
    """Uploads one plan's inputs to each attempt's worker as its ``data_ready`` arrives, until the plan ends.

    Args:
        plan_id: the plan.
        sources: its inputs.
        events: the plan's event stream (``plan.events()``).
        transport: how bytes move.
        refresh: asks the coordinator for a fresh ``put`` grant (an expired ticket).
    """

    def __init__(self, plan_id: str, sources: Mapping[str, InputSource], events: AsyncIterator[Event],
                 transport: Transport, refresh: Callable[[], Awaitable[Grant]]) -> None:
        self.plan_id = plan_id
        self.sources = dict(sources)
        self.error: BaseException | None = None  # the last attempt's upload failure, if any
        self.uploaded: list[int] = []  # attempts whose inputs all arrived
        self._events = events
        self._transport = transport
        self._refresh = refresh
        self._current: asyncio.Task[None] | None = None
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        succeeded = False
        try:
            async for event in self._events:
                succeeded = event.kind == "succeeded"
                if event.kind == "data_ready" and self.sources:
                    if self._current is not None:
                        self._current.cancel()  # a newer attempt: the older worker is gone
                    self._current = asyncio.ensure_future(self._upload_all(Grant.from_event(event)))
        except Exception as exc:  # the session ended: the plan's own calls report it
            log.debug("uploads of plan %s stopped: %s", self.plan_id, exc)
        finally:
            if succeeded and self._current is not None and not self._current.done():
                # Every input arrived (the handler ran): the upload is only reading the worker's answer.
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(self._current), SETTLE_S)
            if self._current is not None:
                self._current.cancel()
                with contextlib.suppress(BaseException):
                    await self._current
            for source in self.sources.values():
                source.close()

    async def _upload_all(self, grant: Grant) -> None:
        try:
            await asyncio.gather(*(self._upload(grant, source) for source in self.sources.values()))
            self.uploaded.append(grant.attempt)
        except DataTransferError as exc:
            self.error = exc
            if exc.status == 410:  # cancelled, ended, revoked or moved on: a newer attempt gets its own data_ready
                log.info("fleetwire: upload of plan %s attempt %d stopped: %s", self.plan_id, grant.attempt, exc)
            else:
                log.warning("fleetwire: upload of plan %s attempt %d failed: %s", self.plan_id, grant.attempt, exc)

    async def _upload(self, grant: Grant, source: InputSource) -> None:
        try:
            await self._transport.upload(grant, source)
        except DataTransferError as exc:
            if exc.status != 401:
                raise
            fresh = await self._refresh()  # the ticket expired (a long upload, a rotated key)
            if fresh.attempt != grant.attempt:
                return
            await self._transport.upload(fresh, source)

    def cancel(self) -> None:
        self.task.cancel()


async def fetch_to(transport: Transport, grant: Grant, name: str, path: str | os.PathLike[str],
                   check: OutputCheck | None = None) -> pathlib.Path:
    """Write output ``name`` to ``path``: straight from the socket to the file on the direct path, else by chunks.

    With ``check``, the bytes are hashed on the way; a mismatch fetches them again (:func:`refetch_on_mismatch`),
    then raises :class:`OutputMismatch` (no file left).
    """
    if isinstance(transport, DirectTransport) and grant.url:
        direct = transport
        return await refetch_on_mismatch(lambda: direct.download_to(grant, name, path, check), check)
    return await refetch_on_mismatch(lambda: write_chunks(transport.download(grant, name), path, check), check)


async def refetch_on_mismatch(fetch: Callable[[], Awaitable[pathlib.Path]], check: OutputCheck | None) -> pathlib.Path:
    """``fetch()`` an output to its file; when its digest does not match ``check``, fetch it again from byte 0.

    The worker's copy was checked when it was made, so a mismatch is taken for damage on the way:
    logged, and retried at most :data:`MISMATCH_RETRIES` times before :class:`OutputMismatch` is raised.
    """
    retries = 0
    while True:
        try:
            return await fetch()
        except OutputMismatch as exc:
            if check is None or retries >= MISMATCH_RETRIES:
                raise
            retries += 1
            log.warning("fleetwire: %s; fetching it again (retry %d of %d)", exc, retries, MISMATCH_RETRIES)
            check.restart()


async def write_chunks(chunks: AsyncIterator[bytes], path: str | os.PathLike[str],
                       check: OutputCheck | None = None) -> pathlib.Path:
    """Write a download to ``path`` (through a temporary file renamed at the end), checked by ``check``.

    Chunks are written (with write-behind) and hashed by two threads of their own at once
    (wireio/chunkwrite.py :class:`~wireio.chunkwrite.ChunkWriter`), in batches of about
    :data:`CHUNK_BYTES`, while the next ones arrive, at most :data:`WRITES_AHEAD` batches
    under way: the source (a relayed stream, which credits each chunk once it is taken) is not
    held up by the disk or the hash chunk by chunk, and memory stays bounded.
    """
    target = pathlib.Path(path)
    partial = target.with_name(f".{target.name}.partial")
    file = await asyncio.to_thread(open, partial, "wb")
    writer: ChunkWriter | None = None
    batch: list[bytes] = []
    batched = 0
    try:
        writer = ChunkWriter(file, check, ahead=WRITES_AHEAD, direct_io=True)  # a fresh file: O_DIRECT staged
        async for chunk in chunks:
            batch.append(chunk)
            batched += len(chunk)
            if batched < CHUNK_BYTES:  # small chunks (the relay's 256 KiB) go to the threads a few at a time
                continue
            await writer.put(batch)
            batch, batched = [], 0
        if batch:
            await writer.put(batch)
        await writer.finish()
        if check is not None:
            check.verify()
    except BaseException:
        if writer is not None:
            writer.close()  # the writes under way finish before the file closes
        file.close()
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    file.close()
    await asyncio.to_thread(shutil.move, partial, target)
    return target

