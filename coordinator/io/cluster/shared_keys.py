"""The data-plane key every core of a cluster shares: rotated, and derived from a secret the database does not hold.

A pull from a worker served by another shard's core is signed with a key every core shares (``DataPlane.shared``,
coordinator/graphs/remote.py); workers verify it through ``data_keys`` as the cores' own keys. Theory of operation:

* **What the database keeps.** ``fleetwire_meta.data_keys``: the keys in use, newest first, each
  ``kid:seed:made_at:check`` joined by ``;`` (``seed``: 32 random bytes in hex, ``made_at``: Unix seconds of the
  database's clock, which every core judges the keys' age by,
  ``check``: see below). With a cluster secret (``--cluster-secret-file``, the same file on every coordinator)
  a key is HMAC-SHA256(secret, label + seed): the database alone (a backup, a read-only role) does not give it.
  Without one the key is the seed itself (the behaviour before the secret existed: anyone who reads the
  database can sign tickets), and the coordinator warns at start; its ``check`` is empty.
* **The check.** ``check`` is the first 16 hex digits of HMAC-SHA256(secret, check label + seed): a coordinator
  whose secret gives another value (or that has none, for a key made with one) refuses to start with
  :class:`ClusterSecretMismatch`, instead of signing tickets the other cores' workers answer 401.
* **Rotation.** Every ``rotation_s`` (``--data-key-rotation``) the first core to find the newest key old makes a new
  one, in one transaction holding the row's lock (``SELECT ... FOR UPDATE``): two cores never mint a key for one slot,
  and the others read it at their next round. A new key is *published* before it *signs*: for ``publish_s`` after its
  making (by the database's clock: the round every core takes to read it and tell its workers, ``data_keys``, plus a
  lease's life, past which a core that did not read the row has stopped serving, plus the reconnect grace, within
  which a worker whose session closed before its core read the row registers again and gets it in its ``welcome``,
  else is reaped; :func:`key_times`) every core accepts it and hands it to its workers but signs with the key before
  it, so no ticket signed with a key reaches a worker its own core has not told of it yet (the minting core included:
  it signed with the new key at once before, and a consumer it placed right after a rotation was refused by a holder
  on another core).
  A key that stopped signing stays accepted ``keep_s`` more (the tickets' life, ``--data-ticket-ttl``, plus the
  rounds a core may take to find that the next one signs now), then is dropped: from the cores' keys at once,
  from the row at the next rotation. A failover mid-rotation commits the new key whole or not at all, and the
  previous one stays accepted either way.
  At most ``MAX_KEPT_KEYS`` keys are kept (coordinator/data_plane.py; the newest ones): a key is kept the TTL plus
  :func:`overlap_s` (its successor's ``publish_s``, then the rounds of ``keep_s`` past the TTL)
  after its successor is made, so a rotation short enough to need more is refused at start
  (``key_rotation_problem`` with that overlap), and the cap only ever drops keys past their overlap.
* **Upgrade.** A database with the former never-rotated ``data_secret`` (plain text) gets its first rotated key
  with that one as the previous (tickets it signed stay valid for their life), and the ``data_secret`` row is
  deleted in the same transaction.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from coordinator import data_plane
from coordinator.data_plane import MAX_KEPT_KEYS

__all__ = [
    "ClusterSecretMismatch", "KeyTimes", "SharedKey", "accepted", "key_times", "overlap_s", "read_secret", "signing",
    "sync",
]  # fmt: skip

_KEY_LABEL: Final = b"fleetwire cluster data-plane key\x00"
_CHECK_LABEL: Final = b"fleetwire cluster secret check\x00"
MIN_SECRET_BYTES: Final = 16

_ENSURE: Final = "INSERT INTO fleetwire_meta (key, value) VALUES ('data_keys', '') ON CONFLICT (key) DO NOTHING"
_READ: Final = "SELECT value FROM fleetwire_meta WHERE key = 'data_keys'"
_LOCK: Final = "SELECT value FROM fleetwire_meta WHERE key = 'data_keys' FOR UPDATE"
_WRITE: Final = "UPDATE fleetwire_meta SET value = $1 WHERE key = 'data_keys'"
_LEGACY: Final = "SELECT value FROM fleetwire_meta WHERE key = 'data_secret'"
_DROP_LEGACY: Final = "DELETE FROM fleetwire_meta WHERE key = 'data_secret'"
_NOW: Final = "SELECT extract(epoch FROM clock_timestamp())::float8"


class ClusterSecretMismatch(ValueError):
    """This coordinator's cluster secret does not make the keys the database names (module docstring)."""


@dataclass(frozen=True, slots=True)
class SharedKey:
    """One shared key as the database keeps it (``seed`` is not the key when the cluster has a secret)."""

    kid: str
    seed: str  # hex
    made_at: float  # Unix seconds
    check: str  # "" for a key made without a secret

    def text(self) -> str:
        return f"{self.kid}:{self.seed}:{self.made_at!r}:{self.check}"


@dataclass(frozen=True, slots=True)
class KeyTimes:
    """How long a new shared key is accepted before it signs (``publish_s``), and how long one that stopped signing
    stays accepted (``keep_s``): what the cluster host passes :func:`sync` and :func:`accepted`."""

    publish_s: float
    keep_s: float


def key_times(*, ticket_ttl_s: float, lease_ttl_s: float, scan_s: float, reconnect_grace_s: float) -> KeyTimes:
    """The shared key's :class:`KeyTimes` (module docstring, "Rotation"); :func:`overlap_s` counts the same ones.

    ``publish_s``: 2 rounds and ``--lease-ttl`` (every core still serving has read the key and told its connected
    workers; one that did not renew that long has stopped), then ``--worker-reconnect-grace-s`` and a margin
    (``data_plane.publish_s``): a holder whose session closed just before its core's round is told only in its next
    ``welcome``, so it has registered again with the key by then, or its grace is over and it was reaped (its
    outputs lost, not refused). ``keep_s``: the tickets' life, plus the rounds a core may take to find that the
    next one signs now (it signs with this one until then)."""
    rounds_s = 2 * scan_s + lease_ttl_s
    return KeyTimes(rounds_s + data_plane.publish_s(reconnect_grace_s), ticket_ttl_s + rounds_s)


def overlap_s(lease_ttl_s: float, scan_s: float, reconnect_grace_s: float) -> float:
    """How long past the tickets' life a shared key stays kept after the next one is made: ``publish_s + keep_s``
    less the TTL (:func:`key_times`, as the cluster host passes them; the start check's ``key_rotation_problem``)."""
    times = key_times(ticket_ttl_s=0.0, lease_ttl_s=lease_ttl_s, scan_s=scan_s, reconnect_grace_s=reconnect_grace_s)
    return times.publish_s + times.keep_s


def read_secret(path: str) -> bytes:
    """The cluster secret in file ``path`` (surrounding whitespace ignored); ValueError when unusable."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the cluster secret file {path}: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret in {path} is {len(secret)} bytes; give at least {MIN_SECRET_BYTES} "
                         "(e.g. `openssl rand -hex 32 > FILE`)")  # fmt: skip
    return secret


def _check(secret: bytes, seed: str) -> str:
    return hmac.new(secret, _CHECK_LABEL + seed.encode("ascii"), hashlib.sha256).hexdigest()[:16]


def derive(key: SharedKey, secret: bytes | None) -> bytes:
    """The signing key of ``key``: HMAC of the secret over its seed (the seed itself for a key made without one)."""
    if not key.check:
        return bytes.fromhex(key.seed)
    assert secret is not None
    return hmac.new(secret, _KEY_LABEL + bytes.fromhex(key.seed), hashlib.sha256).digest()


def parse(text: str | None) -> list[SharedKey]:
    keys = []
    for item in (text or "").split(";"):
        if item:
            kid, seed, made_at, check = item.split(":")
            keys.append(SharedKey(kid, seed, float(made_at), check))
    return keys


def _verify(keys: list[SharedKey], secret: bytes | None) -> None:
    for key in keys:
        if not key.check:
            continue
        if secret is None:
            raise ClusterSecretMismatch(
                f"the cluster's shared data-plane key {key.kid} was made from a cluster secret, and this coordinator "
                "has none: start it with the same --cluster-secret-file (or $FLEETWIRE_CLUSTER_SECRET_FILE) as the "
                "cluster's other coordinators"
            )
        if not hmac.compare_digest(_check(secret, key.seed), key.check):
            raise ClusterSecretMismatch(
                f"this coordinator's cluster secret does not match the one the cluster's shared data-plane key "
                f"{key.kid} was made with: every coordinator of the cluster needs the same --cluster-secret-file "
                "(or $FLEETWIRE_CLUSTER_SECRET_FILE)"
            )


def _mint(secret: bytes | None, wall: float) -> SharedKey:
    seed = secrets.token_hex(32)
    return SharedKey("c" + secrets.token_hex(4), seed, wall, "" if secret is None else _check(secret, seed))


def _kept(keys: list[SharedKey], wall: float, keep_s: float, publish_s: float) -> list[SharedKey]:
    """The newest key, and the older ones not yet ``publish_s + keep_s`` past the making of the key that followed
    them (at most ``MAX_KEPT_KEYS`` in all, the newest)."""
    kept = keys[:1] + [key for newer, key in itertools.pairwise(keys) if wall < newer.made_at + publish_s + keep_s]
    return kept[:MAX_KEPT_KEYS]


def signing(keys: list[SharedKey], wall: float, publish_s: float) -> SharedKey | None:
    """The key that signs at ``wall``: the newest one made ``publish_s`` ago or more (every core has told its workers
    of it), else the oldest one kept (the first key of a cluster, or the former ``data_secret``: nothing older)."""
    for key in keys:
        if key.made_at + publish_s <= wall:
            return key
    return keys[-1] if keys else None


def accepted(
    keys: list[SharedKey], secret: bytes | None, wall: float, keep_s: float, publish_s: float = 0.0
) -> list[tuple[str, bytes]]:
    """The ``(kid, key)`` pairs a core signs with (the first: :func:`signing`) and has its workers verify with, at
    ``wall``. ``publish_s``: how long a new key is accepted before it signs (0: at once, one core)."""
    kept = _kept(keys, wall, keep_s, publish_s)
    first = signing(kept, wall, publish_s)
    ordered = [first, *(key for key in kept if key is not first)] if first is not None else []
    return [(key.kid, derive(key, secret)) for key in ordered]


def _due(keys: list[SharedKey], wall: float, rotation_s: float) -> bool:
    return not keys or (rotation_s > 0 and wall - keys[0].made_at >= rotation_s)


async def sync(
    conn: Any, secret: bytes | None, *, wall: float | None, rotation_s: float, keep_s: float, publish_s: float = 0.0
) -> tuple[list[SharedKey], float]:
    """The cluster's shared keys, newest first, after making a new one when due (one core does, under the row's
    lock), and the time they were judged at; :class:`ClusterSecretMismatch` when ``secret`` does not make them.

    ``wall``: now, in Unix seconds; None: the database's clock (every core then judges by the same clock).
    ``keep_s``, ``publish_s``: a key is kept until ``publish_s + keep_s`` after the next one was made (as
    :func:`accepted` keeps it).
    """
    if wall is None:
        wall = float(await conn.fetchval(_NOW))
    keys = parse(await conn.fetchval(_READ))
    _verify(keys, secret)
    if not _due(keys, wall, rotation_s):
        return keys, wall
    async with conn.transaction():
        await conn.execute(_ENSURE)
        keys = parse(await conn.fetchval(_LOCK))  # another core may have rotated since the read
        _verify(keys, secret)
        if not _due(keys, wall, rotation_s):
            return keys, wall
        if not keys:
            legacy = await conn.fetchval(_LEGACY)
            if legacy:  # the former never-rotated key: accepted for one overlap more, then gone
                keys = [SharedKey("c" + hashlib.sha256(bytes.fromhex(legacy)).hexdigest()[:8], legacy, wall, "")]
        keys = _kept([_mint(secret, wall), *keys], wall, keep_s, publish_s)
        await conn.execute(_WRITE, ";".join(key.text() for key in keys))
        await conn.execute(_DROP_LEGACY)
    return keys, wall
