"""The worker's data endpoint: plans' inputs in, outputs out, over plain HTTP/1.1 (docs/PROTOCOL.md §Data plane).

Why HTTP and not a websocket: an upload is one ``PUT`` with a ``Content-Length`` and a resume is
one ``HEAD`` (the acknowledged offset) plus a ``PUT`` from there (``Content-Range``); a download is
a ``GET`` with ``Range``. Any HTTP client, proxy or load balancer speaks it; the body is raw bytes
(a websocket client must mask every byte it sends and frames it), and outputs go out with
``sendfile`` (no copy through Python). The server is ``loop.create_server`` with a
``BufferedProtocol`` (worker_agent/http_conn.py: a body goes from the socket straight into large
reused buffers, stored and hashed in threads); heads are parsed and written by
protocol/transfer/http1.py (``httptools``), which never sees a body. A head that is not
well-formed HTTP/1.1 (a space before a colon, two ``Content-Length`` s, a folded line,
``Transfer-Encoding`` with ``Content-Length``) is answered 400.

Requests (``{plan}``, ``{name}`` percent-encoded; ``Authorization: Bearer <ticket>`` on each):

* ``PUT /v1/data/{plan}/{attempt}/inputs/{name}``: bytes from ``Content-Range: bytes S-E/SIZE``
  (or offset 0); S must be the acknowledged offset (else 409 with ``Upload-Offset``). The answer
  carries ``Upload-Offset``: 201 once the whole input arrived and its digest matched, 204 for a
  part; 422 for a size or digest mismatch (the plan fails naming the input), 507 disk full.
* ``HEAD``/``GET /v1/data/{plan}/{attempt}/inputs/{name}``: ``Upload-Offset`` and ``Upload-State``.
* ``GET /v1/data/{plan}/{attempt}/outputs/{name}`` (``Range: bytes=N-`` or ``N-M``: 206) and ``HEAD``.
  What each may do is protocol/transfer/upload.py's and verdicts.py's to say; this module reads and writes.

Every request is checked against its ticket (protocol/tickets.py) from the head alone: 401 or
403 is answered with ``Connection: close`` and the body is never read. So is a request for the
inputs of an attempt that is not live here (worker_agent/attempts.py): ``410 Gone`` with the
reason (cancelled, ended, revoked, superseded, not assigned here), or ``503`` with
``Retry-After`` while too many attempts not yet assigned are held. An upload that sends nothing
for ``stall_timeout_s`` is dropped (what arrived stays acknowledged; memory is freed). A whole
input whose digest does not match is answered ``409`` with ``Upload-Offset: 0`` (its bytes were
dropped: send it again) up to ``spool_files.INPUT_RESTARTS`` times, then ``422``.

Connections are capped like the coordinator's main port (docs/OPERATIONS.md §Data plane): a new
connection must send its first request head within ``first_byte_timeout_s``, a keep-alive one
its next within ``stall_timeout_s``; at most ``max_idle_connections`` wait for a head at once (the
oldest idle one is aborted for a new one; http_conn.IdleBudget), and at most ``max_connections``
are open (past it a new one evicts the oldest idle one, or is dropped when none is idle). Both
budgets are kept within the process's open-file limit, which the agent raises to its hard limit
at start. The kernel holds a new connection until its first byte for about
``defer_accept_s`` (``TCP_DEFER_ACCEPT``): a client sends its request at once, an idle socket
costs nothing until then (1,200 of them, each reopened when evicted, more than doubled a
legitimate upload's p99 on two cores).

Refusals are the coordinator's repeat discipline too (coordinator/io/frontdoor/admission.py ``Repeats``):
past ``REPEAT_BURST`` refused requests from one host in ``REPEAT_INTERVAL_S``, each further
refusal is answered only after ``refusal_hold_s`` (jittered, 0.5 to 1.5 times), its connection's
reading paused meanwhile (the body stays in the kernel's buffers); at most ``max_held`` are held at
once, one more is closed unanswered. A loop of PUTs with cancelled plans' tickets (1,200 tickets,
32 at a time: ~1,500 410s a second, each with a 1 MiB body behind its head) thus makes about 40
requests a second instead (32 a hold, and each window's burst), paced by the hold rather than by
the worker's answers. Without the
jitter the 32 came back together each second, a lump of work on the worker's loop: a legitimate
upload's p99 moved -3 to +37 % in three runs of bench/hostile_neighbors.py
``data-cancelled-flood``, -13 to +6 % in four with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import resource
import ssl
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import unquote

import msgspec
import structlog

import protocol
from protocol.tickets import Direction, TicketError, name_problem, verify
from protocol.transfer import http1, upload, verdicts
from protocol.transfer.http1 import HeadError, HeadTooLarge, Request
from protocol.transfer.ranges import RangeError, content_range, parse_content_range, parse_range
from protocol.transfer.verdicts import Answer
from worker_agent.attempts import Attempts
from worker_agent.http_conn import (
    FD_RESERVE,
    LISTEN_BACKLOG,
    HttpConnection,
    IdleBudget,
    Repeats,
    Scratch,
    defer_accept,
    idle_budget,
)
from worker_agent.spool import Spool
from worker_agent.spool_files import InputFile, SpoolError

__all__ = ["DataServer", "server_tls"]

log = structlog.get_logger(__name__)

MAX_HEAD_BYTES: Final = 16 << 10
READ_CHUNK: Final = 4 << 20  # an output is sent in reads of this size (where sendfile is not there)
BODY_CHUNK: Final = 4 << 20  # an upload is read, written and hashed in chunks of this size
THREAD_MIN_BYTES: Final = 256 << 10  # a chunk this big is written and hashed in a thread
MAX_IDLE_CONNECTIONS: Final = 1024  # connections waiting for a request head (at most a quarter of the fd limit)
FIRST_BYTE_TIMEOUT_S: Final = 10.0  # a new connection's first request head must arrive within this
REPEAT_BURST: Final = 100  # refusals per host and window answered at once (as the coordinator's 401s)
REPEAT_INTERVAL_S: Final = 10.0
REFUSAL_HOLD_S: Final = 1.0  # a refusal past the burst is answered after this (the coordinator's --penalty-hold)
MAX_HELD: Final = 256  # refusals held at once; one more is closed unanswered


def server_tls(cert: str, key: str) -> ssl.SSLContext:
    """A TLS server context for the data endpoint."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


class _Refused(Exception):
    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})

    @classmethod
    def of(cls, answer: Answer) -> _Refused:
        """A verdict of protocol/transfer (its HTTP status), with the acknowledged offset."""
        return cls(answer.status, answer.message, _offset(answer))


def _offset(answer: Answer) -> dict[str, str]:
    return {"Upload-Offset": str(answer.offset)}


class DataServer:
    """Serves one worker's plan inputs and outputs.

    Args:
        spool: where the bytes are kept.
        worker_id: tickets must name it.
        host, port: where to listen (port 0: any free one).
        advertise: the URL clients dial, when it differs from the listening address.
        tls: a server TLS context (``https``), or None.
        stall_timeout_s: an upload (or a keep-alive connection's next head) that sends nothing this long is dropped.
        attempts: which plan attempts are live here (the agent's; default: none yet, so each is held
            before its assign as worker_agent/attempts.py says).
        first_byte_timeout_s: a new connection's first request head must arrive within this.
        max_idle_connections: connections waiting for a request head at once (at most a quarter of the fd limit).
        max_connections: connections open at once (0: half the fd limit).
        defer_accept_s: the kernel holds a new connection until its first byte for about this long
            (``TCP_DEFER_ACCEPT``; None: ``first_byte_timeout_s``; 0: off).
        refusal_hold_s: a refusal past ``repeat_burst`` from one host in ``REPEAT_INTERVAL_S`` is answered
            after this (0: never held).
        repeat_burst: refusals per host and window answered at once.
        max_held: refusals held at once; one more is closed unanswered.
        wall: Unix time (tickets' expiry); tests may pass their own.
    """

    def __init__(
        self,
        spool: Spool,
        *,
        worker_id: str,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise: str = "",
        tls: ssl.SSLContext | None = None,
        stall_timeout_s: float = 30.0,
        attempts: Attempts | None = None,
        first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S,
        max_idle_connections: int = MAX_IDLE_CONNECTIONS,
        max_connections: int = 0,
        defer_accept_s: float | None = None,
        refusal_hold_s: float = REFUSAL_HOLD_S,
        repeat_burst: int = REPEAT_BURST,
        max_held: int = MAX_HELD,
        wall: Any = time.time,
    ) -> None:
        self.spool = spool
        self.worker_id = worker_id
        self.host = host
        self.port = port
        self.advertise = advertise
        self.tls = tls
        self.stall_timeout_s = stall_timeout_s
        self.first_byte_timeout_s = min(first_byte_timeout_s, stall_timeout_s)
        self.attempts = attempts if attempts is not None else Attempts()
        self.idle = IdleBudget(idle_budget(max_idle_connections))
        self.max_connections = max_connections or max(16, (_fd_limit() - FD_RESERVE) // 2)
        self.dropped = 0  # connections dropped at accept: max_connections open and none idle
        self.defer_accept_s = self.first_byte_timeout_s if defer_accept_s is None else defer_accept_s
        self.deferred_s = 0  # TCP_DEFER_ACCEPT seconds the kernel applies (0: off or unavailable)
        self.refusal_hold_s = refusal_hold_s
        self.max_held = max_held
        self.repeats = Repeats(burst=repeat_burst, interval_s=REPEAT_INTERVAL_S)
        self.holding = 0  # refusals being held now
        self.held = 0  # refusals answered after the hold (tests, metrics)
        self.held_dropped = 0  # refusals closed unanswered: max_held were held already
        self._scratch = Scratch()  # where every connection's head-mode reads land (http_conn.py)
        self._jitter = random.Random()
        self.keys: dict[str, bytes] = {}
        self.open_uploads = 0  # uploads in progress (tests and metrics)
        self._no_uploads = asyncio.Event()  # set while open_uploads == 0 (see wait_no_uploads)
        self._no_uploads.set()
        self.bytes_in = 0  # input bytes received, all uploads (the worker's load report)
        self.bytes_out = 0  # output bytes sent
        self.refused: Counter[int] = Counter()  # requests refused, by HTTP status
        self.requests: Counter[str] = Counter()  # requests read, by method (tests: round trips per transfer)
        self.connections = 0  # connections accepted (tests: keep-alive reuse)
        self._wall = wall
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()

    async def wait_no_uploads(self, timeout_s: float) -> None:
        """Return once no upload is in progress (a dropped connection's bytes are stored by then).

        Raises:
            TimeoutError: uploads were still open after ``timeout_s``.
        """
        async with asyncio.timeout(timeout_s):
            await self._no_uploads.wait()

    @property
    def url(self) -> str:
        """What clients dial: ``advertise``, else ``http(s)://host:port``."""
        if self.advertise:
            return self.advertise.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    def count_into(self, load: protocol.Load) -> protocol.Load:
        """``load`` with this endpoint's counts (bytes in and out, refusals by status) filled in."""
        if not (self.bytes_in or self.bytes_out or self.refused):
            return load
        refused = {str(status): n for status, n in self.refused.items()}
        return msgspec.structs.replace(load, data_bytes_in=self.bytes_in, data_bytes_out=self.bytes_out,
                                       data_refused=refused)

    def set_keys(self, keys: list[protocol.DataKey]) -> None:
        """The ticket keys from ``welcome``/``data_keys`` (they replace the previous ones)."""
        self.keys = {key.kid: key.key for key in keys}

    async def start(self) -> None:
        # A TLS handshake comes before the connection is made (and counted): it gets the first-byte deadline.
        handshake: dict[str, Any] = {"ssl_handshake_timeout": self.first_byte_timeout_s} if self.tls else {}
        scratch = self._scratch
        self._server = await asyncio.get_running_loop().create_server(
            lambda: HttpConnection(self._open, MAX_HEAD_BYTES, scratch), self.host, self.port, ssl=self.tls,
            backlog=LISTEN_BACKLOG, **handshake,
        )
        sockets = self._server.sockets
        self.deferred_s = defer_accept(sockets, self.defer_accept_s)  # idle sockets wait in the kernel, not here
        if sockets and not self.port:
            self.port = sockets[0].getsockname()[1]
        log.info("data endpoint listening", url=self.url, worker_id=self.worker_id)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self.idle.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    # ------------------------------------------------------------------ connections

    def _open(self, conn: HttpConnection) -> None:
        self.connections += 1
        if len(self._connections) >= self.max_connections and not self.idle.evict_oldest():
            self.dropped += 1  # every open connection is busy with a request: this one waits for none
            conn.abort()
            return
        self.idle.waiting(conn)
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._connections.add(task)
        task.add_done_callback(self._connections.discard)

    async def _serve(self, conn: HttpConnection) -> None:
        timeout_s = self.first_byte_timeout_s
        try:
            while True:
                self.idle.waiting(conn)
                try:
                    try:
                        request = await self._read_head(conn, timeout_s)
                    finally:
                        self.idle.serving(conn)
                    timeout_s = self.stall_timeout_s
                    if request is None:
                        return
                    keep = await self._dispatch(request, conn)
                except _Refused as refused:
                    self.refused[refused.status] += 1
                    if await self._hold(conn):
                        await self._respond(conn, refused.status, {"error": refused.message}, refused.headers,
                                            close=True)
                    return
                if not keep:
                    return
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            return
        finally:
            conn.close()
            with contextlib.suppress(Exception):
                await conn.wait_closed()

    async def _hold(self, conn: HttpConnection) -> bool:
        """Wait ``refusal_hold_s`` before a refusal is answered when its host is past its burst (see the module
        docstring); False: closed unanswered instead (``max_held`` are held already)."""
        if self.refusal_hold_s <= 0 or not self.repeats.over(conn.peer_host):
            return True
        if self.holding >= self.max_held:
            self.held_dropped += 1
            conn.abort()
            return False
        conn.pause_reading()  # the body behind the head stays in the kernel's buffers, unread
        self.holding += 1
        try:
            # Jittered: a loop's requests refused together are answered apart, its next ones come apart too,
            # and the worker's loop does their work a little at a time instead of in a lump each hold.
            await asyncio.sleep(self.refusal_hold_s * self._jitter.uniform(0.5, 1.5))
        finally:
            self.holding -= 1
        self.held += 1
        return True

    async def _read_head(self, conn: HttpConnection, timeout_s: float) -> Request | None:
        try:
            async with asyncio.timeout(timeout_s):
                head = await conn.read_head()
        except (asyncio.IncompleteReadError, TimeoutError):
            return None
        except HeadTooLarge:
            raise _Refused(431, f"request head over {MAX_HEAD_BYTES} bytes") from None
        if head is None:
            return None
        try:
            request = http1.parse_request(head)
        except HeadError as exc:
            raise _Refused(400, str(exc)) from None
        self.requests[request.method] += 1
        return request

    async def _dispatch(self, req: Request, conn: HttpConnection) -> bool:
        segments = req.path.split("/")
        # "", "v1", "data", plan, attempt, kind, name
        if len(segments) != 7 or segments[1:3] != ["v1", "data"] or segments[5] not in ("inputs", "outputs"):
            raise _Refused(404, "no such resource; see docs/PROTOCOL.md §Data plane")
        plan_id, name = unquote(segments[3]), unquote(segments[6])
        try:
            attempt = int(segments[4])
        except ValueError:
            raise _Refused(404, f"attempt {segments[4]!r} is not a number") from None
        problem = name_problem(name, "name")
        if problem is not None:
            raise _Refused(400, problem)
        kind = segments[5]
        allowed = ("PUT", "HEAD", "GET") if kind == "inputs" else ("HEAD", "GET")
        if req.method not in allowed:
            raise _Refused(405, f"{req.method} is not allowed on {kind}", {"Allow": ", ".join(allowed)})
        direction: Direction = "put" if kind == "inputs" else "get"
        claim = self._check_ticket(req, plan_id, attempt, direction, name)
        if kind == "outputs":
            return await self._get_output(req, conn, plan_id, attempt, name)
        refusal = self.attempts.check(plan_id, attempt)
        if refusal is not None:
            retry = {"Retry-After": f"{refusal.retry_after_s:.0f}"} if refusal.retry_after_s else {}
            raise _Refused(refusal.status, refusal.reason, retry)
        entry = self.spool.declare(plan_id, attempt, name, claim.size, claim.digest)
        if req.method != "PUT":
            headers = {"Upload-Offset": str(entry.received), "Upload-State": entry.state}
            body: dict[str, Any] = {"offset": entry.received, "size": entry.size, "state": entry.state}
            if entry.error is not None:
                body["error"] = entry.error.message
            await self._respond(conn, 200, body, headers, head_only=req.method == "HEAD")
            return req.keep_alive
        return await self._put_input(req, conn, entry)

    def _check_ticket(self, req: Request, plan_id: str, attempt: int, direction: Direction, name: str) -> Any:
        auth = req.headers.get("authorization", "")
        scheme, _, ticket = auth.partition(" ")
        if scheme.lower() != "bearer" or not ticket:
            raise _Refused(401, "a data-plane ticket is required: Authorization: Bearer <ticket>",
                           {"WWW-Authenticate": "Bearer"})
        try:
            _, claim = verify(
                ticket.strip(), self.keys, wall=self._wall(), worker=self.worker_id, plan=plan_id, attempt=attempt,
                direction=direction, name=name,
            )
        except TicketError as exc:
            challenge = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
            raise _Refused(exc.status, exc.reason, challenge) from None
        return claim

    # ------------------------------------------------------------------ inputs

    async def _put_input(self, req: Request, conn: HttpConnection, entry: InputFile) -> bool:
        length_text = req.headers.get("content-length")
        if length_text is None or not length_text.isdigit():
            raise _Refused(411, "PUT needs a Content-Length")
        length = int(length_text)
        offset, total = 0, entry.size
        content_range = req.headers.get("content-range")
        if content_range:
            try:
                offset, total = parse_content_range(content_range, length)
            except RangeError as exc:
                raise _Refused(exc.status, exc.message, exc.headers) from None
        answer = upload.check_put(entry, offset, length, total)  # from the head: no body byte read yet
        if answer is not None:
            if answer.verdict is not verdicts.VERIFIED:
                raise _Refused.of(answer)
            await self._respond(conn, 201, {"offset": entry.received, "state": entry.state}, _offset(answer))
            return True
        if req.headers.get("expect", "").lower() == "100-continue":
            conn.write(http1.CONTINUE)
        entry.busy = True
        self.open_uploads += 1
        self._no_uploads.clear()
        try:
            await self._receive(conn, entry, length)
        except SpoolError as exc:
            raise _Refused(507, exc.message, {"Upload-Offset": str(entry.received)}) from None
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            log.info("upload dropped", name=entry.name, offset=entry.received, size=entry.size)
            entry.pause()
            raise
        finally:
            entry.busy = False
            self.open_uploads -= 1
            if not self.open_uploads:
                self._no_uploads.set()
        if not upload.complete(entry):
            entry.pause()
            await self._respond(conn, 204, None, {"Upload-Offset": str(entry.received)})
            return True
        entry.finish()
        answer = upload.settled(entry)
        if answer.verdict is verdicts.RESTART:  # a digest mismatch, taken for damage in transit: from 0 again
            log.warning("input digest mismatch: its bytes were dropped; waiting for them again", name=entry.name,
                        size=entry.size, restart=entry.restarts)
            await self._respond(conn, 409, {"error": entry.mismatch, "offset": 0, "state": entry.state,
                                            "restart": entry.restarts},
                                {"Upload-Offset": "0", "Upload-State": "receiving"})
            return True
        if answer.verdict is not verdicts.VERIFIED:
            raise _Refused.of(answer)
        await self._respond(conn, 201, {"offset": entry.received, "state": entry.state}, _offset(answer))
        return True

    async def _receive(self, conn: HttpConnection, entry: InputFile, length: int) -> None:
        """Read ``length`` body bytes into ``entry``.

        The socket fills large reused buffers (worker_agent/http_conn.py: no copy on the event
        loop); each chunk of :data:`BODY_CHUNK` is stored (written and hashed at once, in two
        threads: both release the GIL) while the next one fills. At most three buffers per
        upload. An upload that sends nothing for the stall timeout, or drops, has what arrived
        stored first, so it stays acknowledged for a resume.
        """
        storing: asyncio.Future[None] | None = None
        held: memoryview | None = None  # the chunk being stored
        try:
            async with contextlib.aclosing(conn.body(length, BODY_CHUNK, self.stall_timeout_s)) as chunks:
                async for chunk in chunks:
                    self.bytes_in += len(chunk)
                    if storing is not None:
                        await storing  # one chunk in flight: stores stay in order
                        storing = None
                    if held is not None:
                        conn.release(held)
                        held = None
                    if entry.path is None or len(chunk) < THREAD_MIN_BYTES:
                        entry.store(chunk)
                        conn.release(chunk)
                    else:
                        held = chunk
                        storing = asyncio.ensure_future(entry.store_off_loop([chunk], direct_io=True))
            if storing is not None:
                await storing
                storing = None
        except (ConnectionError, TimeoutError):
            with contextlib.suppress(OSError, ValueError, SpoolError):  # keep what arrived before the drop
                if storing is not None:
                    await asyncio.shield(storing)
                    storing = None
            raise
        except ValueError:  # the attempt ended meanwhile and its file was closed
            raise ConnectionError(f"input {entry.name!r} was dropped while it arrived") from None
        except OSError as exc:
            entry.write_failed(exc)
        finally:
            if storing is not None:  # cancelled or failed mid-chunk: the thread finishes before the file closes
                with contextlib.suppress(BaseException):
                    await asyncio.shield(storing)

    # ------------------------------------------------------------------ outputs

    async def _get_output(self, req: Request, conn: HttpConnection, plan_id: str, attempt: int,
                          name: str) -> bool:
        output = self.spool.output(plan_id, attempt, name)
        if output is None:
            why = self.attempts.reason(plan_id, attempt)
            ended = f" (the attempt {why})" if why else ""
            raise _Refused(404, f"plan {plan_id!r} attempt {attempt} left no output {name!r} on this worker{ended} "
                                "(not made, expired, or the worker restarted)")
        start, end = 0, output.size  # [start, end)
        status = 200
        headers = {"Content-Length": "", "Accept-Ranges": "bytes", "Fleetwire-Digest": output.digest}
        range_header = req.headers.get("range")
        if range_header:
            try:
                start, end = parse_range(range_header, output.size)
            except RangeError as exc:
                raise _Refused(exc.status, exc.message, exc.headers) from None
            status = 206
            headers["Content-Range"] = content_range(start, end, output.size)
        headers["Content-Length"] = str(end - start)
        await self._respond(conn, status, None, headers, raw_length=True)
        if req.method == "HEAD":
            return True
        try:
            file = open(output.path, "rb")  # noqa: ASYNC230  (opening is quick; the bytes go by sendfile)
        except OSError:
            raise ConnectionError("output vanished") from None
        with file:
            assert conn.transport is not None
            try:  # zero-copy where the loop has it (asyncio; falls back to reads itself for TLS)
                await asyncio.get_running_loop().sendfile(conn.transport, file, start, end - start)
            except NotImplementedError:  # uvloop has no sendfile: big reads in a thread, the next while one is sent
                await self._send_chunks(conn, file.fileno(), start, end)
            await conn.drain()
        self.bytes_out += end - start
        # A whole download ends the output's stay (a client has it), but not another worker's fetch of it as an
        # input (``Fleetwire-Pull``, worker_agent/pull.py): more plans may take it, and a lost one is made again.
        if start == 0 and end == output.size and "fleetwire-pull" not in req.headers:
            self.spool.fetched(output)
        return True

    async def _send_chunks(self, conn: HttpConnection, fd: int, start: int, end: int) -> None:
        """Send bytes [start, end) of a file: each read of :data:`READ_CHUNK` in a thread while the previous is sent."""
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_SEQUENTIAL)
        position = start
        reading = asyncio.ensure_future(asyncio.to_thread(os.pread, fd, min(READ_CHUNK, end - position), position))
        try:
            while True:
                chunk = await reading
                if not chunk:
                    raise ConnectionError("output shrank while sending")
                position += len(chunk)
                if position < end:
                    reading = asyncio.ensure_future(
                        asyncio.to_thread(os.pread, fd, min(READ_CHUNK, end - position), position)
                    )
                conn.write(chunk)
                await conn.drain()
                if position >= end:
                    return
        finally:
            if not reading.done():  # the peer went: let the read finish before the file closes
                with contextlib.suppress(BaseException):
                    await asyncio.shield(reading)

    # ------------------------------------------------------------------ answers

    async def _respond(
        self,
        conn: HttpConnection,
        status: int,
        body: Any,
        headers: Mapping[str, str] | None = None,
        *,
        close: bool = False,
        head_only: bool = False,
        raw_length: bool = False,
    ) -> None:
        payload = b"" if body is None else msgspec.json.encode(body)
        extra = dict(headers or {})
        if not raw_length:
            extra["Content-Length"] = str(len(payload))
            if payload:
                extra["Content-Type"] = "application/json"
        if close:
            extra["Connection"] = "close"
        head = http1.format_response(status, extra)
        conn.write(head + payload if payload and not head_only else head)  # one send for a whole answer
        await conn.drain()


def _fd_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return (1 << 20) if soft == resource.RLIM_INFINITY else soft


def stale_input_seconds(input_timeout_s: float) -> float:
    """How long an input nobody claims is kept (an upload for an attempt this worker never ran)."""
    return max(60.0, input_timeout_s)

