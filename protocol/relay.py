"""The relay's constants: chunk size, default window, and the codes a ``data_end`` carries (docs/PROTOCOL.md §11 Relay).

Shared by the coordinator (coordinator/relay.py), the worker (worker_agent/relay.py) and the SDK
(fleetwire/relay.py). No I/O.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ARGS_INPUT",
    "BUSY",
    "CLOSED",
    "DEFAULT_IDLE_S",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_WINDOW_BYTES",
    "GONE",
    "MAX_CHUNK_BYTES",
    "REFUSED",
    "RESERVED_NAMES",
    "RESULT_OUTPUT",
    "RETRYABLE",
    "UNAUTHORIZED",
    "VIOLATION",
    "credit_every",
    "default_shares",
]

#: The largest ``data_chunk.data`` (bytes); far below the 1 MiB frame limit.
MAX_CHUNK_BYTES: Final = 256 << 10
#: A stream's window: unacknowledged bytes its sender may have in flight (sixty-four chunks: with 4 MiB, a
#: relayed stream's three processes waited on credit more than they worked).
DEFAULT_WINDOW_BYTES: Final = 64 * MAX_CHUNK_BYTES
#: The most bytes the coordinator lets all relayed streams have in flight together (``--relay-max-bytes``).
DEFAULT_MAX_BYTES: Final = 64 << 20  # four streams' whole windows
#: A stream whose window moved no byte (no chunk, no credit) this long gives its window back: it ends
#: ``relay_closed`` and is opened again when its sender goes on (``--relay-idle``).
DEFAULT_IDLE_S: Final = 10.0

#: The input an SDK moves oversize ``args`` to (msgpack of the args); the worker decodes it.
ARGS_INPUT: Final = "__args__"
#: The output a worker moves an oversize result to (msgpack of the result); ``plan.result()`` fetches it.
RESULT_OUTPUT: Final = "__result__"
RESERVED_NAMES: Final = frozenset({ARGS_INPUT, RESULT_OUTPUT})

# ---- data_end codes ("" is success); protocol/errors.py codes (plan_not_found, invalid_argument,
# input_mismatch, worker_disk_full ...) are used where one fits.
CLOSED: Final = "relay_closed"  # a party went away, or a newer open replaced the stream: open it again
BUSY: Final = "relay_busy"  # the coordinator's relay is at --relay-max-bytes: open it again shortly
VIOLATION: Final = "relay_violation"  # a chunk out of order, over its credit or over the declared size
UNAUTHORIZED: Final = "unauthorized"  # the worker refused the ticket (not valid: 401 on the direct path)
REFUSED: Final = "forbidden"  # the worker refused the ticket (out of scope: 403 on the direct path)
GONE: Final = "output_gone"  # the worker no longer holds the output (never made, expired, worker restarted): 404 direct
#: Codes after which the same stream may be opened again (from the acknowledged offset).
RETRYABLE: Final = frozenset({CLOSED, BUSY})


def credit_every(window: int) -> int:
    """How many bytes a stream's receiver takes between two ``data_credit`` s, given its window.

    A quarter window (one credit per four chunks of the default window, not one per chunk: each
    credit is a frame through three processes), but never so many that a sender with less than a
    chunk of its window left could wait for a credit that is not coming. 0 (a window of one
    chunk, or not known): a credit per chunk.
    """
    return max(0, min(window // 4, window - MAX_CHUNK_BYTES))


def default_shares(max_bytes: int) -> tuple[int, int]:
    """The relay's default shares of ``max_bytes`` (``--relay-max-bytes``): (per principal, per session).

    Half for one principal, a quarter for one session (each at least a chunk): with the defaults
    one session's streams hold one whole window at a time, one principal's two, so a client that
    opens streams and never sends leaves the rest of the relay to the others (coordinator/relay.py).
    """
    return max(max_bytes // 2, MAX_CHUNK_BYTES), max(max_bytes // 4, MAX_CHUNK_BYTES)
