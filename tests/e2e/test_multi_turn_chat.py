"""examples/multi_turn_chat runs end to end: every follow-up turn of a chat goes to the worker holding its prefix."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import ROOT, Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_multi_turn_chats_stay_on_their_cache_with_sdk_hints(cluster: Cluster) -> None:
    """run_local.py: three rotating chats on three kv_aware workers; each chat's turns all run on one worker."""
    proc = await cluster.script(ROOT / "examples" / "multi_turn_chat" / "run_local.py")
    assert await proc.wait(100) == 0, proc.lines
    turns = [m for line in proc.lines if (m := re.match(r"chat (\w+) turn (\d): on (gpu-[abc]), ~(\d+) prompt tokens, "
                                                        r"(\d+) prefix blocks hinted", line))]  # fmt: skip
    assert len(turns) == 12, proc.lines
    by_chat: dict[str, set[str]] = {}
    for m in turns:
        by_chat.setdefault(m.group(1), set()).add(m.group(3))
        assert int(m.group(4)) > 0 and int(m.group(5)) >= 2  # the SDK hinted every turn
    assert all(len(workers) == 1 for workers in by_chat.values()), by_chat
    assert len(set().union(*by_chat.values())) == 3  # and the chats spread over the workers
    assert any("sent before, to gpu-" in line for line in proc.lines)
    assert proc.lines[-1].startswith("9 of 9 follow-up turns stayed"), proc.lines
