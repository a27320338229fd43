"""The SDK's direct path: HTTP/1.1 straight to a worker's data endpoint (docs/PROTOCOL.md §Data plane).

Theory of operation:

* :class:`DirectTransport` implements fleetwire/data.py's ``Transport``. An upload is a ``PUT``
  with ``Content-Range`` and ``Expect: 100-continue`` (the first from offset 0, asking nothing
  first: a ``409`` from the head says another offset), then on a ``409`` or a dropped connection
  ``HEAD`` (httpx) for the acknowledged offset and a ``PUT`` from there; what each answer means is
  protocol/transfer/retries.py's ``PutRetries``. Downloads are ``GET`` with ``Range``, resumed the
  same way (:meth:`DirectTransport.download_to`: socket -> a reused buffer -> the file, hashed on
  the way; :meth:`DirectTransport.download`: chunks, through httpx).
* Each transfer runs on a socket and thread of its own (:class:`_SocketCall`): the body goes by
  ``sendfile`` or ``sendall`` of memoryview slices, never through the event loop; heads are
  written and parsed by protocol/transfer/http1.py, bodies never pass a parser. Connections are
  kept alive between transfers to the same endpoint (:class:`_IdleConnections`).
* :func:`fetch_to` writes an output to a file the direct path's own way when the transport is
  this one, else by chunks (fleetwire/data.py ``write_chunks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import pathlib
import select
import shutil
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import IO, TYPE_CHECKING

from fleetwire.data import (
    CHUNK_BYTES,
    DataTransferError,
    Grant,
    OutputCheck,
    Progress,
    Source,
    Transport,
    refetch_on_mismatch,
    write_chunks,
)
from protocol.transfer import http1
from protocol.transfer.http1 import HeadError, HeadTooLarge, Response
from protocol.transfer.ranges import content_range, range_from
from protocol.transfer.retries import TICKET_REFRESHES, PutRetries, Resumes
from wireio.chunkwrite import BufferWriter

if TYPE_CHECKING:  # httpx (and what it pulls in) loads with the first DirectTransport, not with the SDK
    import httpx

__all__ = ["DirectTransport", "fetch_to"]

log = logging.getLogger("fleetwire.data")

CONTINUE_WAIT_S = 1.0  # how long a PUT waits for "100 Continue" before sending its body anyway
IDLE_CONNECTIONS = 4  # keep-alive data connections kept per worker endpoint between transfers
IDLE_S = 15.0  # how long one is kept (the worker drops it after its upload stall timeout, 30 s by default)
MAX_ANSWER_HEAD = 1 << 16  # a worker's answer head is far smaller


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

    async def upload(self, grant: Grant, source: Source) -> None:
        import httpx

        retries = PutRetries(self.max_resumes)
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
                wait = retries.broke()
                if wait is None or _untrusted(exc):
                    raise DataTransferError(f"input {source.name!r}: {type(exc).__name__}: {exc}") from None
                await asyncio.sleep(wait)
                continue
            step = retries.answered(status)  # a part arrived / another offset / not yet: again
            if step.action == "done":
                return
            if step.action == "fail":
                raise DataTransferError(f"input {source.name!r}: {_body_error(body)}", status)
            if status == 409 and _restarted(body):  # its digest did not match: the worker dropped its bytes
                log.warning("fleetwire: input %r of plan %s: %s", source.name, grant.plan_id, _body_error(body))
            ask = step.ask  # after a 503 (refused from the head) the next PUT goes from 0 unasked again
            if step.wait_s:
                await asyncio.sleep(step.wait_s)

    async def _put(self, grant: Grant, source: Source, offset: int) -> tuple[int, bytes]:
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
        headers = {"Host": url.netloc.decode("ascii"), **_auth(grant.ticket), "Content-Length": str(length)}
        if length:
            headers["Content-Range"] = content_range(offset, source.size, source.size)
            headers["Expect"] = "100-continue"
        request = http1.format_request("PUT", url.raw_path.decode("ascii"), headers)
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
        their own (:class:`BufferWriter`): bounded memory, no per-chunk work on the event loop; the
        file is written behind (wireio/writeback.py), so a big download does not fill the page
        cache. A digest that does not match ``check`` raises :class:`OutputMismatch` and leaves no file.
        """
        import httpx

        target = pathlib.Path(path)
        partial = target.with_name(f".{target.name}.partial")
        url = httpx.URL(grant.resource("outputs", name))
        tls = self._tls_context() if url.scheme == "https" else None
        received, size, refreshes = 0, -1, 0
        resumes = Resumes(self.max_resumes)
        file = await asyncio.to_thread(open, partial, "wb")
        try:
            while size < 0 or received < size:
                headers = {"Host": url.netloc.decode("ascii"), **_auth(grant.get_ticket or grant.ticket)}
                if received:
                    headers["Range"] = range_from(received)
                request = http1.format_request("GET", url.raw_path.decode("ascii"), headers)
                progress = [received, size]
                report = None if self.progress is None else functools.partial(self.progress, name)
                call = _SocketCall(url.host, url.port or (443 if tls else 80), tls, url.host, self._connect_timeout_s,
                                   self._stall_timeout_s, self._idle)
                try:
                    status, body = await call.run(functools.partial(_get_body, request=request, file=file,
                                                                    progress=progress, report=report, check=check))
                except OSError as exc:
                    received, size = progress
                    wait = resumes.broke()
                    if wait is None or _untrusted(exc):
                        raise DataTransferError(f"output {name!r}: {type(exc).__name__}: {exc}") from None
                    await asyncio.sleep(wait)
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
        received, size, refreshes = 0, None, 0
        resumes = Resumes(self.max_resumes)
        while size is None or received < size:
            headers = _auth(grant.get_ticket or grant.ticket)
            if received:
                headers["Range"] = range_from(received)
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
                wait = resumes.broke()
                if wait is None or _untrusted(exc):
                    raise DataTransferError(f"output {name!r}: {type(exc).__name__}: {exc}") from None
                await asyncio.sleep(wait)


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
                   data: bytes = b"") -> tuple[Response, bytes, bytes]:
    """The answer's head, and what came after it (its body when ``keep_body``, else the first bytes).

    A ``100 Continue`` (late: the body went without waiting for it) is skipped. ``data``: bytes already read.
    """
    data = _read_head(sock, data)
    end = http1.head_end(data, MAX_ANSWER_HEAD)
    try:
        response = http1.parse_response(data[:end])
    except HeadError as exc:
        raise ConnectionError(str(exc)) from None
    rest = data[end:]
    if response.status == 100:
        return _read_response(sock, keep_body=keep_body, data=rest)
    if not keep_body:
        return response, b"", rest
    length = response.content_length
    body = bytearray(rest)
    while len(body) < length:
        more = sock.recv(length - len(body))
        if not more:
            break
        body += more
    return response, bytes(body[:length]), b""


def _read_head(sock: socket.socket, data: bytes) -> bytes:
    """``data`` and what ``sock`` sends after it, until a whole answer head (up to a blank line) is in it."""
    try:
        while http1.head_end(data, MAX_ANSWER_HEAD) < 0:
            more = sock.recv(65536)
            if not more:
                raise ConnectionResetError("the worker closed the connection before answering")
            data += more
    except HeadTooLarge:
        raise ConnectionError("the worker's answer has an oversized head") from None
    return data


def _put_body(sock: socket.socket, request: bytes, source: Source, offset: int, length: int,
              progress: Progress | None) -> tuple[int, bytes, bool]:
    """Send a ``PUT`` and its body: (status, body, whether the connection may be used again)."""
    sock.sendall(request)
    if length:
        answer = _await_continue(sock)
        if answer is not None:  # refused from the head: no body byte was sent (and the worker closes)
            return *answer, False
    source.send(sock, offset, length, progress)
    response, body, _ = _read_response(sock)
    return response.status, body, response.keep_alive


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
    try:
        interim = http1.parse_response(first[: http1.head_end(first, MAX_ANSWER_HEAD)]).status == 100
    except HeadError as exc:
        raise ConnectionError(str(exc)) from None
    if interim:
        return None  # nothing follows a 100 before the body is sent
    response, body, _ = _read_response(sock, data=first)
    return response.status, body


def _get_body(sock: socket.socket, request: bytes, file: IO[bytes], progress: list[int],
              report: Callable[[int, int], None] | None, check: OutputCheck | None = None) -> tuple[int, bytes, bool]:
    """Send a ``GET``; write the body to ``file`` at ``progress[0]``, keeping ``progress`` = [received, size].

    Returns (status, the body of an error answer, whether the connection may be used again).
    """
    sock.sendall(request)
    response, _, first = _read_response(sock, keep_body=False)
    if response.status not in (200, 206):
        length = response.content_length
        body = bytearray(first)
        while len(body) < length and (more := sock.recv(length - len(body))):
            body += more
        return response.status, bytes(body[:length]), False
    remaining = response.content_length
    if progress[1] < 0:
        progress[1] = progress[0] + remaining
    file.seek(progress[0])
    keep = response.keep_alive and len(first) <= remaining  # nothing read past the body
    if first:
        file.write(first[:remaining])
        if check is not None:
            check.update(first[:remaining])
        progress[0] += min(len(first), remaining)
        remaining -= min(len(first), remaining)
    with BufferWriter(file, check) as writer:
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
    return response.status, b"", keep


def _auth(ticket: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {ticket}"}


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
