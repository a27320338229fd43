"""Property-based fuzzing of the codec and the core: hostile bytes and well-typed-but-wrong messages.

Properties (docs/OPERATIONS.md §Test matrix row 18): no exception escapes ``Codec.decode`` or the core;
everything decoded can be encoded again for either kind of peer (so forwarding it cannot
break a writer); after every input the core's state passes ``coordinator.audit.violations``.
Example counts stay modest so the suite stays fast; ``bench/fuzz_live.py`` runs 10^5+
inputs against a live coordinator.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from coordinator import Coordinator, CoreConfig
from coordinator.audit import violations
from protocol import Codec, DecodeFailure
from protocol.messages import ALL_MESSAGE_TYPES, FromClient, FromWorker, ToClient, ToWorker, type_name

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

INBOUND = {"worker": FromWorker, "client": FromClient}
DECODERS = {(enc, role): Codec(enc, INBOUND[role], role) for enc in ("msgpack", "json") for role in INBOUND}
ENCODERS = [Codec(enc, out, "peer") for enc in ("msgpack", "json") for out in (ToWorker, ToClient)]
TYPES = [*sorted(type_name(cls) for cls in ALL_MESSAGE_TYPES), "", "nope"]

# Values of the untyped fields (args, data, result, detail), including what only one encoding holds.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(),
    st.integers(min_value=2**64, max_value=2**70),  # JSON only: msgpack cannot carry it
    st.text(max_size=8), st.binary(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(-(2**63), 2**63), st.none(), st.booleans()),
                        inner, max_size=4),
    ),
    max_leaves=12,
)

# Small pools so that hostile messages collide with real plans, workers and attempts.
plan_ids = st.sampled_from(["p1", "p2", "p3", "job", ""])
worker_ids = st.sampled_from(["w1", "w2", "w3", ""])
attempts = st.integers(min_value=-1, max_value=4)
fields = {
    "req_id": st.integers(min_value=-2, max_value=5),
    "plan_id": plan_ids,
    "attempt": attempts,
    "worker_id": worker_ids,
    "op": st.sampled_from(["echo", "sleep", "", "x"]),
    "kind": st.sampled_from(["log", "token", "running", "succeeded", "queued", ""]),
    "outcome": st.sampled_from(["succeeded", "failed", "cancelled", "exploded"]),
    "data": values,
    "args": values,
    "result": values,
    "ephemeral": st.booleans(),
    "error": st.one_of(st.none(), st.fixed_dictionaries({"code": st.text(max_size=5), "message": st.text(max_size=5)})),
    "capabilities": st.fixed_dictionaries({
        "ops": st.lists(st.sampled_from(["echo", "sleep", "x"]), max_size=3),
        "max_concurrency": st.integers(min_value=-1, max_value=3),
        "tags": st.lists(st.sampled_from(["gpu", "a"]), max_size=2),
    }),
    "running": st.lists(st.fixed_dictionaries({"plan_id": plan_ids, "attempt": attempts}), max_size=2),
    "plan_ids": st.lists(plan_ids, max_size=3),
    "all": st.booleans(),
    "from_seq": st.integers(min_value=-1, max_value=10),
    "max_attempts": st.integers(min_value=-1, max_value=3),
    "timeout_s": st.one_of(st.none(), st.floats()),
    "priority": st.integers(min_value=-3, max_value=3),
    "subscribe": st.booleans(),
    "requirements": st.fixed_dictionaries({"tags": st.lists(st.sampled_from(["gpu", "a"]), max_size=2)}),
    "load": st.fixed_dictionaries({"in_flight": st.integers(min_value=-1, max_value=3)}),
    "reason": st.text(max_size=5),
    "code": st.text(max_size=5),
}


TYPE_FIELDS = {type_name(cls): cls.__struct_fields__ for cls in ALL_MESSAGE_TYPES}
SENT_TYPES = sorted(type_name(cls) for cls in (*FromWorker.__args__, *FromClient.__args__))


@st.composite
def messages(draw: st.DrawFn) -> dict[str, Any]:
    """A map with a (mostly real) ``type``, most of that type's fields and a few others, some of the wrong type."""
    mtype = draw(st.sampled_from(SENT_TYPES) if draw(st.booleans()) else st.sampled_from(TYPES))
    msg: dict[str, Any] = {"type": mtype}
    own = [name for name in TYPE_FIELDS.get(mtype, ()) if name in fields and draw(st.integers(0, 9))]
    others = draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True))
    for name in [*own, *others]:
        msg[name] = draw(fields[name] if draw(st.integers(0, 19)) else values)
    return msg


def _encode_any(value: Any, encoding: str) -> bytes | str:
    try:
        if encoding == "msgpack":
            return msgspec.msgpack.encode(value)
        return msgspec.json.encode(value).decode()
    except (OverflowError, TypeError):
        reject()  # a value only the other encoding can write (a huge int, a nil map key)
        raise


def _check_decoded(decoded: list[Any], inbound: Any) -> None:
    """Each item is an inbound Struct or a DecodeFailure, and re-encodes for every kind of peer."""
    for item in decoded:
        assert isinstance(item, (DecodeFailure, *inbound.__args__)), item
        if not isinstance(item, DecodeFailure):
            for codec in ENCODERS:
                codec.encode_safe([item])


@FAST
@given(frame=st.binary(max_size=256), encoding=st.sampled_from(["msgpack", "json"]), role=st.sampled_from(["worker",
       "client"]))
def test_arbitrary_bytes_never_escape_the_decoder(frame: bytes, encoding: str, role: str) -> None:
    """Any bytes, as a binary or a text frame, decode to messages or failures; nothing raises."""
    codec = DECODERS[(encoding, role)]
    _check_decoded(codec.decode(frame), INBOUND[role])
    _check_decoded(codec.decode(frame.decode("utf-8", "replace")), INBOUND[role])


@FAST
@given(frame=st.lists(messages(), min_size=1, max_size=4), encoding=st.sampled_from(["msgpack", "json"]),
       role=st.sampled_from(["worker", "client"]))
def test_well_typed_but_wrong_messages_decode_or_fail_cleanly(frame: list[dict[str, Any]], encoding: str,
                                                              role: str) -> None:
    """Plausible messages with wrong, missing or extra fields decode or fail one by one; nothing raises."""
    codec = DECODERS[(encoding, role)]
    payload: Any = frame[0] if len(frame) == 1 else frame
    decoded = codec.decode(_encode_any(payload, encoding))
    _check_decoded(decoded, INBOUND[role])
    assert len(decoded) == len(frame)


@FAST
@given(value=values, encoding=st.sampled_from(["msgpack", "json"]))
def test_any_payload_one_peer_sends_can_be_forwarded_to_every_peer(value: Any, encoding: str) -> None:
    """Whatever a worker puts in an event's data reaches a msgpack or a JSON subscriber (or is refused up front)."""
    raw = {"type": "event", "plan_id": "p", "kind": "log", "data": value}
    frame = _encode_any(raw, encoding)
    _check_decoded(DECODERS[(encoding, "worker")].decode(frame), FromWorker)


class _Fuzzed:
    """Two worker and two client slots; a slot whose session was closed is reopened as a new connection."""

    def __init__(self) -> None:
        ids = (f"g{i}" for i in itertools.count(1))
        self.core = Coordinator(CoreConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=3.0,
                                           max_plans_per_client=4), new_id=lambda: next(ids))
        self.now = 0.0
        self.conns = itertools.count(1)
        self.slots: list[tuple[str, str, int]] = []
        for role, principal in (("worker", "fleet"), ("worker", "fleet"), ("client", "alice"), ("client", "bob")):
            self.slots.append((role, principal, self._open(role, principal)))

    def _open(self, role: str, principal: str) -> int:
        conn = next(self.conns)
        self.core.open_session(conn, role, self.now, principal=principal)  # type: ignore[arg-type]
        return conn

    def step(self, slot: int, raw: dict[str, Any], advance_s: float) -> None:
        self.now += advance_s
        role, _, conn = self.slots[slot]
        # Workers speak msgpack (nil map keys), clients JSON (huge integers): each peer's own oddities.
        encoding = "msgpack" if role == "worker" else "json"
        try:
            frame = msgspec.msgpack.encode(raw) if role == "worker" else msgspec.json.encode(raw).decode()
        except (OverflowError, TypeError):
            return  # this peer's encoding cannot write it
        for msg in DECODERS[(encoding, role)].decode(frame):
            self.core.receive(conn, msg, self.now)
        self.core.tick(self.now)
        effects = self.core.take_effects()
        for msgs in effects.sends.values():
            for codec_out in ENCODERS:
                codec_out.encode_safe(msgs)
        for closed, _, _ in effects.closes:
            self.core.close_session(closed, self.now)
            for i, (r, p, c) in enumerate(self.slots):
                if c == closed:
                    self.slots[i] = (r, p, self._open(r, p))
        self.core.take_effects()
        assert violations(self.core) == []


# A plausible session prefix so that the random tail meets registered workers and real plans.
_PRELUDE = [
    (0, {"type": "hello", "worker_id": "w1", "capabilities": {"ops": ["echo"], "max_concurrency": 2}}),
    (1, {"type": "hello", "worker_id": "w2", "capabilities": {"ops": ["echo", "x"], "max_concurrency": 1}}),
    (2, {"type": "submit", "req_id": 1, "op": "echo", "plan_id": "p1"}),
    (3, {"type": "submit", "req_id": 1, "op": "echo", "plan_id": "p2"}),
    (2, {"type": "submit", "req_id": 2, "op": "x", "plan_id": "p3"}),
    (3, {"type": "submit", "req_id": 2, "op": "sleep", "plan_id": "job"}),  # no worker handles it: queued
]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 3), messages(), st.sampled_from([0.0, 0.0, 0.5, 2.0, 5.0])), max_size=30))
def test_core_survives_hostile_sessions_and_stays_consistent(steps: list[tuple[int, dict[str, Any], float]]) -> None:
    """Random wrong messages on every session, with the clock jumping, never raise and never break consistency."""
    with capture_logs():  # thousands of log lines would only slow the run down
        fuzzed = _Fuzzed()
        for slot, raw in _PRELUDE:
            fuzzed.step(slot, raw, 0.0)
        for slot, raw, advance_s in steps:
            fuzzed.step(slot, raw, advance_s)
