"""Routing hints computed from an OpenAI-style request, so ``kv_aware`` and KV admission work by default.

``Client.submit("generate", args)`` fills the fields of ``hints`` that the caller left empty
(docs/ROUTING.md §Hints from the SDK) with :func:`fill_hints`. The rule (token estimates, the
chained prefix hashes of the serialised chat) lives in protocol/prompts.py, which the
coordinator's OpenAI-compatible front door (coordinator/openai_api/) uses too: a chat sent
through the SDK and the same chat sent by an OpenAI client hash alike, so both find the worker
that holds their prefix. Nothing here imports the coordinator.
"""

from __future__ import annotations

from protocol.prompts import (
    BLOCK_TOKENS,
    CHARS_PER_TOKEN,
    MAX_HASHES,
    MESSAGE_OVERHEAD_TOKENS,
    estimate_tokens,
    fill_hints,
    prefix_hashes,
    prompt_text,
)

__all__ = [
    "BLOCK_TOKENS",
    "CHARS_PER_TOKEN",
    "MAX_HASHES",
    "MESSAGE_OVERHEAD_TOKENS",
    "estimate_tokens",
    "fill_hints",
    "prefix_hashes",
    "prompt_text",
]
