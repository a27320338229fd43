"""Who may connect: bearer tokens with names and roles, and the token file (pure; no sockets).

The handshake side (TLS contexts, reading the bearer token, the gatekeeper) is coordinator/io/frontdoor/gate.py.

Rules (docs/OPERATIONS.md §Security):

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
* Unsafe tokens are refused (docs/OPERATIONS.md §Security): the ``change-me-*`` placeholders of
  examples/deploy/ (as tokens, or hashed in the file), tokens under 16 characters given inline
  (:func:`weak_tokens`; the coordinator command checks them at start), and one token for two
  principals (one role could act as the other; :class:`TokenStore` refuses it). The messages
  name the role or entry, never the token.
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

import hashlib
import hmac
import re
import secrets
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import structlog

__all__ = [
    "ENV_TOKENS",
    "Principal",
    "TokenFileError",
    "TokenStore",
    "hash_token",
    "inline_tokens",
    "new_token",
    "parse_token_file",
    "weak_tokens",
]

log = structlog.get_logger(__name__)

Role = Literal["worker", "client", "admin"]
ROLES: Final = ("worker", "client", "admin")
HASH_PREFIX: Final = "sha256:"
_HASH_RE: Final = re.compile(r"sha256:[0-9a-f]{64}")
_ENTRY_KEYS: Final = frozenset({"name", "role", "hash", "worker_ids"})
MIN_TOKEN_CHARS: Final = 16
PLACEHOLDER_PREFIX: Final = "change-me"
# The placeholders examples/deploy/*.env ship with, hashed: refused in a token file too.
_PLACEHOLDER_DIGESTS: Final = frozenset(
    hashlib.sha256(f"change-me-{role}-token".encode()).digest() for role in ROLES
)

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
    raw = bytes.fromhex(digest[len(HASH_PREFIX):])
    if raw in _PLACEHOLDER_DIGESTS:
        raise TokenFileError(
            f"{where}: 'hash' is the hash of a change-me placeholder token from examples/deploy; make a real "
            "token with `fleetwire token new`"
        )
    return Principal(name, role, worker_ids, raw)


def weak_tokens(inline: Iterable[tuple[str, Role, str]]) -> list[str]:
    """What is unsafe about inline ``(name, role, token)`` tokens, one line each (empty: nothing).

    A placeholder (``change-me...``) or fewer than 16 characters. The lines name the principal,
    never the token.
    """
    problems: list[str] = []
    for name, role, token in inline:
        if token.lower().startswith(PLACEHOLDER_PREFIX):
            problems.append(
                f"the {role} token ({name!r}) is the change-me placeholder of examples/deploy; "
                "make one with `fleetwire token new`"
            )
        elif len(token) < MIN_TOKEN_CHARS:
            problems.append(
                f"the {role} token ({name!r}) has {len(token)} characters; at least {MIN_TOKEN_CHARS} are "
                "required (`fleetwire token new` makes one of 43)"
            )
    return problems


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
        owners: dict[bytes, Principal] = {}
        for principal in from_file + self._inline:
            first = owners.setdefault(principal.digest, principal)
            if first is not principal:  # one token, two principals: whoever holds it acts as either
                raise TokenFileError(
                    f"the same token is given for {first.name!r} (role {first.role}) and {principal.name!r} "
                    f"(role {principal.role}); each needs its own token (`fleetwire token new`)"
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


def inline_tokens(worker: Sequence[str], client: Sequence[str], admin: Sequence[str]) -> list[tuple[str, Role, str]]:
    """``(name, role, token)`` triples for tokens given as settings, named after their role."""
    triples: list[tuple[str, Role, str]] = []
    for role, tokens in (("worker", worker), ("client", client), ("admin", admin)):
        triples.extend((role, role, token) for token in tokens if token)  # type: ignore[misc]
    return triples

