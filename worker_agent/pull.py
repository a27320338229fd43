"""Fetching a plan's inputs in the reference form from the worker that holds them (docs/PROTOCOL.md §Plan graphs).

An ``assign`` whose plan takes another plan's output as an input lists where it is (``assign.pulls``,
one :class:`~protocol.messages.Pull` per such input). Its bytes go into the attempt's spool as an
upload's would (worker_agent/spool_files.py ``InputFile``: written, hashed, verified against the
digest the coordinator filled in from the producer's ``done``), so the handler sees an ordinary input.

Rules:

* Held here (``pull.worker_id`` is this worker): the output file is copied from this worker's spool.
  Nothing crosses the network.
* Held elsewhere: one ``GET /v1/data/{plan}/{attempt}/outputs/{name}`` at the holder's data endpoint,
  with the ticket the coordinator signed for it (protocol/tickets.py). A broken connection resumes from
  the bytes stored (``Range``), up to :data:`RESUMES` times; a digest that does not match starts the
  input again (``InputFile.finish``, as for an upload).
* A holder that cannot be dialled (an empty ``url``: it has no data endpoint, e.g. behind NAT; or the
  connect fails), or whose endpoint broke off more than :data:`RESUMES` times: the output comes through
  the coordinator's relay instead, from the bytes stored (worker_agent/pull_relay.py; ``input_received``
  says ``"via": "relay"``).
* An output the holder no longer has (404, 410: its spool retention passed, or it restarted without its
  spool; through the relay ``output_gone``) or a holder that cannot be read from either way: the input
  fails ``output_lost``, with ``detail`` naming the plan, attempt and output. The attempt's
  ``done(failed)`` carries it; the coordinator then has the output made again when its producer allows
  (coordinator/graphs/lineage.py) and places the plan again, or fails it ``output_lost``.
* A holder that refuses the ticket (401 or 403, through the relay ``unauthorized`` or ``forbidden``): the
  input fails ``ticket_refused`` with the holder's reason, at once (the relay would refuse the same ticket). The
  output is not known to be lost: the key that signed the ticket is not one the holder accepts (in cluster mode
  coordinators with different ``--cluster-secret-file``, or a key dropped, or a rotated one it has not learned yet),
  and nothing is made again for it. The coordinator places the plan again with a fresh ticket without charging the
  attempt, a few times (coordinator/worker_sessions/leases.py ``FREE_TICKET_RETRIES``).
* Nothing here reads a ticket or decides placement: the coordinator did both.

One task per attempt with pulls (not per message); it ends with the attempt (the runner cancels it).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Sequence
from typing import Final
from urllib.parse import quote, urlsplit

import msgspec
import structlog

import protocol
from protocol import errors, relay
from protocol.transfer import http1
from protocol.transfer.ranges import range_from
from worker_agent.pull_relay import PullRelay, RelayRefused
from worker_agent.spool import PlanData, Spool
from worker_agent.spool_files import InputFile, SpoolError

__all__ = ["CHUNK_BYTES", "RESUMES", "Puller"]

CHUNK_BYTES: Final = 4 << 20  # bytes stored at once (written and hashed in a thread, off the event loop)
RESUMES: Final = 3  # broken connections a fetch resumes from before the input fails
HEAD_LIMIT: Final = 16 << 10

log = structlog.get_logger(__name__)


class _Gone(Exception):
    """The holder does not have the output (or cannot be asked): the input fails ``output_lost``."""


class _TicketRefused(Exception):
    """The holder refused the pull's ticket: the input fails ``ticket_refused`` (the output is not known lost)."""


class _DialFailed(Exception):
    """The holder's data endpoint could not be connected to: the fetch goes through the relay."""


class Puller:
    """Fills the referenced inputs of attempts from their holders.

    Args:
        spool: this worker's spool (its own outputs, for a pull held here).
        worker_id: this worker's id (a pull naming it is a local copy).
        connect_timeout_s: how long connecting to a holder may take.
        stall_timeout_s: how long a fetch may go without a byte before it counts as broken.
        relay: fetches through the coordinator's relay (worker_agent/pull_relay.py); None: none (the input is lost
            when the holder cannot be dialled).
    """

    def __init__(self, spool: Spool, worker_id: str, *, connect_timeout_s: float = 10.0,
                 stall_timeout_s: float = 30.0, relay: PullRelay | None = None) -> None:
        self._spool = spool
        self._relay = relay
        self._worker_id = worker_id
        self._connect_timeout_s = connect_timeout_s
        self._stall_timeout_s = stall_timeout_s
        self.pulled_bytes = 0
        """Bytes fetched from other workers since the worker started."""
        self.copied_bytes = 0
        """Bytes copied from this worker's own outputs since the worker started."""

    def start(self, pulls: Sequence[protocol.Pull], data: PlanData) -> asyncio.Task[None] | None:
        """Start filling ``data``'s referenced inputs; the task (None: none to fill). The caller cancels it
        when the attempt ends; its inputs then settle as the attempt's end leaves them."""
        todo = [(pull, data.entries[pull.name]) for pull in pulls if pull.name in data.entries]
        if not todo:
            return None
        return asyncio.get_running_loop().create_task(self._pull_all(todo))

    async def _pull_all(self, todo: list[tuple[protocol.Pull, InputFile]]) -> None:
        await asyncio.gather(*(self._pull(pull, entry) for pull, entry in todo))

    async def _pull(self, pull: protocol.Pull, entry: InputFile) -> None:
        entry.busy = True
        entry.via = "local" if pull.worker_id == self._worker_id else "pull"  # the input_received event says so
        try:
            while entry.state == "receiving":
                if pull.worker_id == self._worker_id:
                    await self._copy_local(pull, entry)
                else:
                    await self._fetch(pull, entry)
                if entry.state == "receiving" and entry.received >= entry.size:
                    entry.finish()  # verified, or (a digest mismatch) started again from 0
        except _Gone as exc:
            _lost(entry, pull, str(exc))
        except _TicketRefused as exc:
            _lost(entry, pull, str(exc), errors.TICKET_REFUSED)
        except SpoolError:  # the disk is full: the input failed already, naming it
            pass
        finally:
            entry.busy = False

    async def _copy_local(self, pull: protocol.Pull, entry: InputFile) -> None:
        output = self._spool.output(pull.plan_id, pull.attempt, pull.output)
        if output is None:
            raise _Gone(f"this worker ({self._worker_id}) no longer has it")
        copied = await asyncio.to_thread(_copy_file, output.path, entry)
        self.copied_bytes += copied

    async def _fetch(self, pull: protocol.Pull, entry: InputFile) -> None:
        """Fetch from the holder: direct from its data endpoint, else (none, or it cannot be dialled) relayed."""
        why = await self._fetch_direct(pull, entry) if pull.url else f"worker {pull.worker_id} has no data endpoint"
        if why is None:
            return
        if self._relay is None:
            raise _Gone(f"{why}, and there is no relay to fetch it through")
        log.info("pull relayed", plan_id=pull.plan_id, attempt=pull.attempt, output=pull.output,
                 worker_id=pull.worker_id, why=why)
        entry.via = "relay"  # the input_received event says so
        try:
            await self._relay.fetch(pull, entry, self._store, stall_timeout_s=self._stall_timeout_s)
        except RelayRefused as exc:
            if exc.code in (relay.UNAUTHORIZED, relay.REFUSED):
                raise _TicketRefused(_refusal(pull, f"through the relay {exc}")) from None
            raise _Gone(f"{why}; through the relay: {exc}") from None

    async def _store(self, entry: InputFile, data: bytearray) -> None:
        await _store(entry, data)
        self.pulled_bytes += len(data)

    async def _fetch_direct(self, pull: protocol.Pull, entry: InputFile) -> str | None:
        """Fetch from the holder's data endpoint: None when done, else why it could not (then the relay)."""
        url = urlsplit(pull.url)
        target = f"/v1/data/{quote(pull.plan_id, safe='')}/{pull.attempt}/outputs/{quote(pull.output, safe='')}"
        tls = ssl.create_default_context() if url.scheme == "https" else None
        host, port = url.hostname or "", url.port or (443 if tls else 80)
        broken = 0
        while entry.received < entry.size or entry.size == 0:
            headers = {"Host": url.netloc, "Authorization": f"Bearer {pull.ticket}", "Connection": "close",
                       "Fleetwire-Pull": "1"}  # the holder keeps the output its whole retention (more may take it)
            if entry.received:
                headers["Range"] = range_from(entry.received)
            try:
                await self._get(host, port, tls, http1.format_request("GET", target, headers), entry, pull)
                return None
            except _DialFailed as exc:
                return f"worker {pull.worker_id} at {pull.url} could not be dialled ({exc})"
            except (OSError, TimeoutError, asyncio.IncompleteReadError, http1.HeadError) as exc:
                broken += 1
                if broken > RESUMES:
                    return (f"worker {pull.worker_id} at {pull.url} could not be read from "
                            f"({type(exc).__name__}: {exc}; {broken} tries)")
        return None

    async def _get(self, host: str, port: int, tls: ssl.SSLContext | None, request: bytes, entry: InputFile,
                   pull: protocol.Pull) -> None:
        """One GET: its body's bytes stored in ``entry`` from where it stands."""
        try:
            async with asyncio.timeout(self._connect_timeout_s):  # not asyncio.wait_for: see the reads below
                reader, writer = await asyncio.open_connection(host, port, ssl=tls)
        except (OSError, TimeoutError) as exc:
            raise _DialFailed(f"{type(exc).__name__}: {exc}") from None
        try:
            writer.write(request)
            head = bytearray()
            while (end := http1.head_end(head, HEAD_LIMIT)) < 0:
                async with asyncio.timeout(self._stall_timeout_s):  # not asyncio.wait_for: see below
                    chunk = await reader.read(64 << 10)
                if not chunk:
                    raise asyncio.IncompleteReadError(bytes(head), None)
                head += chunk
            response = http1.parse_response(head[:end])
            if response.status in (404, 410):
                raise _Gone(f"worker {pull.worker_id} answered {response.status}: it no longer has it")
            if response.status in (401, 403):
                reason = await _reason(reader, head[end:], response.content_length)
                raise _TicketRefused(_refusal(pull, f"{response.status}: {reason}"))
            if response.status not in (200, 206):
                raise OSError(f"worker {pull.worker_id} answered {response.status} {response.reason}")
            left = response.content_length
            batch = bytearray(head[end:])
            left -= len(batch)
            while left > 0 or batch:
                if left > 0 and len(batch) < CHUNK_BYTES:
                    # Not asyncio.wait_for: on 3.11 it loses the attempt's cancel that comes as a read returns (the
                    # fetch then went on to the output's last byte after the attempt had ended).
                    async with asyncio.timeout(self._stall_timeout_s):
                        chunk = await reader.read(min(left, CHUNK_BYTES))
                    if not chunk:
                        raise asyncio.IncompleteReadError(bytes(batch), left)
                    batch += chunk
                    left -= len(chunk)
                    continue
                await self._store(entry, batch)
                batch = bytearray()
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _store(entry: InputFile, data: bytearray) -> None:
    """Append ``data`` to the input, written and hashed in a thread."""
    try:
        await asyncio.to_thread(entry.store, data)
    except OSError as exc:
        entry.write_failed(exc)


def _copy_file(path: object, entry: InputFile) -> int:
    """Copy a spooled output into an input from its start (in a thread). Returns the bytes copied."""
    if entry.received:
        entry.restart("a local copy starts from 0")
    copied = 0
    with open(str(path), "rb") as file:
        while chunk := file.read(CHUNK_BYTES):
            entry.store(chunk)
            copied += len(chunk)
    return copied


async def _reason(reader: asyncio.StreamReader, start: bytearray, length: int) -> str:
    """The holder's reason for a refusal: its JSON body's ``error`` (the body read to ``length``, at most 4 KiB)."""
    body = bytes(start)
    want = min(length, 4096)
    with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
        async with asyncio.timeout(5.0):  # not asyncio.wait_for (see _get); a reason is not worth a stall
            while len(body) < want:
                chunk = await reader.read(want - len(body))
                if not chunk:
                    break
                body += chunk
    try:
        reason = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        reason = None
    return reason if isinstance(reason, str) and reason else "no reason given"


def _refusal(pull: protocol.Pull, answer: str) -> str:
    """Why a pull's ticket was refused, for the person who reads the plan's error: the key, not the output."""
    return (f"worker {pull.worker_id} refused the ticket to fetch it ({answer}): it does not accept the key that "
            "signed it (cluster mode: the coordinators' --cluster-secret-file differ, or the key was dropped; "
            "docs/OPERATIONS.md §Data plane); the output is not known to be lost")


def _lost(entry: InputFile, pull: protocol.Pull, why: str, code: str = errors.OUTPUT_LOST) -> None:
    """Fail the input ``code`` (``output_lost``, or ``ticket_refused``), naming the output it is."""
    message = f"input {pull.name!r} is output {pull.output!r} of plan {pull.plan_id} (attempt {pull.attempt}): {why}"
    entry.fail(code, message)
    entry.error = protocol.ErrorInfo(
        code=code, message=message,
        detail={"input": pull.name, "plan_id": pull.plan_id, "attempt": pull.attempt, "output": pull.output,
                "worker_id": pull.worker_id},
    )
