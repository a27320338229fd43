"""The SDK's routing hints for OpenAI-style requests (fleetwire/prompt_hints.py): estimates, chained prefix hashes."""

from __future__ import annotations

import hashlib

from fleetwire.prompt_hints import BLOCK_TOKENS, CHARS_PER_TOKEN, MAX_HASHES, fill_hints, prefix_hashes, prompt_text
from protocol import RoutingHints
from protocol.prompts import PrefixMemo

BLOCK = BLOCK_TOKENS * CHARS_PER_TOKEN


def history(turns: int) -> list[dict[str, str]]:
    """A chat of ``turns`` user/assistant exchanges after a system prompt."""
    messages = [{"role": "system", "content": "You are terse. " * 4}]
    for n in range(turns):
        messages += [{"role": "user", "content": f"question {n} " * 6}, {"role": "assistant", "content": f"answer {n}"}]
    return messages


def test_each_hash_covers_its_block_and_every_block_before_it() -> None:
    """Hash i is blake2b(hash i-1 + block i), masked below 2^53; only whole blocks are hashed."""
    text = "x" * BLOCK + "y" * BLOCK + "z" * (BLOCK - 1)
    first = hashlib.blake2b(("x" * BLOCK).encode(), digest_size=8).digest()
    second = hashlib.blake2b(first + ("y" * BLOCK).encode(), digest_size=8).digest()
    assert prefix_hashes(text) == [int.from_bytes(h, "big") & ((1 << 53) - 1) for h in (first, second)]
    assert prefix_hashes("y" * BLOCK + "y" * BLOCK)[1] != prefix_hashes(text)[1]  # same block, other prefix


def test_a_text_beyond_ascii_is_cut_into_blocks_of_characters_not_bytes() -> None:
    """Blocks are characters: a block of 'é' (two UTF-8 bytes each) hashes its BLOCK characters' bytes, as an
    ASCII block hashes its BLOCK bytes."""
    text = "é" * BLOCK + "x" * BLOCK
    first = hashlib.blake2b(("é" * BLOCK).encode(), digest_size=8).digest()
    second = hashlib.blake2b(first + ("x" * BLOCK).encode(), digest_size=8).digest()
    assert prefix_hashes(text) == [int.from_bytes(h, "big") & ((1 << 53) - 1) for h in (first, second)]


def test_a_memo_gives_the_same_hashes_and_hashes_only_a_next_turns_new_blocks() -> None:
    """With the door's memo the hashes are prefix_hashes'; a chat's next turn adds only its new blocks to the
    memo (the earlier ones are remembered, not hashed), and a full memo is emptied before it grows further."""
    memo = PrefixMemo(max_blocks=10)
    turn = "<|system|>" + "You are terse. " * 30
    first = memo.hashes(turn)
    assert first == prefix_hashes(turn) and len(memo.memo) == len(first)
    longer = turn + "<|user|>" + "what next? " * 30
    assert memo.hashes(longer) == prefix_hashes(longer)
    assert len(memo.memo) == len(prefix_hashes(longer))  # the new blocks only
    other = "é" * (BLOCK * 41)
    assert memo.hashes(other) == prefix_hashes(other) and len(memo.memo) == 41  # emptied first: it was full


def test_a_later_turn_repeats_the_earlier_turns_hashes() -> None:
    """A chat's next turn starts with every hash of the previous turn (the coordinator finds its worker)."""
    earlier = fill_hints(RoutingHints(), {"messages": history(2)})
    later = fill_hints(RoutingHints(), {"messages": history(3)})
    assert len(earlier.prefix_hashes) >= 2
    assert later.prefix_hashes[: len(earlier.prefix_hashes)] == earlier.prefix_hashes
    assert later.prompt_tokens > earlier.prompt_tokens > 0 and later.prefix_block_tokens == BLOCK_TOKENS


def test_estimates_and_max_tokens_fill_only_empty_fields() -> None:
    """prompt_tokens = ceil(chars / 4) + 4 per message; max_tokens becomes max_output_tokens; set fields stay."""
    args = {"messages": [{"role": "user", "content": "a" * 40}], "max_tokens": 32}
    text, count = prompt_text(args) or ("", 0)
    assert count == 1 and text == "<|user|>" + "a" * 40
    hints = fill_hints(RoutingHints(), args)
    assert (hints.prompt_tokens, hints.max_output_tokens) == (12 + 4, 32)
    mine = RoutingHints(prompt_tokens=7, max_output_tokens=3, prefix_hashes=[1, 2], prefix_block_tokens=512)
    assert fill_hints(mine, args) == mine
    assert fill_hints(RoutingHints(), {"prompt": "b" * 80}).prompt_tokens == 20


def test_requests_without_text_get_no_hints_and_long_ones_are_capped() -> None:
    """Args that are not an OpenAI request are left alone; a huge prompt sends at most MAX_HASHES hashes."""
    for args in (None, [1, 2], {"prompt": ["a", "b"]}, {"other": 1}):
        assert fill_hints(RoutingHints(), args) == RoutingHints()
    content = [{"type": "text", "text": "c" * 100}, {"type": "image_url"}]
    assert prompt_text({"messages": [{"role": "user", "content": content}]}) == ("<|user|>" + "c" * 100, 1)
    assert len(prefix_hashes("d" * (BLOCK * (MAX_HASHES + 5)))) == MAX_HASHES
