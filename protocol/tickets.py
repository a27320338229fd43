"""Data-plane tickets: what lets a client read or write a plan's bytes on a worker (docs/PROTOCOL.md §Data plane).

Pure functions, no I/O and no clock: the coordinator signs (coordinator/data_plane.py), the
worker verifies (worker_agent/dataplane.py), each passing the wall time (Unix seconds) in.

Theory of operation:

* The coordinator holds a few *master keys*, each named by a key id (``kid``): the current one
  signs, older ones still verify while tickets they signed can live, so a rotation never breaks a
  ticket in flight (coordinator/data_plane.py: at most ``MAX_KEPT_KEYS``). A
  worker never sees a master key: it gets :func:`worker_key` of each (HMAC of the master over
  its worker id) in ``welcome`` and ``data_keys``, so one worker cannot forge tickets for another.
* A ticket is ``fw1.<kid>.<claims>.<mac>``: ``claims`` is base64url (no padding) of the JSON
  :class:`TicketClaims`, ``mac`` base64url of HMAC-SHA256 under the worker's key over
  ``fw1.<kid>.<claims>``. The claims scope it to one plan attempt on one worker, one direction
  (``put``: inputs, ``get``: outputs), the names with their declared sizes (and digests for
  inputs) and an expiry (``exp``, Unix seconds).
* :func:`verify` answers 401 for a ticket that is not one of ours (malformed, unknown key id,
  bad signature, expired) and 403 for a genuine ticket used out of its scope (another plan,
  attempt, worker, direction or name), without anything but the request line and headers.
* Names of inputs and outputs are plain file names (:func:`name_problem`): no ``/``, ``\\``,
  ``..``, NUL, nothing empty and at most 255 UTF-8 bytes; digests are ``blake3:<hex>``,
  ``sha256:<hex>`` or ``blake2b:<hex>`` (:func:`digest_problem`). The SDK and the worker make
  ``blake3`` ones (:data:`DIGEST_DEFAULT`): about 5 GB/s on one core, where sha256 is about 1 GB/s
  even with the CPU's SHA extensions, which made the hash the largest cost of a transfer on both
  ends; a client in another language may declare any of the three.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping
from typing import Any, Final, Literal

import blake3
import msgspec

__all__ = [
    "DIGEST_ALGORITHMS",
    "DIGEST_DEFAULT",
    "Direction",
    "FileClaim",
    "TicketClaims",
    "TicketError",
    "digest_problem",
    "name_problem",
    "new_hasher",
    "new_hasher_of",
    "sign",
    "verify",
    "worker_key",
]

Direction = Literal["put", "get"]

TICKET_PREFIX: Final = "fw1"
MAX_NAME_BYTES: Final = 255
#: Digest algorithms by prefix, with their hex length.
DIGEST_ALGORITHMS: Final[dict[str, int]] = {"blake3": 64, "sha256": 64, "blake2b": 128}
#: What the SDK declares for an input and the worker reports for an output.
DIGEST_DEFAULT: Final = "blake3"
_KEY_LABEL: Final = b"fleetwire data-plane worker key\x00"


class FileClaim(msgspec.Struct, array_like=True):
    """One name a ticket covers: its declared size (-1: not known) and digest ("" for none)."""

    size: int = -1
    digest: str = ""


class TicketClaims(msgspec.Struct, omit_defaults=True):
    """What a ticket allows (the signed part)."""

    plan: str
    attempt: int
    worker: str
    dir: Direction
    files: dict[str, FileClaim]
    exp: float  # Unix seconds after which the ticket is refused


class TicketError(Exception):
    """A ticket refused: ``status`` is the HTTP answer (401: not a valid ticket, 403: out of scope)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TicketClaims)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def worker_key(master: bytes, worker_id: str) -> bytes:
    """The key a worker verifies its tickets with: HMAC-SHA256(master, label + worker id)."""
    return hmac.new(master, _KEY_LABEL + worker_id.encode("utf-8"), hashlib.sha256).digest()


def sign(claims: TicketClaims, kid: str, key: bytes) -> str:
    """The ticket for ``claims``, signed with the worker key ``key`` (named ``kid``)."""
    head = f"{TICKET_PREFIX}.{kid}.{_b64(_encoder.encode(claims))}"
    mac = hmac.new(key, head.encode("ascii"), hashlib.sha256).digest()
    return f"{head}.{_b64(mac)}"


def verify(
    ticket: str,
    keys: Mapping[str, bytes],
    *,
    wall: float,
    worker: str,
    plan: str,
    attempt: int,
    direction: Direction,
    name: str,
) -> tuple[TicketClaims, FileClaim]:
    """Check a ticket for one request; the claims and the named file's claim when it is allowed.

    Args:
        ticket: the bearer string from the request.
        keys: this worker's keys by key id (the signing one and those still accepted).
        wall: now, in Unix seconds.
        worker, plan, attempt, direction, name: what the request asks for.

    Raises:
        TicketError: 401 (malformed, unknown key, bad signature, expired) or 403 (out of scope).
    """
    parts = ticket.split(".")
    if len(parts) != 4 or parts[0] != TICKET_PREFIX:
        raise TicketError(401, "malformed ticket")
    _, kid, body, mac_text = parts
    key = keys.get(kid)
    if key is None:
        raise TicketError(401, f"unknown ticket key {kid!r} (rotated out, or not from this coordinator)")
    try:
        mac = _unb64(mac_text)
        head = f"{TICKET_PREFIX}.{kid}.{body}".encode("ascii")
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise TicketError(401, "malformed ticket") from None
    if not hmac.compare_digest(mac, hmac.new(key, head, hashlib.sha256).digest()):
        raise TicketError(401, "bad ticket signature")
    try:
        claims = _decoder.decode(_unb64(body))
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise TicketError(401, "malformed ticket claims") from None
    if claims.exp <= wall:
        raise TicketError(401, f"ticket expired {wall - claims.exp:.0f} s ago; ask the coordinator for a new one")
    if claims.worker != worker:
        raise TicketError(403, f"ticket is for worker {claims.worker!r}, not {worker!r}")
    if claims.plan != plan or claims.attempt != attempt:
        raise TicketError(403, f"ticket is for plan {claims.plan!r} attempt {claims.attempt}")
    if claims.dir != direction:
        raise TicketError(403, f"ticket allows {claims.dir!r}, not {direction!r}")
    file = claims.files.get(name)
    if file is None:
        raise TicketError(403, f"ticket does not cover {name!r}")
    return claims, file


def name_problem(name: object, field: str) -> str | None:
    """Why ``name`` cannot name an input or output (the message names ``field``), or None."""
    if not isinstance(name, str) or not name:
        return f"{field} must be a non-empty string, got {name!r}"
    if "/" in name or "\\" in name or "\x00" in name or ".." in name or name == ".":
        return f"{field} {name!r} must be a plain file name: no '/', '\\\\', '..' or NUL"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return f"{field} is over {MAX_NAME_BYTES} bytes"
    if not name.isprintable():
        return f"{field} {name!r} must not contain control characters"
    return None


def digest_problem(digest: object, field: str) -> str | None:
    """Why ``digest`` is not ``<algorithm>:<hex>`` of a known algorithm (naming ``field``), or None."""
    if not isinstance(digest, str):
        return f"{field} must be a string"
    algorithm, sep, hexdigest = digest.partition(":")
    length = DIGEST_ALGORITHMS.get(algorithm)
    if not sep or length is None:
        return f"{field} must start with one of {', '.join(a + ':' for a in DIGEST_ALGORITHMS)}; got {digest[:20]!r}"
    if len(hexdigest) != length or any(c not in "0123456789abcdef" for c in hexdigest):
        return f"{field} must be {algorithm}: and {length} lowercase hex digits"
    return None


def new_hasher(digest: str) -> Any:
    """A fresh hasher of the algorithm ``digest`` names (``blake3:...``, ``sha256:...`` or ``blake2b:...``).

    Every one has ``update`` (which drops the GIL for big buffers) and ``hexdigest``.
    """
    return new_hasher_of(digest.partition(":")[0])


def new_hasher_of(algorithm: str = DIGEST_DEFAULT, *, parallel: bool = False) -> Any:
    """A fresh hasher of ``algorithm`` (a key of :data:`DIGEST_ALGORITHMS`; the default: blake3).

    ``parallel``: for big buffers, a hasher that splits each ``update`` over every core (blake3's
    threads; the others have none and hash on one).
    """
    if algorithm == "blake3":
        return blake3.blake3(max_threads=blake3.blake3.AUTO) if parallel else blake3.blake3()
    return hashlib.blake2b() if algorithm == "blake2b" else hashlib.sha256()
