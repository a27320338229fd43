"""Routing hints computed from an OpenAI-style request, so ``kv_aware`` and KV admission work by default.

Two parts fill them by this one rule, so their hashes agree: the SDK's ``Client.submit("generate",
args)`` (fleetwire/prompt_hints.py, docs/ROUTING.md §Hints from the SDK) and the coordinator's
OpenAI-compatible front door (coordinator/openai_api/, docs/OPENAI.md). :func:`fill_hints` fills
the fields of ``hints`` that the caller left empty from ``args`` as the inference handler sends
them (``{"messages": [...]}`` or ``{"prompt": "..."}``, worker_agent/inference.py):

* ``prompt_tokens``: an estimate without a tokenizer: :data:`CHARS_PER_TOKEN` characters a token
  over the prompt text, plus :data:`MESSAGE_OVERHEAD_TOKENS` per chat message (its role markers).
* ``max_output_tokens``: the request's ``max_tokens`` (or ``max_completion_tokens``), if any.
* ``prefix_hashes`` and ``prefix_block_tokens``: the chat history serialised message by message
  (role and content), cut into blocks of ``BLOCK_TOKENS * CHARS_PER_TOKEN`` characters; block
  ``i``'s hash covers it *and every block before it* (a chain: blake2b of the previous hash and
  the block), as the coordinator's prefix index expects (coordinator/placement/prefix.py). Only
  whole blocks are hashed, as engines cache only whole KV blocks. The next turn of a chat repeats
  the history before it, so its leading hashes are the previous turn's: the coordinator sends it
  to the worker it sent them to. Hashes are below 2^53, so JSON clients read them exactly.

A request without text this understands (a list of prompts, a missing prompt) gets no hints.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec

from protocol import RoutingHints

__all__ = [
    "BLOCK_TOKENS",
    "CHARS_PER_TOKEN",
    "MAX_HASHES",
    "MESSAGE_OVERHEAD_TOKENS",
    "PrefixMemo",
    "estimate_tokens",
    "fill_hints",
    "prefix_hashes",
    "prompt_text",
]

#: Characters per token of the estimate (OpenAI's rule of thumb for English text).
CHARS_PER_TOKEN: Final = 4
#: Tokens each prefix hash covers (vLLM's default KV block size).
BLOCK_TOKENS: Final = 16
#: Tokens a chat message costs beyond its text (role markers of the chat template).
MESSAGE_OVERHEAD_TOKENS: Final = 4
#: Hashes sent at most (the coordinator refuses more than 16,384): the first 256k tokens of a prompt.
MAX_HASHES: Final = 16_384
_MASK: Final = (1 << 53) - 1
_BLAKE2B_8: Final = hashlib.blake2b(digest_size=8)  # copied, never updated: each block's hash starts from it


def _is_mapping(value: Any) -> bool:
    """``isinstance(value, Mapping)``, without the ABC's cost for the dicts a JSON decoder makes (a hot path)."""
    return type(value) is dict or isinstance(value, Mapping)


def _content(value: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content list."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "".join(str(part.get("text", "")) for part in value if _is_mapping(part))
    return ""


def prompt_text(args: Any) -> tuple[str, int] | None:
    """The request's prompt as one text, and its chat message count (0: a completion prompt); None: none."""
    if not _is_mapping(args):
        return None
    messages = args.get("messages")
    if isinstance(messages, list):
        parts = [f"<|{m.get('role', '')}|>{_content(m.get('content'))}" for m in messages if _is_mapping(m)]
        return "".join(parts), len(parts)
    prompt = args.get("prompt")
    if isinstance(prompt, str):
        return prompt, 0
    return None


def estimate_tokens(text: str, messages: int = 0) -> int:
    """Tokens of ``text`` (ceil of characters / :data:`CHARS_PER_TOKEN`) plus the messages' overhead."""
    return math.ceil(len(text) / CHARS_PER_TOKEN) + messages * MESSAGE_OVERHEAD_TOKENS


def prefix_hashes(text: str, block_tokens: int = BLOCK_TOKENS, memo: dict[bytes, bytes] | None = None) -> list[int]:
    """Chained hashes of the whole blocks of ``text`` (``block_tokens`` estimated tokens each).

    ``memo``: digests already computed, by the bytes hashed (the previous digest and the block): a
    chat's next turn repeats the previous turn's blocks, so with the memo of a long-lived caller (the
    door's :class:`PrefixMemo`) only its new blocks are hashed. The hashes are the same either way.

    The OpenAI door computes them for every request (a 4k-token chat: 256 blocks), so the loop is
    lean: an ASCII text is encoded once and cut by bytes (one byte per character: the same blocks),
    any other per block; each hash is a copy of one made beforehand (a new ``blake2b`` parses its
    keyword arguments each time: +30 % per block).
    """
    size = block_tokens * CHARS_PER_TOKEN
    stop = min(len(text), MAX_HASHES * size) - size + 1
    hashes: list[int] = []
    if stop <= 0:
        return hashes
    copy, from_bytes, append = _BLAKE2B_8.copy, int.from_bytes, hashes.append
    data = text.encode("ascii") if text.isascii() else None
    previous = b""
    if memo is None:
        for start in range(0, stop, size):
            block = data[start:start + size] if data is not None else text[start:start + size].encode()
            chained = copy()
            chained.update(previous + block)
            previous = chained.digest()
            append(from_bytes(previous, "big") & _MASK)
        return hashes
    known = memo.get
    for start in range(0, stop, size):
        hashed = previous + (data[start:start + size] if data is not None else text[start:start + size].encode())
        digest = known(hashed)
        if digest is None:
            chained = copy()
            chained.update(hashed)
            digest = memo[hashed] = chained.digest()
        previous = digest
        append(from_bytes(previous, "big") & _MASK)
    return hashes


class PrefixMemo:
    """A bounded memo of block digests for :func:`prefix_hashes`: conversations' next turns hash only their
    new blocks (~0.2 µs a block remembered against ~0.4 µs hashed). Holds at most ``max_blocks`` digests
    (~200 bytes each, ~400 for a block of 4-byte characters; one prompt may add up to :data:`MAX_HASHES`
    past it), forgotten all at once when full.
    """

    def __init__(self, max_blocks: int = 1 << 16) -> None:
        self.max_blocks = max_blocks
        self.memo: dict[bytes, bytes] = {}

    def hashes(self, text: str) -> list[int]:
        """:func:`prefix_hashes` of ``text``, with the memo."""
        if len(self.memo) >= self.max_blocks:
            self.memo.clear()
        return prefix_hashes(text, BLOCK_TOKENS, self.memo)


def fill_hints(
    hints: RoutingHints, args: Any, hasher: Callable[[str], list[int]] = prefix_hashes,
) -> RoutingHints:
    """``hints`` with the fields left empty filled from the OpenAI-style ``args`` (module docstring);
    ``hasher``: :func:`prefix_hashes`, or one that remembers (the door's cache)."""
    found = prompt_text(args)
    if found is None:
        return hints
    text, messages = found
    changes: dict[str, Any] = {}
    if not hints.prompt_tokens:
        changes["prompt_tokens"] = estimate_tokens(text, messages)
    if not hints.max_output_tokens:
        limit = args.get("max_tokens", args.get("max_completion_tokens"))
        if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
            changes["max_output_tokens"] = limit
    if not hints.prefix_hashes:
        hashes = hasher(text)
        if hashes:
            changes.update(prefix_hashes=hashes, prefix_block_tokens=BLOCK_TOKENS)
    return msgspec.structs.replace(hints, **changes) if changes else hints
