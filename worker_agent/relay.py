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
  ``input_mismatch`` or ``worker_disk_full`` naming the input).
* ``get`` (an output): sends chunks of the spooled file while the client's credit allows,
  more as each ``data_credit`` comes, the last marked ``last``.

Everything runs in the agent's reader, synchronously (no awaits between a message and its
effect): writes and reads are of one chunk (at most 256 KiB) each. Messages go out through the
agent's send queue, unnumbered (a relayed stream that breaks is opened again, not replayed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO, Any, Literal

import structlog

import protocol
from protocol.messages import DataChunk, DataCredit, DataEnd, DataOpen
from protocol.relay import CLOSED, MAX_CHUNK_BYTES, REFUSED, UNAUTHORIZED, VIOLATION, credit_every
from protocol.tickets import TicketError, verify
from worker_agent.spool import InputFile, OutputFile, Spool, SpoolError

__all__ = ["RelayEndpoint"]

log = structlog.get_logger(__name__)

Key = tuple[str, int, str, str]


@dataclass(slots=True, eq=False)
class _Download:
    output: OutputFile
    file: IO[bytes]
    start: int
    sent: int
    acked: int
    window: int


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
        self._uploads: dict[Key, InputFile] = {}
        self._credited: dict[Key, tuple[int, int]] = {}  # upload -> (offset last credited, bytes between credits)
        self._downloads: dict[Key, _Download] = {}

    def set_keys(self, keys: list[protocol.DataKey]) -> None:
        """The ticket keys from ``welcome``/``data_keys``."""
        self.keys = {key.kid: key.key for key in keys}

    def reset(self) -> None:
        """The session ended: every stream with it (clients open them again on the next one)."""
        for entry in self._uploads.values():
            entry.pause()
        for download in self._downloads.values():
            download.file.close()
        self._uploads.clear()
        self._credited.clear()
        self._downloads.clear()

    def on_message(self, msg: DataOpen | DataChunk | DataCredit | DataEnd) -> None:
        """One relay message from the coordinator."""
        key: Key = (msg.plan_id, msg.attempt, msg.name, msg.direction)
        match msg:
            case DataOpen():
                self._close(key)
                try:
                    _, claim = verify(msg.ticket, self.keys, wall=self._wall(), worker=self.worker_id,
                                      plan=msg.plan_id, attempt=msg.attempt, direction=msg.direction, name=msg.name)
                except TicketError as exc:
                    self._end(key, UNAUTHORIZED if exc.status == 401 else REFUSED, exc.reason)
                    return
                if msg.direction == "put":
                    self._open_upload(key, self.spool.declare(msg.plan_id, msg.attempt, msg.name, claim.size,
                                                              claim.digest), msg.credit)
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

    def _open_upload(self, key: Key, entry: InputFile, credit: int) -> None:
        if entry.state == "receiving" and entry.received == entry.size:
            entry.finish()  # an empty input: nothing to wait for
        if entry.state != "receiving":
            self._settled(key, entry)
            return
        if entry.busy:
            self._end(key, CLOSED, f"input {entry.name!r} is being uploaded on a direct connection", entry.received)
            return
        self._uploads[key] = entry
        self._credited[key] = (entry.received, credit_every(credit))
        self._send(DataCredit(plan_id=key[0], attempt=key[1], name=key[2], direction="put", offset=entry.received,
                              credit=credit, size=entry.size))

    def _chunk(self, key: Key, msg: DataChunk) -> None:
        entry = self._uploads.get(key)
        if entry is None or self.spool.input(key[0], key[1], key[2]) is not entry:
            self._forget(key)
            self._end(key, CLOSED, "no relayed upload of this input is open here (the attempt ended?)")
            return
        if entry.state != "receiving":
            self._forget(key)
            self._settled(key, entry)
            return
        if entry.busy:
            self._forget(key)
            self._end(key, CLOSED, f"input {entry.name!r} is being uploaded on a direct connection", entry.received)
            return
        n = len(msg.data)
        if msg.offset != entry.received or entry.received + n > entry.size:
            self._forget(key)
            entry.pause()
            why = f"input {entry.name!r}: a chunk at {msg.offset}..{msg.offset + n}; it continues at {entry.received}"
            self._end(key, VIOLATION, f"{why} and is {entry.size} bytes", entry.received)
            return
        entry.via = "relay"
        try:
            entry.write(msg.data)
        except SpoolError:
            self._forget(key)
            self._settled(key, entry)
            return
        if entry.received < entry.size:
            credited, every = self._credited.get(key, (0, 0))
            if entry.received - credited >= every:  # one credit per quarter window, not per chunk
                self._credited[key] = (entry.received, every)
                self._send(DataCredit(plan_id=key[0], attempt=key[1], name=key[2], direction="put",
                                      offset=entry.received))
            return
        self._forget(key)
        entry.finish()
        self._settled(key, entry)

    def _settled(self, key: Key, entry: InputFile) -> None:
        error = entry.error
        if entry.state == "verified" or error is None:
            self._end(key, "", "", entry.received)
        else:
            self._end(key, error.code, error.message, entry.received)

    # ------------------------------------------------------------------ outputs

    def _open_download(self, key: Key, msg: DataOpen) -> None:
        output = self.spool.output(msg.plan_id, msg.attempt, msg.name)
        if output is None:
            self._end(key, protocol.errors.PLAN_NOT_FOUND,
                      f"plan {msg.plan_id!r} attempt {msg.attempt} left no output {msg.name!r} on worker "
                      f"{self.worker_id} (not made, expired, or the worker restarted)")
            return
        if msg.offset > output.size:
            self._end(key, VIOLATION, f"offset {msg.offset} is past the output's {output.size} bytes")
            return
        try:
            file = open(output.path, "rb")  # closed when the stream ends
        except OSError as exc:
            self._end(key, CLOSED, f"output {msg.name!r} cannot be read: {exc.strerror}")
            return
        file.seek(msg.offset)
        download = _Download(output, file, msg.offset, msg.offset, msg.offset, max(msg.credit, MAX_CHUNK_BYTES))
        self._downloads[key] = download
        self._pump(key, download)

    def _pump(self, key: Key, download: _Download) -> None:
        size = download.output.size
        first = download.sent == download.start
        while download.sent < size or first:
            if download.sent - download.acked + min(MAX_CHUNK_BYTES, size - download.sent) > download.window:
                return
            data = download.file.read(min(MAX_CHUNK_BYTES, size - download.sent))
            if len(data) != min(MAX_CHUNK_BYTES, size - download.sent):
                self._close(key)
                self._end(key, CLOSED, f"output {key[2]!r} shrank while it was read")
                return
            offset = download.sent
            download.sent += len(data)
            last = download.sent >= size
            self._send(DataChunk(plan_id=key[0], attempt=key[1], name=key[2], offset=offset, data=data,
                                 direction="get", last=last, size=size))
            first = False
            if last:
                if download.start == 0:
                    self.spool.fetched(download.output)
                self._close(key)
                return

    # ------------------------------------------------------------------ helpers

    def _forget(self, key: Key) -> InputFile | None:
        self._credited.pop(key, None)
        return self._uploads.pop(key, None)

    def _close(self, key: Key) -> None:
        entry = self._forget(key)
        if entry is not None:
            entry.pause()
        download = self._downloads.pop(key, None)
        if download is not None:
            download.file.close()

    def _end(self, key: Key, code: str, message: str, offset: int = 0) -> None:
        direction: Literal["put", "get"] = "put" if key[3] == "put" else "get"
        if code:
            log.info("relayed transfer refused", plan_id=key[0], attempt=key[1], name=key[2], direction=direction,
                     code=code, reason=message)
        self._send(DataEnd(plan_id=key[0], attempt=key[1], name=key[2], direction=direction, code=code,
                           message=message, offset=offset))

