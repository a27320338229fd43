"""Plans' inputs and outputs in the SDK: grants, transports, uploads and downloads (docs/PROTOCOL.md §Data plane).

Theory of operation:

* The caller's inputs become :class:`Source` s with their size and digest before the submit
  (fleetwire/inputs.py ``prepare_inputs``: ``bytes``, ``memoryview``, ``pathlib.Path`` or a binary file).
* The coordinator never carries the bytes. Once a plan is leased its stream gets ``data_ready``
  (per attempt) with the worker's data URL and a ``put`` ticket; :class:`Uploads` (one task per
  plan) uploads every input there through a :class:`Transport`. A newer attempt (its worker
  died) gets the inputs again: the sources are kept until the plan ends.
* Two transports: fleetwire/direct.py ``DirectTransport`` speaks HTTP/1.1 to the worker's data
  endpoint; fleetwire/relay.py ``RelayTransport`` carries the same bytes through the coordinator.
  The client's default ``AutoTransport`` picks the relay when a grant has no URL or the direct
  dial fails. Their rules (offsets, resumes, credit, what each answer means) are
  protocol/transfer's; these modules move the bytes.
* What a worker's answer asks of a transfer (docs/PROTOCOL.md §Data plane, protocol/transfer/retries.py):
  ``401`` mid-transfer (a ticket key the worker no longer has: the coordinator restarted, or
  rotated twice) fetches a fresh ticket through :attr:`Grant.refresh` and goes on from the byte
  reached, at most ``TICKET_REFRESHES`` times; ``409`` after a whole input (its digest did not
  match: the worker dropped its bytes) sends it again from 0, logged; ``503`` (the worker holds
  too many uploads not yet assigned to it) waits and asks again; ``410`` (the attempt was
  cancelled, ended, revoked or is not the worker's) ends that attempt's transfer. A downloaded
  output whose digest does not match is fetched again from 0, at most ``MISMATCH_RETRIES``
  times, logged, before :class:`OutputMismatch` is raised (:func:`refetch_on_mismatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pathlib
import shutil
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote

from protocol.messages import DataGrant, Event, InputSpec
from protocol.tickets import new_hasher
from protocol.transfer.retries import MISMATCH_RETRIES
from wireio.chunkwrite import ChunkWriter

__all__ = [
    "CHUNK_BYTES",
    "DataTransferError",
    "Grant",
    "OutputCheck",
    "OutputMismatch",
    "Progress",
    "Source",
    "Transport",
    "Uploads",
    "refetch_on_mismatch",
    "write_chunks",
]

log = logging.getLogger("fleetwire.data")

CHUNK_BYTES = 1 << 20
SETTLE_S = 10.0  # how long a succeeded plan's last upload may take to read the worker's answer
WRITES_AHEAD = 4  # batches of a download by chunks waiting for the disk (about 4 MiB)
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
    rebuilding: str = ""
    """A plan making the output asked for again, its copies being lost (``data_grant.rebuilding``): no ticket then."""
    digests: tuple[tuple[str, str], ...] = ()
    """(name, digest) of the files the ticket covers, as the grant says (``data_grant.files``)."""

    @classmethod
    def from_event(cls, event: Event, refresh: Callable[[], Awaitable[Grant]] | None = None) -> Grant:
        data = event.data or {}
        return cls(event.plan_id, int(data.get("attempt", event.attempt)), data.get("url", ""),
                   data.get("ticket", ""), data.get("get_ticket", ""), refresh, str(data.get("key") or ""))

    @classmethod
    def from_reply(cls, reply: DataGrant, refresh: Callable[[], Awaitable[Grant]] | None = None) -> Grant:
        digests = tuple((name, claim[1]) for name, claim in reply.files.items()
                        if len(claim) >= 2 and isinstance(claim[1], str) and claim[1])  # fmt: skip
        return cls(reply.plan_id, reply.attempt, reply.url, reply.ticket, reply.ticket, refresh, reply.key,
                   reply.rebuilding, digests)

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


class Source(Protocol):
    """One input's content as the transports read it (fleetwire/inputs.py ``InputSource``)."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def digest(self) -> str: ...
    @property
    def data(self) -> memoryview | None:
        """The content when it is in memory; None: it is a file (:attr:`path`) or was let go."""
        ...
    @property
    def path(self) -> pathlib.Path | None:
        """The file the content is read from; None: it is in memory (:attr:`data`)."""
        ...
    def spec(self) -> InputSpec: ...
    def chunks(self, offset: int, chunk: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
        """The content from ``offset``, one chunk at a time."""
        ...
    def send(self, sock: socket.socket, offset: int, length: int, progress: Progress | None = None) -> None:
        """Send ``length`` bytes from ``offset`` on a blocking socket. Any thread."""
        ...
    def close(self) -> None:
        """The plan ended: let go of the content."""
        ...


class Transport(Protocol):
    """How the SDK moves a plan's bytes: fleetwire/direct.py ``DirectTransport`` (to the worker), or a relay."""

    async def upload(self, grant: Grant, source: Source) -> None:
        """Send the whole input (resuming from what the worker already acknowledged)."""
        ...

    def download(self, grant: Grant, name: str) -> AsyncIterator[bytes]:
        """The output's bytes, in chunks."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


class Uploads:
    """Uploads one plan's inputs to each attempt's worker as its ``data_ready`` arrives, until the plan ends.

    Args:
        plan_id: the plan.
        sources: its inputs.
        events: the plan's event stream (``plan.events()``).
        transport: how bytes move.
        refresh: asks the coordinator for a fresh ``put`` grant (an expired ticket).
    """

    def __init__(self, plan_id: str, sources: Mapping[str, Source], events: AsyncIterator[Event],
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

    async def _upload(self, grant: Grant, source: Source) -> None:
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
