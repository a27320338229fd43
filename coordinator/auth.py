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

Shared fleets (issue #27; the rules are coordinator/teams.py's): a client or admin entry may carry
``team = "vision"`` and ``weight = 2``, and ``[[team]]`` tables give teams a weight and quotas::

    [[token]]
    name = "carol"
    role = "client"
    team = "vision"                # optional: default, a team of its own named after it
    weight = 2                     # optional: its share within the team (alone: its team's), default 1
    hash = "sha256:..."

    [[team]]
    name = "vision"
    weight = 2                     # the team's share against other teams, default 1
    max_gpus = 8                   # optional quotas (coordinator/teams.py); none by default
    max_running = 20
    max_queued = 5000
    borrow = true                  # past a quota, use capacity nobody else waits for (default true)

A team or weight is not part of who a principal is: a reload that changes only those keeps its
sessions open (:meth:`TokenStore.reload` reports none revoked) and puts the new :attr:`TokenStore.teams`
in force.
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

from coordinator.teams import Member, Team, TeamBook, weight_problem

__all__ = [
    "ENV_TOKENS",
    "Principal",
    "TokenFileError",
    "TokenStore",
    "hash_token",
    "inline_tokens",
    "new_token",
    "parse_teams",
    "parse_token_file",
    "team_book",
    "weak_tokens",
]

log = structlog.get_logger(__name__)

Role = Literal["worker", "client", "admin"]
ROLES: Final = ("worker", "client", "admin")
HASH_PREFIX: Final = "sha256:"
_HASH_RE: Final = re.compile(r"sha256:[0-9a-f]{64}")
_ENTRY_KEYS: Final = frozenset({"name", "role", "hash", "worker_ids", "team", "weight"})
_TEAM_KEYS: Final = frozenset({"name", "weight", "max_gpus", "max_running", "max_queued", "borrow"})
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
        team: the team its entry names (None: a team of its own); not part of its identity.
        weight: the weight its entry gives (None: 1); not part of its identity.
    """

    name: str
    role: Role
    worker_ids: str | None = None
    digest: bytes = field(default=b"", repr=False)
    team: str | None = field(default=None, compare=False)
    weight: float | None = field(default=None, compare=False)

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
    return _parse(text, source)[0]


def parse_teams(text: str, source: str) -> TeamBook:
    """The teams of a token file's ``text``: its ``[[team]]`` tables and its entries' ``team`` and ``weight``.

    Raises:
        TokenFileError: as :func:`parse_token_file`, or a ``[[team]]`` table with a missing, unknown or
            invalid field, or a team named twice.
    """
    principals, teams = _parse(text, source)
    return team_book(principals, teams)


def team_book(principals: Iterable[Principal], teams: Iterable[Team] = ()) -> TeamBook:
    """The :class:`~coordinator.teams.TeamBook` of these principals and ``[[team]]`` tables."""
    members = {
        p.name: Member(p.team or p.name, 1.0 if p.weight is None else p.weight, alone=p.team is None)
        for p in principals if p.team is not None or p.weight is not None
    }
    return TeamBook(teams, members)


def _parse(text: str, source: str) -> tuple[list[Principal], list[Team]]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TokenFileError(f"{source}: not valid TOML: {exc}") from None
    unknown = sorted(set(data) - {"token", "team"})
    if unknown:
        raise TokenFileError(
            f"{source}: unknown top-level key(s) {unknown}; write one [[token]] table per token "
            "and one [[team]] table per team"
        )
    teams = _teams(data.get("team", []), source)
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
    return principals, teams


def _teams(entries: Any, source: str) -> list[Team]:
    """The ``[[team]]`` tables, each checked; the message names the table and what to change."""
    if not isinstance(entries, list):
        raise TokenFileError(f"{source}: 'team' must be an array of tables: write [[team]], not [team]")
    teams: list[Team] = []
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        where = f"{source}: [[team]] #{index + 1}"
        if not isinstance(entry, dict):
            raise TokenFileError(f"{where}: must be a table")
        unknown = sorted(set(entry) - _TEAM_KEYS)
        if unknown:
            raise TokenFileError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_TEAM_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name.strip():
            raise TokenFileError(f"{where}: 'name' must be a non-empty string")
        where = f"{where} ({name!r})"
        if name in seen:
            raise TokenFileError(f"{where}: team {name!r} has two [[team]] tables; merge them")
        seen.add(name)
        weight = entry.get("weight", 1.0)
        problem = weight_problem(weight)
        if problem:
            raise TokenFileError(f"{where}: 'weight' {problem}")
        borrow = entry.get("borrow", True)
        if not isinstance(borrow, bool):
            raise TokenFileError(f"{where}: 'borrow' must be true or false, got {borrow!r}")
        max_gpus = entry.get("max_gpus")
        if max_gpus is not None and (
            isinstance(max_gpus, bool) or not isinstance(max_gpus, (int, float)) or not 0 <= max_gpus < 1e6
        ):
            raise TokenFileError(f"{where}: 'max_gpus' must be a number >= 0, got {max_gpus!r}")
        quotas: dict[str, int | None] = {}
        for key in ("max_running", "max_queued"):
            value = entry.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise TokenFileError(f"{where}: {key!r} must be a whole number >= 0, got {value!r}")
            quotas[key] = value
        teams.append(Team(
            name, float(weight), None if max_gpus is None else float(max_gpus),
            quotas["max_running"], quotas["max_queued"], borrow,
        ))
    return teams


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
    team, weight = entry.get("team"), entry.get("weight")
    if (team is not None or weight is not None) and role == "worker":
        raise TokenFileError(
            f"{where}: 'team' and 'weight' apply to roles client and admin (who submit plans), not 'worker'"
        )
    if team is not None and (not isinstance(team, str) or not team.strip()):
        raise TokenFileError(f"{where}: 'team' must be a non-empty string such as 'vision'")
    if weight is not None:
        problem = weight_problem(weight)
        if problem:
            raise TokenFileError(f"{where}: 'weight' {problem}")
        weight = float(weight)
    return Principal(name, role, worker_ids, raw, team, weight)


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
        principals, teams = self._load()
        self._principals: tuple[Principal, ...] = tuple(principals)
        self._teams = team_book(principals, teams)

    @classmethod
    def from_environ(cls, path: str | Path | None, environ: Mapping[str, str]) -> TokenStore:
        """A store with the token file (if any) and the ``FLEETWIRE_*_TOKEN`` shortcut."""
        inline = [(name, role, environ[var]) for var, (name, role) in ENV_TOKENS.items() if environ.get(var)]
        return cls(path, inline)

    def _load(self) -> tuple[list[Principal], list[Team]]:
        from_file: list[Principal] = []
        teams: list[Team] = []
        if self.path is not None:
            try:
                text = self.path.read_text(encoding="utf-8")
            except OSError as exc:
                raise TokenFileError(f"cannot read token file {self.path}: {exc.strerror or exc}") from None
            from_file, teams = _parse(text, str(self.path))
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
        return from_file + self._inline, teams

    def __len__(self) -> int:
        return len(self._principals)

    @property
    def principals(self) -> tuple[Principal, ...]:
        """Every principal in force."""
        return self._principals

    @property
    def teams(self) -> TeamBook:
        """Every principal's team and weight, and the teams' weights and quotas, as the file says now."""
        return self._teams

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
            The principals no longer in force (removed, or changed in name, role, worker ids
            or token): their sessions must be closed. A changed ``team`` or ``weight`` only
            changes :attr:`teams`.

        Raises:
            TokenFileError: the file cannot be used; the old tokens stay in force.
        """
        principals, teams = self._load()
        fresh = tuple(principals)
        revoked = [p for p in self._principals if p not in fresh]  # team and weight are not compared
        self._principals = fresh
        self._teams = team_book(principals, teams)
        return revoked


def inline_tokens(worker: Sequence[str], client: Sequence[str], admin: Sequence[str]) -> list[tuple[str, Role, str]]:
    """``(name, role, token)`` triples for tokens given as settings, named after their role."""
    triples: list[tuple[str, Role, str]] = []
    for role, tokens in (("worker", worker), ("client", client), ("admin", admin)):
        triples.extend((role, role, token) for token in tokens if token)  # type: ignore[misc]
    return triples

