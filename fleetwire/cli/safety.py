"""Unsafe defaults, refused or warned at ``fleetwire coordinator`` start (docs/OPERATIONS.md §Security).

* Tokens: the ``change-me-*`` placeholders of examples/deploy/ and inline tokens under 16
  characters are refused (exit 2), naming the role, never the token
  (``coordinator.auth.weak_tokens``); one token for two roles is refused when the token store
  loads (``coordinator.auth.TokenStore``).
* Plaintext beyond loopback: ``ws://`` on an address other hosts can reach sends every token
  and plan in clear; the coordinator starts (a TLS-terminating proxy in front is a valid setup)
  but says so loudly, on stderr and in the log.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import sys
from pathlib import Path

import structlog

__all__ = ["UP_TOKENS_FILE", "plaintext_warning", "unsafe_tokens", "up_state_tokens", "warn_plaintext"]

UP_TOKENS_FILE = "up-tokens.json"
_ROLES = ("worker", "client", "admin")

log = structlog.get_logger(__name__)


def unsafe_tokens(worker: tuple[str, ...], client: tuple[str, ...], admin: tuple[str, ...]) -> list[str]:
    """Why the inline tokens may not be used, one line each (empty: they may)."""
    from coordinator.auth import inline_tokens, weak_tokens

    return weak_tokens(inline_tokens(worker, client, admin))


def up_state_tokens(state_dir: Path) -> dict[str, str]:
    """``fleetwire up --state-dir``: the tokens kept in ``state_dir`` (made and saved, mode 0600, the first time).

    Raises:
        OSError: the directory or file cannot be made or read.
        ValueError: the file is not what this function writes.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / UP_TOKENS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        data = {role: secrets.token_urlsafe(24) for role in _ROLES}
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        return data
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); delete it for new tokens") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(role), str) and data[role] for role in _ROLES):
        raise ValueError(f"{path} must hold a worker, client and admin token; delete it for new tokens")
    return {role: data[role] for role in _ROLES}


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plaintext_warning(host: str, tls: bool) -> str | None:
    """The warning for a coordinator listening on ``host`` without TLS, or None (TLS, or loopback only)."""
    if tls or _loopback(host):
        return None
    return (
        f"WARNING: plaintext ws:// on {host!r}, reachable beyond this host: tokens, plan args and results cross "
        "the network in clear. Serve TLS (--tls-cert/--tls-key, docs/OPERATIONS.md §TLS walkthrough) or put a "
        "TLS-terminating proxy in front and bind to 127.0.0.1."
    )


def warn_plaintext(host: str, tls: bool) -> None:
    """Print and log :func:`plaintext_warning` when there is one."""
    warning = plaintext_warning(host, tls)
    if warning is not None:
        print(f"fleetwire: {warning}", file=sys.stderr, flush=True)
        log.warning("plaintext websocket beyond loopback", host=host)
