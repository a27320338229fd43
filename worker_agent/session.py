"""The worker's connection details: the coordinator URL, its id, TLS, and the auth failure.

Split out of worker_agent/agent.py so the agent module holds only the session loop.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import ssl
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from protocol import errors
from protocol.urls import websocket_url

__all__ = [
    "EXIT_REMOVED",
    "WORKER_SECRETS",
    "AuthError",
    "WorkerRemoved",
    "client_tls",
    "default_worker_id",
    "dial_error_text",
    "forget_secrets",
    "read_token_file",
    "take_worker_token",
    "version",
    "worker_token",
    "worker_url",
]

#: Variables holding secrets that `fleetwire worker` removes from its environment once read: no
#: function the ``python`` op runs in the worker's process finds them there (plans' processes get a
#: built environment anyway, worker_agent/isolation.py).
WORKER_SECRETS = (
    "FLEETWIRE_WORKER_TOKEN", "FLEETWIRE_TOKEN", "FLEETWIRE_CLIENT_TOKEN", "FLEETWIRE_ADMIN_TOKEN",
    "FLEETWIRE_METRICS_TOKEN", "FLEETWIRE_INFERENCE_API_KEY",
)  # fmt: skip

EXIT_REMOVED = 4
"""Exit status of ``fleetwire worker`` whose id an operator removed (``fleetwire remove``): restarting cannot help."""


def version() -> str:
    """This agent's version for ``hello`` (the installed fleetwire package's; ``"0"`` from a source tree)."""
    try:
        return importlib.metadata.version("fleetwire")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def worker_url(url: str) -> str:
    """``ws://host:port`` → ``ws://host:port/v1/worker``; a URL with a path is kept as is.

    Raises:
        ValueError: (``protocol.urls.BadUrl``) no scheme, another scheme than ws(s)/http(s), no host.
    """
    return websocket_url(url, "/v1/worker")  # http(s):// means ws(s)://; no scheme is refused


def dial_error_text(url: str, exc: BaseException) -> str:
    """Why a dial failed, for the log: the exception, and for a ``wss://`` URL reset at TLS, the likely cause."""
    text = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if url.startswith("wss://") and isinstance(exc, (ConnectionResetError, ssl.SSLError)):
        text += " (the TLS handshake failed: does this coordinator serve TLS? a plain one takes ws://)"
    return text


def worker_token(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The worker token: ``--token``, else ``$FLEETWIRE_WORKER_TOKEN``, else ``$FLEETWIRE_TOKEN``.

    ``FLEETWIRE_WORKER_TOKEN`` first: a shell that holds a client's ``FLEETWIRE_TOKEN`` must not
    make the worker present the client token. ``FLEETWIRE_TOKEN`` still works (older setups).
    """
    return flag or environ.get("FLEETWIRE_WORKER_TOKEN") or environ.get("FLEETWIRE_TOKEN") or None


def read_token_file(path: str) -> str:
    """The token a ``--token-file`` holds (one line; surrounding white space is dropped).

    Raises:
        ValueError: the file cannot be read, is empty, or holds more than one line.
    """
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--token-file {path!r}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not text or "\n" in text:
        raise ValueError(f"--token-file {path!r} must hold the token alone, on one line")
    return text


def take_worker_token(flag: str | None, token_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The worker token: ``--token``, ``--token-file``, then :func:`worker_token`'s variables.
    (`fleetwire worker` then removes :data:`WORKER_SECRETS` from its environment: :func:`forget_secrets`.)

    Raises:
        ValueError: both ``--token`` and ``--token-file``, or a bad token file.
    """
    if flag and token_file:
        raise ValueError("give the worker token once: --token or --token-file, not both")
    return read_token_file(token_file) if token_file else worker_token(flag, environ)


def forget_secrets(environ: MutableMapping[str, str]) -> list[str]:
    """Remove :data:`WORKER_SECRETS` from ``environ``; the names removed."""
    return [name for name in WORKER_SECRETS if environ.pop(name, None) is not None]


def default_worker_id() -> str:
    """Stable for the life of this process: ``<hostname>-<pid>``."""
    return f"{socket.gethostname()}-{os.getpid()}"


class AuthError(errors.FleetwireError):
    """The coordinator refused this worker's token at the handshake (HTTP 401 or 403)."""

    code = "unauthorized"

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class WorkerRemoved(errors.FleetwireError):
    """An operator removed this worker's id (close ``4410``): the coordinator refuses it until it restarts.

    Raised by ``Agent.run()`` whether the removal closed a live session or refused the ``hello``
    of a restarted agent; reconnecting cannot help (docs/PROTOCOL.md §Close codes).
    """

    code = "worker_removed"

    def __init__(self, worker_id: str, url: str, reason: str) -> None:
        super().__init__(
            f"worker {worker_id} was removed by an operator at {url} ({reason or 'close 4410'}); the coordinator "
            "refuses this id until it restarts: start the worker with another --id"
        )
        self.worker_id = worker_id


def client_tls(url: str, ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """The TLS context for a ``wss://`` URL, or None to use websockets' default (system CAs).

    Raises:
        ValueError: a file cannot be loaded, a key without a certificate, or TLS files for
            a ``ws://`` URL (they would be silently ignored).
    """
    if ca_file is None and cert_file is None:
        return None
    if not url.startswith("wss://"):
        raise ValueError(f"--ca-file/--tls-cert need a wss:// coordinator URL, got {url!r}")
    if (cert_file is None) != (key_file is None):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    try:
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file is not None:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load TLS files ({ca_file or '-'}, {cert_file or '-'}): {exc}") from None
    return context
