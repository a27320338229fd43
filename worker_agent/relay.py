"""The worker's side of the relay: inputs and outputs carried over its coordinator session (docs/PROTOCOL.md §11 Relay).

The coordinator passes on a client's ``data_open``; this module checks its ticket as the HTTP
data endpoint does (protocol/tickets.py: the same keys, the same 401/403 reasons, here as
``data_end`` codes ``unauthorized``/``forbidden``) and then drives the same rules as the HTTP
endpoint, protocol/transfer/upload.py and download.py (offsets, busy inputs, credits, what a
settled input answers, each verdict's ``data_end`` code from protocol/transfer/verdicts.py): this
module only stores and reads the bytes and sends the messages.

* ``put`` (an input): declares it in the spool (worker_agent/spool.py) and answers
  ``data_credit`` with the offset it holds, so a transfer resumes where the last one stopped
  (direct or relayed: both write the same spool entry). Each ``data_chunk`` is written at the
  entry's offset; a ``data_credit`` acknowledges them once per quarter window
  (protocol/relay.py ``credit_every``), not per chunk; the last byte settles the input
  (digest checked) and the stream ends with ``data_end`` ("" when verified, else
  ``input_mismatch`` or ``worker_disk_full`` naming the input). Chunks of a file-backed input
  are written and hashed off the event loop (:class:`_Upload`): one task per upload takes the
  chunks queued since its last store, up to the next credit, and writes them in one thread
  while another hashes them (worker_agent/spool_files.py ``store_off_loop``; both release the
  GIL), so a disk that blocks in writeback or a digest pass never stalls the agent's reader. A
  credit is sent only once its bytes are stored, so what is queued never exceeds the window the
  coordinator enforces.
* ``get`` (an output): sends chunks of the spooled file while the client's credit allows,
  more as each ``data_credit`` comes, the last marked ``last``. It reads at most
  :data:`READ_AHEAD_BYTES` at a time, more each time the agent's writer has sent what was queued
  (:meth:`RelayEndpoint.resume`), so a wide window is not read whole into the send queue (and
  encoded whole into frames) at once: the window's bytes wait in the sockets and the coordinator,
  not in the worker's memory.

* An output this worker no longer holds (never made, expired from the spool, or the worker
  restarted) ends ``output_gone``, which the SDK raises as :class:`~fleetwire.relay.OutputGone`.
* An output sent whole to a client is kept only a short grace more (``Spool.fetched``, as the HTTP
  endpoint does); one another worker fetches as an input (``data_open.pull``: a relayed pull,
  worker_agent/pull_relay.py) stays its whole retention, as with the HTTP ``Fleetwire-Pull`` header.

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
from protocol.relay import credit_every
from protocol.tickets import TicketError, verify
from protocol.transfer import download, upload, verdicts
from protocol.transfer.verdicts import Answer
from worker_agent.spool import Spool
from worker_agent.spool_files import INPUTS_UNAVAILABLE, InputFile, OutputFile, SpoolError

__all__ = ["RelayEndpoint"]

log = structlog.get_logger(__name__)

Key = tuple[str, int, str, str]
THREAD_MIN_BYTES = 64 << 10  # a chunk of a file-backed input this big is written and hashed off the loop
READ_AHEAD_BYTES = 2 << 20  # an output's chunks queued at once, more when the writer has sent them


@dataclass(slots=True, eq=False)
class _Upload:
    """A relayed upload: its rules (where its next chunk starts, when to credit), and what waits to be stored."""

    entry: InputFile
    rules: upload.Receiver
    queue: collections.deque[bytes] = field(default_factory=collections.deque)
    storing: asyncio.Task[None] | None = None  # the task writing and hashing the queue, while it runs
    closed: bool = False  # the stream ended: what is queued is dropped, the entry paused once the store returns
    stream: int = 0  # the stream's id (data_open.stream), on everything sent for it


@dataclass(slots=True, eq=False)
class _Download:
    output: OutputFile
    file: IO[bytes]
    rules: download.Sender
    stream: int = 0  # the stream's id (data_open.stream)
    pull: bool = False  # another worker fetches it as an input (data_open.pull): its whole send keeps its stay


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
        for sending in self._downloads.values():
            sending.file.close()
        self._downloads.clear()

    def resume(self) -> None:
        """The agent's writer sent what was queued: outputs with credit left queue their next chunks."""
        if not self._downloads:  # (no relayed output under way: every frame of a worker without one)
            return
        for key, sending in list(self._downloads.items()):
            self._pump(key, sending)

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
                    refused = verdicts.UNAUTHORIZED if exc.status == 401 else verdicts.FORBIDDEN
                    self._end(key, Answer(refused, exc.reason), msg.stream)
                    return
                if msg.direction == "put":
                    self._open_upload(key, self.spool.declare(msg.plan_id, msg.attempt, msg.name, claim.size,
                                                              claim.digest), msg.credit, msg.stream)
                else:
                    self._open_download(key, msg)
            case DataChunk():
                self._chunk(key, msg)
            case DataCredit():
                sending = self._downloads.get(key)
                if sending is not None and sending.rules.credit(msg.offset):
                    self._pump(key, sending)
            case DataEnd():
                self._close(key)

    # ------------------------------------------------------------------ inputs

    def _open_upload(self, key: Key, entry: InputFile, credit: int, stream: int = 0) -> None:
        if entry.state == "receiving" and upload.complete(entry):
            entry.finish()  # an empty input: nothing to wait for
        refused = upload.check_open(entry)
        if refused is not None:
            self._end(key, refused, stream)
            return
        self._uploads[key] = _Upload(entry, upload.Receiver(credit_every(credit), entry.received), stream=stream)
        self._send(DataCredit(plan_id=key[0], attempt=key[1], name=key[2], direction="put", offset=entry.received,
                              credit=credit, size=entry.size, stream=stream))

    def _chunk(self, key: Key, msg: DataChunk) -> None:
        state = self._uploads.get(key)
        entry = state.entry if state is not None else None
        if state is None or entry is None or self.spool.input(key[0], key[1], key[2]) is not entry:
            self._close(key)
            self._end(key, Answer(verdicts.NOT_OPEN, "no relayed upload of this input is open here (the attempt "
                                  "ended?)"), msg.stream)
            return
        refused = state.rules.chunk(entry, msg.offset, len(msg.data), storing=state.storing is not None)
        if refused is not None:
            if refused.verdict is verdicts.BUSY:
                del self._uploads[key]  # not paused: the direct upload writes its file
            else:
                self._close(key)
            self._end(key, refused, state.stream)
            return
        entry.via = "relay"
        if (entry.path is not None and len(msg.data) >= THREAD_MIN_BYTES) or state.storing is not None:
            state.queue.append(msg.data)  # at most a window: the coordinator holds the sender to it
            if state.storing is None:
                entry.busy = True  # no direct upload writes it meanwhile
                state.storing = task = asyncio.get_running_loop().create_task(self._store(key, state))
                self._storing.add(task)
                task.add_done_callback(self._storing.discard)
            return
        try:
            entry.write(msg.data)
        except SpoolError:
            self._close(key)
            self._end(key, upload.settled(entry), state.stream)
            return
        self._stored(key, state)

    def _stored(self, key: Key, state: _Upload) -> None:
        """Bytes of an upload were stored: credit them (once per quarter window), or settle it after its last."""
        entry = state.entry
        if not upload.complete(entry):
            offset = state.rules.stored(entry)
            if offset is not None:
                self._send(DataCredit(plan_id=key[0], attempt=key[1], name=key[2], direction="put", offset=offset,
                                      stream=state.stream))
            return
        self._close(key)
        entry.finish()
        self._end(key, upload.settled(entry), state.stream)

    async def _store(self, key: Key, state: _Upload) -> None:
        """Write and hash an upload's queued chunks off the loop, a credit's worth at a time, in order."""
        entry, queue = state.entry, state.queue
        try:
            while queue and not state.closed:
                batch: list[bytes] = []
                count = 0
                goal = state.rules.batch(entry)  # the bytes up to the next credit
                while queue and count < goal:
                    batch.append(queue.popleft())
                    count += len(batch[-1])
                try:
                    await entry.store_off_loop(batch)
                except OSError as exc:
                    try:
                        entry.write_failed(exc)
                    except SpoolError:  # a full disk: the input failed, and says so
                        self._close(key)
                        self._end(key, upload.settled(entry), state.stream)
                        return
                    except OSError as other:  # the digest has taken bytes the file has not: no resume
                        self._close(key)
                        entry.fail(INPUTS_UNAVAILABLE, f"input {entry.name!r} could not be written on worker "
                                   f"{self.worker_id}: {other.strerror}")
                        self._end(key, upload.settled(entry), state.stream)
                        return
                except ValueError:  # the entry was discarded (its file closed) while a chunk was written
                    self._close(key)
                    self._end(key, Answer(verdicts.DROPPED, "the input was dropped while it was written (the attempt "
                                          "ended?)"), state.stream)
                    return
                if self.spool.input(key[0], key[1], key[2]) is not entry:  # the attempt ended meanwhile
                    if not state.closed:
                        self._end(key, Answer(verdicts.DROPPED, "the attempt ended while its input was written"),
                                  state.stream)
                    self._close(key)
                    return
                if state.closed:
                    return
                if entry.state != "receiving":
                    self._close(key)
                    self._end(key, upload.settled(entry), state.stream)
                    return
                self._stored(key, state)
        finally:
            state.storing = None
            entry.busy = False
            if state.closed:
                queue.clear()
                entry.pause()
            if self.spool.input(key[0], key[1], key[2]) is not entry:
                entry.discard()  # dropped meanwhile: a write that raced the drop may have made its file anew

    # ------------------------------------------------------------------ outputs

    def _open_download(self, key: Key, msg: DataOpen) -> None:
        output = self.spool.output(msg.plan_id, msg.attempt, msg.name)
        if output is None:
            self._end(key, Answer(verdicts.GONE, f"plan {msg.plan_id!r} attempt {msg.attempt} left no output "
                                  f"{msg.name!r} on worker {self.worker_id} (not made, expired, or the worker "
                                  "restarted)"), msg.stream)
            return
        refused = download.check_offset(msg.offset, output.size)
        if refused is not None:
            self._end(key, refused, msg.stream)
            return
        try:
            file = open(output.path, "rb")  # closed when the stream ends
        except OSError as exc:
            self._end(key, Answer(verdicts.DROPPED, f"output {msg.name!r} cannot be read: {exc.strerror}"), msg.stream)
            return
        file.seek(msg.offset)
        state = _Download(output, file, download.Sender(output.size, msg.offset, msg.credit), msg.stream, msg.pull)
        self._downloads[key] = state
        self._pump(key, state)

    def _pump(self, key: Key, state: _Download) -> None:
        rules = state.rules
        until = rules.sent + READ_AHEAD_BYTES  # the rest when the writer has sent these (resume)
        while (length := rules.next_length(until)) is not None:
            data = state.file.read(length)
            if len(data) != length:
                self._close(key)
                self._end(key, Answer(verdicts.DROPPED, f"output {key[2]!r} shrank while it was read"), state.stream)
                return
            offset = rules.sent
            last = rules.sent_chunk(length)
            self._send(DataChunk(plan_id=key[0], attempt=key[1], name=key[2], offset=offset, data=data,
                                 direction="get", last=last, size=rules.size, stream=state.stream))
            if last:
                if rules.whole and not state.pull:  # a client has it: a short grace more (as the HTTP endpoint)
                    self.spool.fetched(state.output)
                self._close(key)
                return

    # ------------------------------------------------------------------ helpers

    def _close(self, key: Key) -> None:
        receiving = self._uploads.pop(key, None)
        if receiving is not None:
            receiving.closed = True
            receiving.queue.clear()  # never credited: a resume sends them again
            if receiving.storing is None:
                receiving.entry.pause()  # else the store task pauses it once its thread returns
        sending = self._downloads.pop(key, None)
        if sending is not None:
            sending.file.close()

    def _end(self, key: Key, answer: Answer, stream: int = 0) -> None:
        """End the stream with ``answer``'s ``data_end`` code (protocol/transfer/verdicts.py; "" : verified)."""
        direction: Literal["put", "get"] = "put" if key[3] == "put" else "get"
        code = answer.end_code
        if code:
            log.info("relayed transfer refused", plan_id=key[0], attempt=key[1], name=key[2], direction=direction,
                     code=code, reason=answer.message)
        self._send(DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=direction, code=code,
                           message=answer.message, offset=answer.offset, stream=stream))
