"""Who may connect: bearer tokens with names and roles, the token file, and TLS contexts.

Rules (docs/OPERATIONS.md §Security; RELIABILITY.md §3):

* A token belongs to a **principal**: a name, a role (``worker``, ``client`` or ``admin``)
  and, for workers, an optional glob of the worker ids it may register as. The name is
  what the coordinator logs and what owns a client's plans; the token itself is never
  logged or stored, only its SHA-256.
* Roles open paths: ``worker`` opens ``/v1/worker``; ``client`` and ``admin`` open
  ``/v1/client``, where ``admin`` sees and cancels every principal's plans.
* Tokens come from a token file (``--token-file``, TOML, below) and from the
  ``FLEETWIRE_WORKER_TOKEN`` / ``FLEETWIRE_CLIENT_TOKEN`` / ``FLEETWIRE_ADMIN_TOKEN``
  shortcut, whose principals are named ``worker``, ``client`` and ``admin``.
* A presented token is hashed once and compared with every known hash with
  ``hmac.compare_digest``, without stopping at a match, so timing tells nothing about
  which tokens exist. Tokens made by ``fleetwire token new`` carry 256 random bits, so a
  fast hash is enough; a slow password hash would only turn every handshake into CPU an
  attacker can spend.
* :meth:`TokenStore.reload` (SIGHUP) swaps in the file's new contents; the principals it
  returns were revoked (removed, or changed) and their sessions are closed with 4401. A
  file that fails to load leaves the old tokens in force.

Token file::

    # one [[token]] table per token; make entries with `fleetwire token new`
    [[token]]
    name = "alice"                 # logged, and owns alice's plans
    role = "client"                # worker | client | admin
    hash = "sha256:5e88...a1f2"    # `fleetwire token hash` prints it for a token

    [[token]]
    name = "gpu-fleet"
    role = "worker"
    worker_ids = "gpu-*"           # optional: the worker ids this token may register
    hash = "sha256:9c1b...77d0"
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import math
import re
import secrets
import ssl
import time
import tomllib
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import structlog
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from coordinator.limits import PENALIZED_CLOSES, Limits, PenaltyBox, origin_refused

__all__ = [
    "BEARER_SUBPROTOCOL_PREFIX",
    "ENV_TOKENS",
    "Gatekeeper",
    "Principal",
    "TokenFileError",
    "TokenStore",
    "bearer_token",
    "hash_token",
    "inline_tokens",
    "new_token",
    "parse_token_file",
    "server_tls_context",
]

log = structlog.get_logger(__name__)

Role = Literal["worker", "client", "admin"]
ROLES: Final = ("worker", "client", "admin")
HASH_PREFIX: Final = "sha256:"
_HASH_RE: Final = re.compile(r"sha256:[0-9a-f]{64}")
_ENTRY_KEYS: Final = frozenset({"name", "role", "hash", "worker_ids"})

# The environment shortcut: variable -> (principal name, role).
ENV_TOKENS: Final[dict[str, tuple[str, Role]]] = {
    "FLEETWIRE_WORKER_TOKEN": ("worker", "worker"),
    "FLEETWIRE_CLIENT_TOKEN": ("client", "client"),
    "FLEETWIRE_ADMIN_TOKEN": ("admin", "admin"),
}


class TokenFileError(ValueError):
    """The token file cannot be used; the message names the file, the entry and the problem."""


@dataclass(frozen=True)
class Principal:
    """Who a token speaks for.

    Attributes:
        name: logged, and the owner of a client's plans.
        role: ``worker``, ``client`` or ``admin``.
        worker_ids: for a worker, the glob of ids it may register as; None: any.
        digest: SHA-256 of the token (kept out of ``repr`` so it never reaches a log).
    """

    name: str
    role: Role
    worker_ids: str | None = None
    digest: bytes = field(default=b"", repr=False)

    @property
    def admin(self) -> bool:
        """Whether it sees and acts on every principal's plans."""
        return self.role == "admin"

    @property
    def path_role(self) -> Literal["worker", "client"]:
        """The session role its connections get: ``worker``, or ``client`` for clients and admins."""
        return "worker" if self.role == "worker" else "client"


def hash_token(token: str) -> str:
    """The value for a token file's ``hash`` field: ``sha256:<64 hex digits>``."""
    return HASH_PREFIX + hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    """A fresh token with 256 random bits, URL-safe (it fits a header and a subprotocol name)."""
    return secrets.token_urlsafe(32)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_token_file(text: str, source: str) -> list[Principal]:
    """The principals of a token file's ``text``.

    Raises:
        TokenFileError: not TOML, or an entry with a missing, unknown or invalid field, or
            a name or hash used twice; the message says which entry and what to change.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokenFileError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"token"})
    if unknown:
        raise TokenFileError(f"{source}: unknown top-level key(s) {unknown}; write one [[token]] table per token")
    entries = data.get("token", [])
    if not isinstance(entries, list):
        raise TokenFileError(f"{source}: 'token' must be an array of tables: write [[token]], not [token]")
    principals: list[Principal] = []
    names: set[str] = set()
    hashes: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"{source}: [[token]] #{index + 1}"
        principal = _entry(entry, where)
        if principal.name in names:
            raise TokenFileError(f"{where}: name {principal.name!r} is used twice; names must be unique")
        if principal.digest.hex() in hashes:
            raise TokenFileError(f"{where} ({principal.name!r}): the same token hash appears twice")
        names.add(principal.name)
        hashes.add(principal.digest.hex())
        principals.append(principal)
    return principals


def _entry(entry: Any, where: str) -> Principal:
    if not isinstance(entry, dict):
        raise TokenFileError(f"{where}: must be a table")
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise TokenFileError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_ENTRY_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise TokenFileError(f"{where}: 'name' must be a non-empty string")
    where = f"{where} ({name!r})"
    role = entry.get("role")
    if role not in ROLES:
        raise TokenFileError(f"{where}: 'role' must be one of {', '.join(ROLES)}, got {role!r}")
    digest = entry.get("hash")
    if not isinstance(digest, str) or not _HASH_RE.fullmatch(digest):
        raise TokenFileError(
            f"{where}: 'hash' must be 'sha256:' and 64 lowercase hex digits, as `fleetwire token hash` prints; "
            "never put the token itself in the file"
        )
    worker_ids = entry.get("worker_ids")
    if worker_ids is not None:
        if role != "worker":
            raise TokenFileError(f"{where}: 'worker_ids' applies to role 'worker' only, not {role!r}")
        if not isinstance(worker_ids, str) or not worker_ids:
            raise TokenFileError(f"{where}: 'worker_ids' must be a non-empty glob string such as 'gpu-*'")
    return Principal(name, role, worker_ids, bytes.fromhex(digest[len(HASH_PREFIX):]))


class TokenStore:
    """The tokens the coordinator accepts, from a token file and/or inline tokens.

    Args:
        path: the token file; None for none.
        inline: ``(name, role, token)`` triples, e.g. from the environment shortcut.

    Raises:
        TokenFileError: the file cannot be read or parsed, or an inline name clashes with
            a name in the file.
    """

    def __init__(self, path: str | Path | None = None, inline: Iterable[tuple[str, Role, str]] = ()) -> None:
        self.path = None if path is None else Path(path)
        self._inline = [Principal(name, role, None, _digest(token)) for name, role, token in inline if token]
        self._principals: tuple[Principal, ...] = tuple(self._load())

    @classmethod
    def from_environ(cls, path: str | Path | None, environ: Mapping[str, str]) -> TokenStore:
        """A store with the token file (if any) and the ``FLEETWIRE_*_TOKEN`` shortcut."""
        inline = [(name, role, environ[var]) for var, (name, role) in ENV_TOKENS.items() if environ.get(var)]
        return cls(path, inline)

    def _load(self) -> list[Principal]:
        from_file: list[Principal] = []
        if self.path is not None:
            try:
                text = self.path.read_text(encoding="utf-8")
            except OSError as exc:
                raise TokenFileError(f"cannot read token file {self.path}: {exc.strerror or exc}") from None
            from_file = parse_token_file(text, str(self.path))
        names = {p.name for p in from_file}
        for principal in self._inline:
            if principal.name in names:
                raise TokenFileError(
                    f"token name {principal.name!r} is in {self.path} and also given inline "
                    "(--*-token flag or FLEETWIRE_*_TOKEN); rename one"
                )
        return from_file + self._inline

    def __len__(self) -> int:
        return len(self._principals)

    @property
    def principals(self) -> tuple[Principal, ...]:
        """Every principal in force."""
        return self._principals

    def roles(self) -> set[str]:
        """The roles that have at least one token."""
        return {p.role for p in self._principals}

    def authenticate(self, token: str) -> Principal | None:
        """The principal of ``token``, or None; constant time in which token matched."""
        digest = _digest(token)
        found: Principal | None = None
        for principal in self._principals:
            if hmac.compare_digest(digest, principal.digest):
                found = principal
        return found

    def current(self, principal: Principal) -> bool:
        """Whether ``principal`` (name, role, worker ids and token) is still in force."""
        return principal in self._principals

    def reload(self) -> list[Principal]:
        """Read the token file again and put it in force.

        Returns:
            The principals no longer in force (removed, or changed in any field): their
            sessions must be closed.

        Raises:
            TokenFileError: the file cannot be used; the old tokens stay in force.
        """
        fresh = tuple(self._load())
        revoked = [p for p in self._principals if p not in fresh]
        self._principals = fresh
        return revoked


def server_tls_context(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """The coordinator's TLS context: TLS 1.2 or later, and client certificates when asked.

    With ``client_ca_file`` a presented client certificate must chain to that CA; the
    server then requires one on ``/v1/worker`` (mTLS for workers) and leaves clients and
    browsers, which cannot easily hold one, to their tokens.

    Raises:
        ValueError: a file is missing or is not a PEM certificate/key.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load TLS certificate {cert_file} / key {key_file}: {exc}") from None
    if client_ca_file is not None:
        try:
            context.load_verify_locations(cafile=client_ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the client CA file {client_ca_file}: {exc}") from None
        context.verify_mode = ssl.CERT_OPTIONAL
    return context


def inline_tokens(worker: Sequence[str], client: Sequence[str], admin: Sequence[str]) -> list[tuple[str, Role, str]]:
    """``(name, role, token)`` triples for tokens given as settings, named after their role."""
    triples: list[tuple[str, Role, str]] = []
    for role, tokens in (("worker", worker), ("client", client), ("admin", admin)):
        triples.extend((role, role, token) for token in tokens if token)  # type: ignore[misc]
    return triples


BEARER_SUBPROTOCOL_PREFIX: Final = "fleetwire.bearer."


def bearer_token(headers: Headers) -> str | None:
    """The bearer token of a handshake: the Authorization header, else an offered subprotocol.

    Browsers cannot set headers, so they offer ``fleetwire.bearer.<base64url token>`` as a
    subprotocol (docs/PROTOCOL.md §1); the server never selects or echoes it.
    """
    value = headers.get("Authorization")
    if value:
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        return token.strip()
    for header in headers.get_all("Sec-WebSocket-Protocol"):
        for offered in header.split(","):
            offered = offered.strip()
            if offered.startswith(BEARER_SUBPROTOCOL_PREFIX):
                encoded = offered[len(BEARER_SUBPROTOCOL_PREFIX):]
                try:
                    return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
                except (binascii.Error, UnicodeDecodeError):
                    return None
    return None


class Gatekeeper:
    """Admits or refuses a websocket upgrade, before it happens (docs/PROTOCOL.md §1).

    In order: a browser's Origin (403), the connection limit (503), a worker's client
    certificate when mTLS is on (403), the bearer token (401 missing or unknown, 403 for a
    role that may not open the path), the penalty box (429 with ``Retry-After`` while the
    principal, from that address, is cooling off after an abusive close: :meth:`offence`).
    Each refusal is logged once with the peer's address, the path and, when the token was
    known, its principal's name; never the token. (429s are logged once per cool-off: a
    reconnect loop must not turn into a log flood; /metrics counts every one.)

    The penalty box is keyed by principal name *and* peer IP address (IP only with
    ``--insecure``): a worker token is often shared by a whole fleet, and one host that
    misbehaves must not keep the others from reconnecting.

    Args:
        tokens: the tokens in force; None accepts everyone (``--insecure``).
        limits: the server's limits.
        max_frame_bytes: the default frame limit, per role overridden by ``limits``.
        mtls_workers: whether ``/v1/worker`` requires a verified client certificate.
    """

    def __init__(
        self, tokens: TokenStore | None, limits: Limits, *, max_frame_bytes: int, mtls_workers: bool = False
    ) -> None:
        self.tokens = tokens
        self.limits = limits
        self.max_frame_bytes = max_frame_bytes
        self.mtls_workers = mtls_workers
        self._admitted: weakref.WeakKeyDictionary[ServerConnection, Principal] = weakref.WeakKeyDictionary()
        self.penalty = PenaltyBox(limits.penalty_base_s, limits.penalty_max_s)
        self.hold_s = min(limits.penalty_hold_s, limits.handshake_timeout_s / 2)
        self.penalties: dict[str, int] = {}  # cool-offs imposed, by the close code that caused them
        self._cooling_logged: set[str] = set()  # keys whose 429 was logged in their current cool-off

    def admit(
        self, conn: ServerConnection, request: Request, path: str, role: Literal["worker", "client"], open_sessions: int
    ) -> Response | None:
        """None to go on with the upgrade (the principal is kept for :meth:`principal`), else the refusal."""
        address = _address(conn)
        headers = request.headers
        refused = origin_refused(headers.get("Origin"), headers.get("Host"), self.limits.allowed_origins)
        if refused is not None:
            log.warning("refused connection", reason="origin", origin=headers.get("Origin"), path=path, address=address)
            return conn.respond(403, refused + "\n")
        limit = self.limits.max_connections
        if limit and open_sessions >= limit:
            log.warning("refused connection", reason="connection limit", limit=limit, path=path, address=address)
            return conn.respond(503, f"the coordinator is at its limit of {limit} connections; retry later\n")
        if role == "worker" and self.mtls_workers and not conn.transport.get_extra_info("peercert"):
            log.warning("refused connection", reason="no client certificate", path=path, address=address)
            return conn.respond(403, "workers must present a client certificate (the coordinator requires mTLS)\n")
        if self.tokens is None:
            principal = Principal(role, role)
        else:
            token = bearer_token(headers)
            if token is None:
                log.warning("refused connection", reason="missing token", path=path, address=address)
                return _unauthorized(conn, "missing 'Authorization: Bearer <token>' header")
            found = self.tokens.authenticate(token)
            if found is None:
                log.warning("refused connection", reason="invalid token", path=path, address=address)
                return _unauthorized(conn, "invalid token")
            if found.path_role != role:
                log.warning(
                    "refused connection", reason="wrong role", principal=found.name, token_role=found.role,
                    path=path, address=address,
                )
                return conn.respond(403, f"a {found.role} token cannot open {path}; use a {role} token\n")
            principal = found
        key = self._penalty_key(principal, conn)
        left = self.penalty.refusal(key, time.monotonic())
        if left is not None:
            return self._cooling(conn, principal, key, left, path, address)
        # Set before the upgrade completes, so the limit applies from the session's first frame.
        conn.protocol.max_message_size = self.limits.frame_bytes(role, self.max_frame_bytes)
        self._admitted[conn] = principal
        return None

    def offence(self, principal: Principal, conn: ServerConnection, code: int) -> None:
        """``conn`` of ``principal`` was closed with ``code``: an abusive close starts a cool-off.

        Codes outside :data:`~coordinator.limits.PENALIZED_CLOSES` are ignored.
        """
        if code not in PENALIZED_CLOSES or self.penalty.base_s <= 0:
            return
        key = self._penalty_key(principal, conn)
        cool_s = self.penalty.offend(key, time.monotonic())
        self._cooling_logged.discard(key)
        name = str(code)
        self.penalties[name] = self.penalties.get(name, 0) + 1
        log.warning("penalty box: new connections refused (HTTP 429) for a while", principal=principal.name,
                    address=_address(conn), code=code, cooloff_s=round(cool_s, 3))

    def _cooling(
        self, conn: ServerConnection, principal: Principal, key: str, left_s: float, path: str, address: str
    ) -> Response:
        if key not in self._cooling_logged:
            if len(self._cooling_logged) > 10_000:
                self._cooling_logged.clear()  # bounded; at worst a 429 is logged twice
            self._cooling_logged.add(key)
            log.warning("refused connection", reason="penalty box", principal=principal.name, path=path,
                        address=address, retry_after_s=round(left_s, 3))
        wait_s = max(1, math.ceil(left_s - self.hold_s))
        response = conn.respond(
            429, f"{principal.name!r} was recently closed for abuse (an oversize frame, protocol violations or "
                 f"flooding); retry in {wait_s} s\n",
        )
        response.headers["Retry-After"] = str(wait_s)
        return response

    async def hold(self, response: Response) -> Response:
        """``response`` (a penalty-box 429) after ``penalty_hold_s``: see coordinator/limits.py."""
        await asyncio.sleep(self.hold_s)
        return response

    def _penalty_key(self, principal: Principal, conn: ServerConnection) -> str:
        remote = conn.remote_address
        host = str(remote[0]) if remote else ""
        return host if self.tokens is None else f"{principal.name}@{host}"

    def principal(self, conn: ServerConnection) -> Principal:
        """The principal :meth:`admit` let in on ``conn``.

        Raises:
            KeyError: ``conn`` was not admitted (a driver bug; the connection is dropped).
        """
        return self._admitted.pop(conn)


def _unauthorized(conn: ServerConnection, why: str) -> Response:
    response = conn.respond(401, why + "\n")
    response.headers["WWW-Authenticate"] = 'Bearer realm="fleetwire"'
    return response


def _address(conn: ServerConnection) -> str:
    remote = conn.remote_address
    return f"{remote[0]}:{remote[1]}" if remote else ""
