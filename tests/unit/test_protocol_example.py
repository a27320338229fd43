"""docs/PROTOCOL.md §9 and §10 show what the real core answers, produced by tests/docgen.py.

The examples are the frames of ``docgen.SCENARIO`` run through ``Coordinator(CoreConfig())``:
decoded as the server decodes them, answered by the core, encoded as the server encodes them.
Regenerate with ``python -m tests.docgen --write``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol import Codec, errors
from protocol.messages import Error, ToClient, ToWorker
from tests import docgen

PROTOCOL = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


@pytest.mark.parametrize("name", ["worker session", "client session"])
def test_example_is_what_the_core_answers_now(name: str) -> None:
    """The §9/§10 block equals a fresh run of the scenario (stale: run `python -m tests.docgen --write`)."""
    text = PROTOCOL.read_text()
    _, make = docgen.SECTIONS[name]
    assert docgen.splice(text, name, make()) == text, f"PROTOCOL.md's {name!r} example is stale"


def test_every_coordinator_frame_of_the_examples_decodes_for_its_peer() -> None:
    """Each ``←`` line is a valid frame of the peer's inbound union, as an SDK or agent would read it."""
    lines = docgen.run_scenario()
    peers: tuple[tuple[docgen.Peer, object], ...] = (("worker", ToWorker), ("client", ToClient))
    for peer, union in peers:
        codec = Codec("json", union, "coordinator")
        frames = [line[2:] for line in lines[peer] if line.startswith("← ")]
        assert frames
        for frame in frames:
            assert all(not hasattr(m, "code") or isinstance(m, Error) for m in codec.decode(frame))
            assert not [m for m in codec.decode(frame) if type(m).__name__ == "DecodeFailure"], frame


def test_client_example_shows_a_foreign_message_closed_4403_not_unknown_type() -> None:
    """A client's ``heartbeat`` (a worker message) closes 4403; a type of neither role is ``unknown_type``."""
    client = docgen.run_scenario()["client"]
    heartbeat = client.index('→ {"type":"heartbeat","load":{}}')
    assert client[heartbeat + 1].startswith(f"  (closed by the coordinator: {errors.CLOSE_FORBIDDEN} ")
    array = next(i for i, line in enumerate(client) if line.startswith('→ [{"type":"get_plan","req_id":11}'))
    codes = [m.get("code") for m in json.loads(client[array + 1][2:])]
    assert codes == [errors.INVALID_MESSAGE, errors.UNKNOWN_TYPE, None]


def test_examples_need_no_worker_of_another_principal_or_wall_clock() -> None:
    """Two runs give the same transcript: the scenario is deterministic (fixed clock, fixed ids)."""
    assert docgen.run_scenario() == docgen.run_scenario()
