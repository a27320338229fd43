"""The worker's side of the relay: inputs and outputs carried over its coordinator session (docs/PROTOCOL.md §11 Relay).

The coordinator passes on a client's ``data_open``; this module checks its ticket as the HTTP
data endpoint does (protocol/tickets.py: the same keys, the same 401/403 reasons, here as
``data_end`` codes ``unauthorized``/``forbidden``) and then:

* ``put`` (an input): declares it in the spool (worker_agent/spool.py) and answers
  ``data_credit`` with the offset it holds, so a transfer resumes where the last one stopped
  (direct or relayed: both write the same spool entry). Each ``data_chunk`` is written at the
  entry's offset; a ``data_credit`` acknowledges them once per quarter window
  (protocol/relay.py ``credit_every``), not per chunk; the last byte settles the input
  (digest checked) and the stream ends with ``data_end`` ("" when verified, else
  ``input_mismatch`` or ``worker_disk_full`` naming the input). Chunks of a file-backed input
  are written and hashed off the event loop (:class:`_Upload`): one task per upload takes the
  chunks queued since its last store, up to the next credit, and writes them in one thread
  while another hashes them (both release the GIL), so a disk that blocks in writeback or a
  digest pass never stalls the agent's reader. A credit is sent only once its bytes are
  stored, so what is queued never exceeds the window the coordinator enforces.
* ``get`` (an output): sends chunks of the spooled file while the client's credit allows,
  more as each ``data_credit`` comes, the last marked ``last``. It reads at most
  :data:`READ_AHEAD_BYTES` at a time, more each time the agent's writer has sent what was queued
  (:meth:`RelayEndpoint.resume`), so a wide window is not read whole into the send queue (and
  encoded whole into frames) at once: the window's bytes wait in the sockets and the coordinator,
  not in the worker's memory.

* An output this worker no longer holds (never made, expired from the spool, or the worker
  restarted) ends ``output_gone``, which the SDK raises as :class:`~fleetwire.relay.OutputGone`.

Every message of a stream carries the id its client gave it (``data_open.stream``); a chunk,
credit or end naming another id than the stream open here is dropped: it belongs to an older
open of the same stream (docs/PROTOCOL.md §11 Relay, *Stream ids*).

Everything else runs in the agent's reader, synchronously (no awaits between a message and
its effect): reads of outputs are of one chunk (at most 256 KiB) each, and so are the writes of
inputs held in memory. Messages go out through the
agent's send queue, unnumbered (a relayed stream that breaks is opened again, not replayed).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import IO, Any, Literal

import structlog

import protocol
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import CLOSED, GONE, MAX_CHUNK_BYTES, REFUSED, UNAUTHORIZED, VIOLATION, credit_every
from protocol.tickets import TicketError, verify
from worker_agent.spool import INPUTS_UNAVAILABLE, InputFile, OutputFile, Spool, SpoolError

__all__ = ["RelayEndpoint"]

log = structlog.get_logger(__name__)

Key = tuple[str, int, str, str]
THREAD_MIN_BYTES = 64 << 10  # a chunk of a file-backed input this big is written and hashed off the loop
READ_AHEAD_BYTES = 2 << 20  # an output's chunks queued at once, more when the writer has sent them


@dataclass(slots=True, eq=False)
class _Upload:
    """A relayed upload: where its next chunk starts, what waits to be stored, and its credit."""

    entry: InputFile
    every: int  # bytes between two credits (credit_every of the window)
    credited: int  # the offset last credited
    expected: int  # where the next chunk must start: what is stored plus what is queued
    queue: collections.deque[bytes] = field(default_factory=collections.deque)
    storing: asyncio.Task[None] | None = None  # the task writing and hashing the queue, while it runs
    closed: bool = False  # the stream ended: what is queued is dropped, the entry paused once the store returns
    stream: int = 0  # the stream's id (data_open.stream), on everything sent for it


@dataclass(slots=True, eq=False)
class _Download:
    output: OutputFile
    file: IO[bytes]
    start: int
    sent: int
    acked: int
    window: int
    stream: int = 0  # the stream's id (data_open.stream)


class RelayEndpoint:
    """Relayed transfers of one worker's plans.

    Args:
        spool: where inputs and outputs are kept.
        worker_id: tickets must name it.
        send: queues a message for the coordinator.
        wall: Unix time (tickets' expiry); tests may pass their own.
    """

    def __init__(self, spool: Spool, *, worker_id: str, send: Any, wall: Any = time.time) -> None:
        self.spool = spool
        self.worker_id = worker_id
        self.keys: dict[str, bytes] = {}
        self._send = send
        self._wall = wall
        self._uploads: dict[Key, _Upload] = {}
        self._downloads: dict[Key, _Download] = {}
        self._storing: set[asyncio.Task[None]] = set()

    def set_keys(self, keys: list[protocol.DataKey]) -> None:
        """The ticket keys from ``welcome``/``data_keys``."""
        self.keys = {key.kid: key.key for key in keys}

    def reset(self) -> None:
        """The session ended: every stream with it (clients open them again on the next one)."""
        for key in list(self._uploads):
            self._close(key)
        for download in self._downloads.values():
            download.file.close()
        self._downloads.clear()

    def resume(self) -> None:
        """The agent's writer sent what was queued: outputs with credit left queue their next chunks."""
        for key, download in list(self._downloads.items()):
            self._pump(key, download)

    async def drained(self) -> None:
        """Return once no chunk waits to be stored (tests; a clean shutdown)."""
        while self._storing:
            await asyncio.gather(*self._storing, return_exceptions=True)

    def on_message(self, msg: DataOpen | DataChunk | DataCredit | DataEnd) -> None:
        """One relay message from the coordinator."""
        key: Key = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        if msg.stream and not isinstance(msg, DataOpen):
            current = self._uploads.get(key) or self._downloads.get(key)
            if current is not None and current.stream != msg.stream:
                return  # of an older open of this stream, under way when it was opened again
        match msg:
            case DataOpen():
                self._close(key)
                try:
                    _, claim = verify(msg.ticket, self.keys, wall=self._wall(), worker=self.worker_id,
                                      plan=msg.plan_id, attempt=msg.attempt, direction=msg.direction, name=msg.name)
                except TicketError as exc:
                    self._end(key, UNAUTHORIZED if exc.status == 401 else REFUSED, exc.reason, stream=msg.stream)
                    return
                if msg.direction == "put":
                    self._open_upload(key, self.spool.declare(msg.plan_id, msg.attempt, msg.name, claim.size,
                                                              claim.digest), msg.credit, msg.stream)
                else:
                    self._open_download(key, msg)
            case DataChunk():
                self._chunk(key, msg)
            case DataCredit():
                download = self._downloads.get(key)
                if download is not None and download.acked <= msg.offset <= download.sent:
                    download.acked = msg.offset
                    self._pump(key, download)
            case DataEnd():
                self._close(key)

    # ------------------------------------------------------------------ inputs

    def _open_upload(self, key: Key, entry: InputFile, credit: int, stream: int = 0) -> None:
        if entry.state == "receiving" and entry.received == entry.size:
            entry.finish()  # an empty input: nothing to wait for
        if entry.state != "receiving":
            self._settled(key, entry, stream)
            return
        if entry.busy:
            self._end(key, CLOSED, f"input {entry.name!r} is being uploaded on another connection (or its last "
                      "relayed chunks are still being stored); open it again", entry.received, stream)
            return
        self._uploads[key] = _Upload(entry, credit_every(credit), entry.received, entry.received, stream=stream)
        self._send(DataCredit(plan_id=key[0], attempt=key[1], name=key[2], direction="put", offset=entry.received,
                              credit=credit, size=entry.size, stream=stream))

    def _chunk(self, key: Key, msg: DataChunk) -> None:
        upload = self._uploads.get(key)
        entry = upload.entry if upload is not None else None
        if upload is None or entry is None or self.spool.input(key[0], key[1], key[2]) is not entry:
            self._close(key)
            self._end(key, CLOSED, "no relayed upload of this input is open here (the attempt ended?)",
                      stream=msg.stream)
            return
        if entry.state != "receiving":
            self._close(key)
            self._settled(key, entry, upload.stream)
            return
        if entry.busy and upload.storing is None:
            del self._uploads[key]  # not paused: the direct upload writes its file
            self._end(key, CLOSED, f"input {entry.name!r} is being uploaded on a direct connection", entry.received,
                      upload.stream)
            return
        n = len(msg.data)
        if msg.offset != upload.expected or upload.expected + n > entry.size:
            self._close(key)
            why = f"input {entry.name!r}: a chunk at {msg.offset}..{msg.offset + n}; it continues at {upload.expected}"
            self._end(key, VIOLATION, f"{why} and is {entry.size} bytes", entry.received, upload.stream)
            return
        entry.via = "relay"
        upload.expected += n
        if (entry.path is not None and n >= THREAD_MIN_BYTES) or upload.storing is not None:
            upload.queue.append(msg.data)  # at most a window: the coordinator holds the sender to it
            if upload.storing is None:
                entry.busy = True  # no direct upload writes it meanwhile
                upload.storing = task = asyncio.get_running_loop().create_task(self._store(key, upload))
                self._storing.add(task)
                task.add_done_callback(self._storing.discard)
            return
        try:
            entry.write(msg.data)
        except SpoolError:
            self._close(key)
            self._settled(key, entry, upload.stream)
            return
        self._stored(key, upload)

    def _stored(self, key: Key, upload: _Upload) -> None:
        """Bytes of an upload were stored: credit them (once per quarter window), or settle it after its last."""
        entry = upload.entry
        if entry.received < entry.size:
            if entry.received - upload.credited >= upload.every:  # one credit per quarter window, not per chunk
                upload.credited = entry.received
                self._send(DataCredit(plan_id=key[0], attempt=key[1], name=key[2], direction="put",
                                      offset=entry.received, stream=upload.stream))
            return
        self._close(key)
        entry.finish()
        self._settled(key, entry, upload.stream)

    async def _store(self, key: Key, upload: _Upload) -> None:
        """Write and hash an upload's queued chunks off the loop, a credit's worth at a time, in order."""
        entry, queue = upload.entry, upload.queue
        try:
            while queue and not upload.closed:
                batch: list[bytes] = []
                count = 0
                goal = max(upload.every - (entry.received - upload.credited), 1)  # the bytes up to the next credit
                while queue and count < goal:
                    batch.append(queue.popleft())
                    count += len(batch[-1])
                try:
                    await _write_and_hash(entry, batch)
                except OSError as exc:
                    try:
                        entry.write_failed(exc)
                    except SpoolError:  # a full disk: the input failed, and says so
                        self._close(key)
                        self._settled(key, entry, upload.stream)
                        return
                    except OSError as other:  # the digest has taken bytes the file has not: no resume
                        self._close(key)
                        entry.fail(INPUTS_UNAVAILABLE, f"input {entry.name!r} could not be written on worker "
                                   f"{self.worker_id}: {other.strerror}")
                        self._settled(key, entry, upload.stream)
                        return
                except ValueError:  # the entry was discarded (its file closed) while a chunk was written
                    self._close(key)
                    self._end(key, CLOSED, "the input was dropped while it was written (the attempt ended?)",
                              stream=upload.stream)
                    return
                entry.advance(count)
                if self.spool.input(key[0], key[1], key[2]) is not entry:  # the attempt ended meanwhile
                    if not upload.closed:
                        self._end(key, CLOSED, "the attempt ended while its input was written", stream=upload.stream)
                    self._close(key)
                    return
                if upload.closed:
                    return
                if entry.state != "receiving":
                    self._close(key)
                    self._settled(key, entry, upload.stream)
                    return
                self._stored(key, upload)
        finally:
            upload.storing = None
            entry.busy = False
            if upload.closed:
                queue.clear()
                entry.pause()
            if self.spool.input(key[0], key[1], key[2]) is not entry:
                entry.discard()  # dropped meanwhile: a write that raced the drop may have made its file anew

    def _settled(self, key: Key, entry: InputFile, stream: int = 0) -> None:
        error = entry.error
        if entry.state == "receiving":  # its digest did not match: its bytes were dropped; the client opens it again
            self._end(key, CLOSED, entry.mismatch, entry.received, stream)
            return
        if entry.state == "verified" or error is None:
            self._end(key, "", "", entry.received, stream)
        else:
            self._end(key, error.code, error.message, entry.received, stream)

    # ------------------------------------------------------------------ outputs

    def _open_download(self, key: Key, msg: DataOpen) -> None:
        output = self.spool.output(msg.plan_id, msg.attempt, msg.name)
        if output is None:
            self._end(key, GONE, f"plan {msg.plan_id!r} attempt {msg.attempt} left no output {msg.name!r} on worker "
                      f"{self.worker_id} (not made, expired, or the worker restarted)", stream=msg.stream)
            return
        if msg.offset > output.size:
            self._end(key, VIOLATION, f"offset {msg.offset} is past the output's {output.size} bytes",
                      stream=msg.stream)
            return
        try:
            file = open(output.path, "rb")  # closed when the stream ends
        except OSError as exc:
            self._end(key, CLOSED, f"output {msg.name!r} cannot be read: {exc.strerror}", stream=msg.stream)
            return
        file.seek(msg.offset)
        download = _Download(output, file, msg.offset, msg.offset, msg.offset, max(msg.credit, MAX_CHUNK_BYTES),
                             msg.stream)
        self._downloads[key] = download
        self._pump(key, download)

    def _pump(self, key: Key, download: _Download) -> None:
        size = download.output.size
        first = download.sent == download.start
        until = download.sent + READ_AHEAD_BYTES
        while download.sent < size or first:
            if download.sent - download.acked + min(MAX_CHUNK_BYTES, size - download.sent) > download.window:
                return
            if download.sent >= until:
                return  # the rest when the writer has sent these (resume)
            data = download.file.read(min(MAX_CHUNK_BYTES, size - download.sent))
            if len(data) != min(MAX_CHUNK_BYTES, size - download.sent):
                self._close(key)
                self._end(key, CLOSED, f"output {key[2]!r} shrank while it was read", stream=download.stream)
                return
            offset = download.sent
            download.sent += len(data)
            last = download.sent >= size
            self._send(DataChunk(plan_id=key[0], attempt=key[1], name=key[2], offset=offset, data=data,
                                 direction="get", last=last, size=size, stream=download.stream))
            first = False
            if last:
                if download.start == 0:
                    self.spool.fetched(download.output)
                self._close(key)
                return

    # ------------------------------------------------------------------ helpers

    def _close(self, key: Key) -> None:
        upload = self._uploads.pop(key, None)
        if upload is not None:
            upload.closed = True
            upload.queue.clear()  # never credited: a resume sends them again
            if upload.storing is None:
                upload.entry.pause()  # else the store task pauses it once its thread returns
        download = self._downloads.pop(key, None)
        if download is not None:
            download.file.close()

    def _end(self, key: Key, code: str, message: str, offset: int = 0, stream: int = 0) -> None:
        direction: Literal["put", "get"] = "put" if key[3] == "put" else "get"
        if code:
            log.info("relayed transfer refused", plan_id=key[0], attempt=key[1], name=key[2], direction=direction,
                     code=code, reason=message)
        self._send(DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=direction, code=code,
                           message=message, offset=offset, stream=stream))


async def _write_and_hash(entry: InputFile, batch: list[bytes]) -> None:
    """Write ``batch`` to the entry's file in one thread while another hashes it (both release the GIL).

    Both threads are done before anything is raised (the file is never closed under a write).
    """
    def write() -> None:
        for data in batch:
            entry.put(data, write_behind=True)  # paced writeback (wireio/writeback.py): no page-cache pile-up

    def digest() -> None:
        for data in batch:
            entry.hash(data)

    results = await asyncio.gather(asyncio.to_thread(write), asyncio.to_thread(digest), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
