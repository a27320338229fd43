"""Length caps on the names a peer sends (docs/PROTOCOL.md §Name caps).

Names are not payloads: an op, a plan id, a tag, a worker id or a session key is copied into
log lines, indexes, metrics labels and every reply about the plan, so a 900 KB name costs far
more than its bytes. The coordinator refuses a longer one with ``invalid_argument`` naming
the field and the cap; the wire format is unchanged (the fields stay plain strings).

Sizes are UTF-8 bytes. The check is O(1) for the usual short name: a string of at most
``cap // 4`` characters cannot exceed ``cap`` bytes, so only longer ones are encoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = [
    "MAX_OP_BYTES",
    "MAX_PLAN_ID_BYTES",
    "MAX_SESSION_KEY_BYTES",
    "MAX_TAGS",
    "MAX_TAG_BYTES",
    "MAX_WORKER_ID_BYTES",
    "tags_problem",
    "too_long",
]

MAX_OP_BYTES: Final = 256
MAX_PLAN_ID_BYTES: Final = 128
MAX_TAG_BYTES: Final = 128
MAX_TAGS: Final = 64
MAX_WORKER_ID_BYTES: Final = 128
MAX_SESSION_KEY_BYTES: Final = 256


def too_long(field: str, value: str | None, cap: int) -> str | None:
    """Why ``value`` (the field ``field``) is too long, or None when it fits in ``cap`` bytes."""
    if value is None or len(value) <= cap // 4:
        return None
    size = len(value.encode("utf-8", "surrogatepass"))
    if size <= cap:
        return None
    return f"{field} is {size} bytes; at most {cap} bytes are allowed"


def tags_problem(field: str, tags: Sequence[str]) -> str | None:
    """Why a tag list is refused (more than :data:`MAX_TAGS` tags, or one over :data:`MAX_TAG_BYTES`), or None."""
    if len(tags) > MAX_TAGS:
        return f"{field} has {len(tags)} tags; at most {MAX_TAGS} are allowed"
    for index, tag in enumerate(tags):
        problem = too_long(f"{field}[{index}]", tag, MAX_TAG_BYTES)
        if problem is not None:
            return problem
    return None
