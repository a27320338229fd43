"""Plans' bytes through the coordinator when the worker cannot be reached directly (docs/PROTOCOL.md §11 Relay).

Theory of operation:

* :class:`RelayTransport` implements :class:`~fleetwire.data.Transport` over the client's own
  websocket session: ``data_open`` (with the grant's ticket), then ``data_chunk`` s of at most
  256 KiB, never more unacknowledged bytes in flight than the stream's credit
  (``data_credit``), so the client holds at most one window of a stream in memory, the
  coordinator no more, and a slow worker slows only its own uploads. On a msgpack session an
  upload reads its source straight into its chunks' frames, in a thread of its own, reusing a
  frame's buffer once its bytes are acknowledged (fleetwire/chunkread.py ``FrameReader``); else
  (JSON, a link without ``post_frame``) it reads a MiB at a time and encodes each 256 KiB chunk.
  A download written to a file is written and hashed by two threads of their own, with
  write-behind (wireio/chunkwrite.py ``ChunkWriter``). A download sends a
  ``data_credit`` once the caller has taken a quarter of the stream's window (the coordinator
  says the window right after the open; ``credit_every``), or each chunk when it does not say.
* A stream that breaks (``data_end(relay_closed)``: a session closed, the coordinator
  restarted, the stream sat idle past the coordinator's ``--relay-idle``; ``relay_busy``;
  nothing heard for ``stall_timeout_s``) is opened again: an upload resumes from the offset the
  worker holds, a download from the bytes already received. An attempt that moved bytes resets
  the count of re-opens (``max_resumes`` counts breaks in a row, not a slow transfer's idle
  ends). The client tells the transport when its connection drops or comes back (:meth:`reset`).
* A stream the coordinator has no room for yet waits in line: ``data_credit(credit=0, wait=why)``
  (docs/PROTOCOL.md §11 Relay, *Shares*). The transport logs the reason (``fleetwire.data``,
  info), keeps it in :attr:`RelayTransport.waits` while it lasts, and does not count the wait
  against ``stall_timeout_s``: the coordinator answers a waiting stream with its credit or an end.
* Every open gets a new stream id (``data_open.stream``); a message naming another id belongs
  to an earlier open of the same stream (a late ``data_end(relay_closed)`` after a re-open) and
  is ignored.
* An output its worker no longer holds ends ``output_gone``: :class:`OutputGone` (status 404,
  as the direct path's answer).
* :class:`AutoTransport` is the client's default: direct to the worker's data endpoint
  (:class:`~fleetwire.direct.DirectTransport`) when the grant has a URL and it can be dialled,
  else through the relay; a direct transfer that fails at the transport level (no HTTP answer)
  goes on through the relay from where it stopped (both paths write the same spool entry on
  the worker). It remembers per URL, for ``unreachable_ttl_s``, that a worker could not be dialled.
* Which path carried what: the worker's ``input_received`` events say ``"via": "relay"`` or
  ``"direct"``; :attr:`AutoTransport.paths` (and ``plan.transfers``) say it for the SDK's side,
  downloads included.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import pathlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import urlsplit

from fleetwire.chunkread import FrameReader
from fleetwire.data import (
    DataTransferError,
    Grant,
    OutputCheck,
    OutputMismatch,
    Source,
    Transport,
    refetch_on_mismatch,
    write_chunks,
)
from fleetwire.direct import fetch_to
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import CLOSED, GONE, MAX_CHUNK_BYTES
from protocol.transfer import download, upload
from protocol.transfer.retries import TICKET_REFRESHES, Resumes, end_step

__all__ = ["AutoTransport", "FrameLink", "OutputGone", "RelayLink", "RelayTransport"]

log = logging.getLogger("fleetwire.data")

Key = tuple[str, int, str, str]
READ_BYTES = 4 * MAX_CHUNK_BYTES  # an upload reads its source this much at a time
REACHED_TTL_S = 30.0  # a data endpoint dialled this recently is not dialled again before a transfer


class RelayLink(Protocol):
    """What the relay needs of a client: a way to queue a message on its session."""

    def post(self, msg: Any) -> None:
        """Queue ``msg`` for the coordinator (no reply expected).

        Raises:
            FleetwireConnectionError: the session has ended.
        """
        ...


class FrameLink(RelayLink, Protocol):
    """A link that also takes frames already encoded (msgpack): a relayed upload's chunks, read into their frames."""

    encoding: str

    def post_frame(self, frame: memoryview) -> None:
        """Queue ``frame`` (one message in ``encoding``) for the coordinator as it is."""
        ...


class OutputGone(DataTransferError):
    """The output's worker no longer holds it (never made, expired from its spool, or the worker restarted)."""


class _Stream:
    __slots__ = ("acked", "changed", "chunks", "end", "first", "id", "size", "wait", "window")

    def __init__(self, stream_id: int) -> None:
        self.id = stream_id  # data_open.stream: messages naming another id are an older open's
        self.changed = asyncio.Event()
        self.acked = -1  # put: the worker's acknowledged offset (-1: no credit yet)
        self.first = -1  # put: the offset of the first credit (where this open started)
        self.window = 0
        self.size = -1
        self.wait = ""  # the coordinator's reason while the stream waits in line for relay room
        self.end: DataEnd | None = None
        self.chunks: collections.deque[DataChunk] = collections.deque()  # get: received, not yet taken


class _Retry(Exception):
    """The stream broke in a way that opening it again may mend."""

    progressed = False  # the broken open moved bytes first (its re-opens start counting again)


class RelayTransport:
    """Uploads and downloads through the coordinator (see the module docstring).

    Args:
        link: the client session to send on.
        stall_timeout_s: a stream with no message for this long is opened again.
        max_resumes: re-opens of one transfer (after breaks) before it fails.
    """

    def __init__(self, link: RelayLink, *, stall_timeout_s: float = 30.0, max_resumes: int = 8) -> None:
        self._link = link
        self.stall_timeout_s = stall_timeout_s
        self.max_resumes = max_resumes
        self._streams: dict[Key, _Stream] = {}
        self._ids = itertools.count(1)
        self.paths: dict[tuple[str, int, str, str], str] = {}
        """(plan id, attempt, "put"|"get", name) -> "relay": the transfers this transport finished."""
        self.waits: dict[Key, str] = {}
        """(plan id, attempt, name, "put"|"get") -> why: the streams waiting in line for relay room now."""

    # ------------------------------------------------------------------ from the session

    def receive(self, msg: DataChunk | DataCredit | DataEnd) -> None:
        """A relay message from the coordinator (the client's reader calls this; no awaits)."""
        key: Key = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        stream = self._streams.get(key)
        if stream is None or (msg.stream and msg.stream != stream.id):
            return  # a stream this transport gave up on, or an earlier open of it
        match msg:
            case DataCredit():
                if msg.wait:  # in line for relay room: nothing may flow yet
                    if not stream.wait:
                        log.info("fleetwire: relayed %s of %r waits: %s", _what(key), msg.name, msg.wait)
                    stream.wait = self.waits[key] = msg.wait
                    if msg.size >= 0:
                        stream.size = msg.size
                    stream.changed.set()  # a waiter goes back to waiting, now without the stall timeout
                    return
                if stream.wait:
                    stream.wait = ""
                    self.waits.pop(key, None)
                stream.acked = max(stream.acked, msg.offset)
                if stream.first < 0:
                    stream.first = stream.acked
                stream.window = msg.credit or stream.window
                if msg.size >= 0:
                    stream.size = msg.size
            case DataChunk():
                stream.chunks.append(msg)
            case DataEnd():
                stream.end = msg
        stream.changed.set()

    def reset(self) -> None:
        """The connection dropped or was replaced: every open stream is opened again."""
        for key, stream in self._streams.items():
            if stream.end is None:
                stream.end = DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=_dir(key), code=CLOSED,
                                     message="the client's connection was replaced")
                stream.changed.set()

    async def aclose(self) -> None:
        self.reset()

    # ------------------------------------------------------------------ transfers

    async def upload(self, grant: Grant, source: Source) -> None:
        """Send the whole input through the coordinator, from the offset the worker holds."""
        key: Key = (grant.plan_id, grant.attempt, source.name, "put")
        resumes = Resumes(self.max_resumes)
        while True:
            try:
                await self._upload_once(key, grant, source)
                self.paths[(key[0], key[1], "put", key[2])] = "relay"
                return
            except _Retry as exc:
                wait = resumes.broke(progressed=exc.progressed)
                if wait is None:
                    raise DataTransferError(f"input {source.name!r} (relayed): {exc}", 503) from None
                log.debug("relayed upload of %r interrupted (%s); opening it again", source.name, exc)
                await asyncio.sleep(wait)

    async def _upload_once(self, key: Key, grant: Grant, source: Source) -> None:
        stream = self._open(key, DataOpen(plan_id=key[0], attempt=key[1], name=key[2], direction="put",
                                          ticket=grant.ticket))
        chunks: AsyncIterator[bytes] | None = None
        try:
            while stream.acked < 0 or stream.wait:
                await self._wait(stream, source.name)
            if getattr(self._link, "encoding", None) == "msgpack" and hasattr(self._link, "post_frame"):
                await self._upload_frames(key, stream, source, self._link)  # type: ignore[arg-type]
                return
            sent = stream.acked
            chunks = aiter(source.chunks(sent, READ_BYTES))
            block = memoryview(b"")  # read a MiB at a time (one thread hop), sent as 256 KiB chunks
            while True:
                self._check_end(stream, source.name, done_ok=True)
                if stream.end is not None:
                    return  # verified
                if upload.next_length(sent, stream.acked, stream.window, source.size):
                    if not block:
                        block = memoryview(await anext(chunks))
                    data, block = block[:MAX_CHUNK_BYTES], block[MAX_CHUNK_BYTES:]
                    self._link.post(DataChunk(plan_id=key[0], attempt=key[1], name=key[2], offset=sent,
                                              data=data,  # type: ignore[arg-type]  # encoded (copied) right here
                                              direction="put", last=sent + len(data) >= source.size,
                                              stream=stream.id))
                    sent += len(data)
                    continue
                await self._wait(stream, source.name)
        except _Retry as exc:
            exc.progressed = stream.acked > stream.first >= 0
            raise
        finally:
            if chunks is not None:
                with contextlib.suppress(Exception):
                    await chunks.aclose()  # type: ignore[attr-defined]
            self._close(key, stream)

    async def _upload_frames(self, key: Key, stream: _Stream, source: Source, link: FrameLink) -> None:
        """The chunks from the worker's offset, each read into its frame (fleetwire/chunkread.py), within the credit."""
        sent = stream.acked
        reader = FrameReader(source, (key[0], key[1], key[2]), sent, buffers=_buffers(stream.window),
                             wake=stream.changed.set, stream=stream.id)
        try:
            while True:
                self._check_end(stream, source.name, done_ok=True)
                if stream.end is not None:
                    return  # verified
                reader.acked(stream.acked)
                reader.allow(_buffers(stream.window))
                if upload.next_length(sent, stream.acked, stream.window, source.size):
                    taken = reader.take()
                    if taken is not None:
                        link.post_frame(taken[0])
                        sent = taken[1]
                        continue
                await self._wait(stream, source.name)
        finally:
            reader.close()

    def download(self, grant: Grant, name: str, offset: int = 0) -> AsyncIterator[bytes]:
        """The output's bytes through the coordinator, from ``offset``."""
        return self._download(grant, name, offset, views=False)

    async def fetch_to(self, grant: Grant, name: str, path: str | os.PathLike[str],
                       check: OutputCheck | None = None) -> pathlib.Path:
        """Write an output to ``path`` through the coordinator; ``check``: the digest it must have.

        The chunks are written as the views into their frames the session decoded (msgpack), not
        copied into ``bytes`` first.
        """
        return await refetch_on_mismatch(
            lambda: write_chunks(self._download(grant, name, 0, views=True), path, check), check)

    async def _download(self, grant: Grant, name: str, offset: int, *, views: bool) -> AsyncIterator[bytes]:
        """``views``: yield chunks as they were decoded (a msgpack session's are memoryviews into their
        frames); else as ``bytes``, what :meth:`download`'s callers are promised."""
        key: Key = (grant.plan_id, grant.attempt, name, "get")
        received, refreshes = offset, 0
        resumes = Resumes(self.max_resumes)
        while True:
            started = received
            rules = download.Receiver(received)
            stream = self._open(key, DataOpen(plan_id=key[0], attempt=key[1], name=name, direction="get",
                                              ticket=grant.get_ticket or grant.ticket, offset=received))
            try:
                while True:
                    while stream.chunks:
                        chunk = stream.chunks.popleft()
                        wrong = rules.chunk(chunk.offset, len(chunk.data))
                        if wrong is not None:
                            raise DataTransferError(f"output {name!r} (relayed): {wrong}", 400)
                        if chunk.data:
                            yield chunk.data if views or type(chunk.data) is bytes else bytes(chunk.data)
                        if chunk.last:
                            self.paths[(key[0], key[1], "get", name)] = "relay"
                            return
                        credit = rules.credit(stream.window)  # per quarter window
                        if credit is not None:
                            self._link.post(DataCredit(plan_id=key[0], attempt=key[1], name=name,
                                                       direction="get", offset=credit, stream=stream.id))
                    self._check_end(stream, name, done_ok=False)
                    await self._wait(stream, name)
            except _Retry as exc:
                received = rules.received
                wait = resumes.broke(progressed=received > started)  # bytes came: a new run of breaks
                if wait is None:
                    raise DataTransferError(f"output {name!r} (relayed): {exc}", 503) from None
                await asyncio.sleep(wait)
            except DataTransferError as exc:  # 401: the ticket's key is gone (a coordinator restart): a fresh one
                if exc.status != 401 or refreshes >= TICKET_REFRESHES:
                    raise
                received = rules.received
                refreshes += 1
                grant = await grant.renewed(f"output {name!r} (relayed)", exc)
            finally:
                self._close(key, stream)

    # ------------------------------------------------------------------ helpers

    def _open(self, key: Key, msg: DataOpen) -> _Stream:
        stream = self._streams[key] = _Stream(next(self._ids))
        msg.stream = stream.id
        self._link.post(msg)
        return stream

    def _close(self, key: Key, stream: _Stream) -> None:
        if self._streams.get(key) is not stream:
            return
        del self._streams[key]
        self.waits.pop(key, None)
        if stream.end is None:  # given up on (cancelled, an error here): free the coordinator's stream
            with contextlib.suppress(Exception):
                self._link.post(DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=_dir(key),
                                        code="cancelled", message="the client stopped the transfer",
                                        stream=stream.id))

    async def _wait(self, stream: _Stream, name: str) -> None:
        if stream.end is None and not stream.chunks:
            stream.changed.clear()
            try:  # waiting in line is the coordinator's to end (a credit or a data_end), not a stall; not
                # asyncio.wait_for: on 3.11 it loses a cancel that comes as the stream changes (a transfer goes on)
                async with asyncio.timeout(None if stream.wait else self.stall_timeout_s):
                    await stream.changed.wait()
            except TimeoutError:
                raise _Retry(f"nothing heard of {name!r} for {self.stall_timeout_s:g} s") from None
        if stream.end is not None and stream.end.code:
            self._check_end(stream, name, done_ok=False)

    @staticmethod
    def _check_end(stream: _Stream, name: str, *, done_ok: bool) -> None:
        end = stream.end
        if end is None:
            return
        step, status = end_step(end.code, done_ok=done_ok)
        if step == "done":
            return
        if step == "retry":
            raise _Retry(f"{end.code}: {end.message}" if end.code else "the stream ended before its last chunk")
        what = "input" if end.direction == "put" else "output"
        error = OutputGone if end.code == GONE else DataTransferError
        raise error(f"{what} {name!r} (relayed): {end.code}: {end.message}", status)


def _buffers(window: int) -> int:
    """Frames an upload with this window may hold: the window's (sent, not acknowledged) and a read ahead."""
    return (max(window, MAX_CHUNK_BYTES) + READ_BYTES) // MAX_CHUNK_BYTES


def _dir(key: Key) -> Any:
    return "put" if key[3] == "put" else "get"


def _what(key: Key) -> str:
    return "upload" if key[3] == "put" else "download"


class AutoTransport:
    """Direct to the worker when it can be dialled, else through the coordinator (see the module docstring).

    Args:
        direct: the direct transport.
        relay: the relay.
        connect_timeout_s: how long a dial to a worker's data endpoint may take before the relay is used.
        unreachable_ttl_s: how long a worker URL that could not be dialled goes straight to the relay.
    """

    def __init__(self, direct: Transport, relay: RelayTransport, *, connect_timeout_s: float = 3.0,
                 unreachable_ttl_s: float = 60.0) -> None:
        self.direct = direct
        self.relay = relay
        self.connect_timeout_s = connect_timeout_s
        self.unreachable_ttl_s = unreachable_ttl_s
        self.paths: dict[tuple[str, int, str, str], str] = {}
        """(plan id, attempt, "put"|"get", name) -> "direct" or "relay": the path that finished each transfer."""
        self._unreachable: dict[str, float] = {}  # url -> until (monotonic)
        self._reached: dict[str, float] = {}  # url -> until: dialled lately, not dialled again before each transfer

    async def upload(self, grant: Grant, source: Source) -> None:
        key = (grant.plan_id, grant.attempt, "put", source.name)
        if await self._reachable(grant.url):
            try:
                await self.direct.upload(grant, source)
                self.paths[key] = "direct"
                return
            except DataTransferError as exc:
                if exc.status:  # the worker answered: the relay would get the same answer
                    raise
                self._mark_unreachable(grant.url, exc)
        await self.relay.upload(grant, source)

    def download(self, grant: Grant, name: str) -> AsyncIterator[bytes]:
        return self._download(grant, name)

    async def _download(self, grant: Grant, name: str) -> AsyncIterator[bytes]:
        key = (grant.plan_id, grant.attempt, "get", name)
        received = 0
        if await self._reachable(grant.url):
            try:
                async for chunk in self.direct.download(grant, name):
                    received += len(chunk)
                    yield chunk
                self.paths[key] = "direct"
                return
            except DataTransferError as exc:
                if exc.status:
                    raise
                self._mark_unreachable(grant.url, exc)
        async for chunk in self.relay.download(grant, name, received):
            yield chunk

    async def fetch_to(self, grant: Grant, name: str, path: str | os.PathLike[str],
                       check: OutputCheck | None = None) -> pathlib.Path:
        """Write an output to ``path``: the direct path's own way when the worker can be dialled, else relayed.

        ``check``: the digest the bytes must have (:class:`OutputMismatch` otherwise, on either path).
        """
        if await self._reachable(grant.url):
            try:
                target = await fetch_to(self.direct, grant, name, path, check)
                self.paths[(grant.plan_id, grant.attempt, "get", name)] = "direct"
                return target
            except DataTransferError as exc:
                if exc.status or isinstance(exc, OutputMismatch):  # the relay would bring the same bytes
                    raise
                self._mark_unreachable(grant.url, exc)
            if check is not None:
                check.restart()  # the relay writes the file again from byte 0
        return await self.relay.fetch_to(grant, name, path, check)

    async def aclose(self) -> None:
        await self.direct.aclose()
        await self.relay.aclose()

    async def _reachable(self, url: str) -> bool:
        """Whether a TCP connection to the data endpoint at ``url`` opens (remembered while it does not)."""
        if not url:
            return False
        now = time.monotonic()
        until = self._unreachable.get(url)
        if until is not None:
            if now < until:
                return False
            del self._unreachable[url]
        if self._reached.get(url, 0.0) > now:
            return True
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:  # not asyncio.wait_for: on 3.11 it loses a cancel that comes as the connection opens (the transfer
            async with asyncio.timeout(self.connect_timeout_s):  # then went on after the caller gave up)
                _, writer = await asyncio.open_connection(parts.hostname, port)
        except (OSError, TimeoutError) as exc:
            self._mark_unreachable(url, exc)
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        if len(self._reached) > 1024:
            self._reached.clear()
        self._reached[url] = now + REACHED_TTL_S
        return True

    def _mark_unreachable(self, url: str, exc: BaseException) -> None:
        self._reached.pop(url, None)
        log.info("fleetwire: worker data endpoint %s unreachable (%s); using the relay", url, exc)
        self._unreachable[url] = time.monotonic() + self.unreachable_ttl_s
