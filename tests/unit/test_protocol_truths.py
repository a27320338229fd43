"""docs/PROTOCOL.md states what the codec and the core do: each statement here is driven through the real ones.

Frames are decoded with :class:`protocol.Codec` as the server decodes them, handed to a real
:class:`coordinator.core.Coordinator` (fake clock), and its answers encoded as the server encodes
them (``encode_safe``) and decoded as the peer decodes them. The last tests parse the message and
record tables of PROTOCOL.md and compare them with the Structs of protocol/messages.py, so a field
added to the wire without a row (or a row for a field that is gone) fails here.

Handshake-level statements (subprotocols, paths, close 1007) are checked over a loopback server in
tests/integration/test_protocol_truths_server.py.
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from coordinator.core import Coordinator, CoreConfig
from coordinator.timeouts import DEFAULT_GRACE_S
from protocol import Codec, errors, messages
from protocol.messages import (
    ALL_MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Capabilities,
    DataKey,
    ErrorInfo,
    FromClient,
    FromWorker,
    GpuInfo,
    InputSpec,
    Load,
    OutputSpec,
    PlanInfo,
    Receipt,
    Requirements,
    RoutingHints,
    RunningPlan,
    ToClient,
    ToWorker,
    WorkerInfo,
    type_name,
)

PROTOCOL_MD = Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"
CAPS = '{"ops":["echo"],"max_concurrency":2}'


class Wire:
    """A real core behind real codecs: peers send frames (bytes or text) and read what a peer would decode."""

    def __init__(self, **config: Any) -> None:
        self.now = 0.0
        ids = (f"p{i}" for i in itertools.count(1))
        self.core = Coordinator(CoreConfig(**config), new_id=lambda: next(ids))
        self.conns = itertools.count(1)
        self.codecs: dict[int, tuple[Codec, Codec, Codec]] = {}  # conn -> (server in, server out, peer in)
        self.inbox: dict[int, list[Any]] = {}
        self.closes: dict[int, tuple[int, str]] = {}

    def open(self, role: str, encoding: str = "json", principal: str = "alice") -> int:
        conn = next(self.conns)
        inbound, outbound = (FromWorker, ToWorker) if role == "worker" else (FromClient, ToClient)
        self.codecs[conn] = (
            Codec(encoding, inbound, role),  # type: ignore[arg-type]
            Codec(encoding, outbound, "coordinator"),  # type: ignore[arg-type]
            Codec(encoding, outbound, "coordinator"),  # type: ignore[arg-type]
        )
        self.core.open_session(conn, role, self.now, principal=principal, address=f"10.0.0.{conn}:4000")  # type: ignore[arg-type]
        return conn

    def worker(self, worker_id: str = "w1", encoding: str = "json", caps: str = CAPS) -> int:
        conn = self.open("worker", encoding)
        self.send_json(conn, {"type": "hello", "worker_id": worker_id, "capabilities": json.loads(caps)})
        assert any(m.get("type") == "welcome" for m in self.take(conn))
        return conn

    def send(self, conn: int, frame: bytes | str) -> None:
        """One frame, exactly as the peer put it on the wire."""
        for msg in self.codecs[conn][0].decode(frame):
            self.core.receive(conn, msg, self.now)
        self._pump()

    def send_json(self, conn: int, *msgs: dict[str, Any]) -> None:
        """Messages encoded in the connection's own encoding."""
        codec = self.codecs[conn][0]
        body: Any = msgs[0] if len(msgs) == 1 else list(msgs)
        self.send(conn, json.dumps(body) if codec.text else msgspec.msgpack.encode(body))

    def tick(self, now: float) -> None:
        self.now = now
        self.core.tick(now)
        self._pump()

    def _pump(self) -> None:
        effects = self.core.take_effects()
        for conn, msgs in effects.sends.items():
            _, out, peer = self.codecs[conn]
            frame = out.encode_safe(msgs)
            decoded = json.loads(frame) if out.text else msgspec.msgpack.decode(frame)
            self.inbox.setdefault(conn, []).extend(decoded if isinstance(decoded, list) else [decoded])
            as_sent = frame.decode() if peer.text else frame  # a text frame for a JSON peer
            assert not [m for m in peer.decode(as_sent) if type(m).__name__ == "DecodeFailure"]
        for conn, code, reason in effects.closes:
            self.closes[conn] = (code, reason)
            self.core.close_session(conn, self.now)

    def take(self, conn: int) -> list[dict[str, Any]]:
        return self.inbox.pop(conn, [])

    def errors(self, conn: int) -> list[dict[str, Any]]:
        return [m for m in self.take(conn) if m.get("type") == "error"]

    def run_plan(self, client: int, worker: int, **submit: Any) -> str:
        """A plan submitted by ``client`` and accepted by ``worker`` (attempt 1); returns its id."""
        self.send_json(client, {"type": "submit", "req_id": 1, "op": "echo", **submit})
        assign = next(m for m in self.take(worker) if m.get("type") == "assign")
        self.send_json(worker, {"type": "accept", "plan_id": assign["plan_id"], "attempt": assign["attempt"]})
        self.take(worker)
        self.take(client)
        return str(assign["plan_id"])


@pytest.fixture
def wire() -> Wire:
    return Wire()


# ------------------------------------------------------------------ §2 bad_frame vs invalid_message

GOOD_MSGPACK = msgspec.msgpack.encode({"type": "list_workers", "req_id": 1})


@pytest.mark.parametrize(
    ("encoding", "frame"),
    [
        ("json", '{"type":"list_workers","req_id":1'),  # truncated
        ("json", '{"type":"list_workers" "req_id":1}'),  # malformed
        ("json", "nope"),
        ("json", ""),
        ("json", b'{"type":"list_workers","req_id":1}'),  # a binary frame on a JSON session
        ("msgpack", GOOD_MSGPACK[:-1]),  # truncated
        ("msgpack", GOOD_MSGPACK + b"\x01"),  # trailing bytes
        ("msgpack", b"\xc1"),  # never-used byte
        ("msgpack", b""),
        ("msgpack", '{"type":"list_workers","req_id":1}'),  # a text frame on a msgpack session
    ],
)
def test_a_frame_that_does_not_parse_is_bad_frame(wire: Wire, encoding: str, frame: bytes | str) -> None:
    """Malformed, truncated, empty or wrong-kind frames get error(bad_frame)."""
    client = wire.open("client", encoding)
    wire.send(client, frame)
    [error] = wire.errors(client)
    assert error["code"] == errors.BAD_FRAME, error


@pytest.mark.parametrize("body", [42, None, "x", [42], True])
@pytest.mark.parametrize("encoding", ["json", "msgpack"])
def test_a_value_that_is_not_a_message_is_invalid_message(wire: Wire, encoding: str, body: Any) -> None:
    """``42``, ``null``, a string, ``[42]``: they parse, so error(invalid_message) saying a message is a map."""
    client = wire.open("client", encoding)
    wire.send(client, json.dumps(body) if encoding == "json" else msgspec.msgpack.encode(body))
    [error] = wire.errors(client)
    assert error["code"] == errors.INVALID_MESSAGE
    assert "must be a map with a string 'type' field" in error["message"]


def test_an_array_frame_answers_each_bad_item_and_handles_the_good_ones(wire: Wire) -> None:
    """In ``[{list_workers}, 42]`` the list is answered and 42 gets invalid_message naming its index."""
    client = wire.open("client")
    wire.send(client, '[{"type":"list_workers","req_id":7}, 42]')
    first, second = wire.take(client)
    assert first["type"] == "workers" and first["req_id"] == 7
    assert second["code"] == errors.INVALID_MESSAGE and "(message 1 of the frame)" in second["message"]


# ------------------------------------------------------------------ §2 values between the encodings


def _relay_event(wire: Wire, data_frame: bytes) -> tuple[Any, Any]:
    """A msgpack worker's event ``data`` as a JSON subscriber and a msgpack subscriber receive it."""
    worker = wire.worker(encoding="msgpack")
    json_client = wire.open("client", "json")
    plan_id = wire.run_plan(json_client, worker)
    pack_client = wire.open("client", "msgpack")
    wire.send_json(pack_client, {"type": "subscribe", "req_id": 2, "plan_ids": [plan_id], "from_seq": 99})
    wire.take(pack_client)
    head = msgspec.msgpack.encode({"type": "event", "plan_id": plan_id, "attempt": 1, "kind": "log"})
    # A map of 5 entries: the 4 above plus ``data`` (raw msgpack, so keys and ext types are as given).
    frame = b"\x85" + head[1:] + msgspec.msgpack.encode("data") + data_frame
    wire.send(worker, frame)
    as_json = [m for m in wire.take(json_client) if m.get("kind") == "log"]
    as_pack = [m for m in wire.take(pack_client) if m.get("kind") == "log"]
    assert as_json and as_pack, (as_json, as_pack, wire.take(worker))
    return as_json[0]["data"], as_pack[0]["data"]


def test_msgpack_timestamp_is_accepted_and_reaches_json_peers_as_rfc3339(wire: Wire) -> None:
    """Extension type -1 (timestamp) passes: msgpack peers get the timestamp, JSON peers an RFC 3339 string."""
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=datetime.UTC)
    as_json, as_pack = _relay_event(wire, msgspec.msgpack.encode({"at": when}))
    assert as_json == {"at": "2024-05-06T07:08:09.123456Z"}
    assert as_pack == {"at": when}


def test_other_msgpack_extension_types_are_invalid_message(wire: Wire) -> None:
    """An extension type other than -1 is refused with invalid_message naming the type."""
    client = wire.open("client", "msgpack")
    frame = msgspec.msgpack.encode({"type": "submit", "req_id": 3, "op": "echo", "args": msgspec.msgpack.Ext(5, b"x")})
    wire.send(client, frame)
    [error] = wire.errors(client)
    assert (error["code"], error["req_id"]) == (errors.INVALID_MESSAGE, 3)
    assert "extension type 5" in error["message"]


def test_map_keys_one_and_true_are_one_key_for_every_peer(wire: Wire) -> None:
    """A msgpack map with keys 1 and true keeps one entry: the first key, the last value (msgpack peers too)."""
    # {1: "a", true: "b"}
    as_json, as_pack = _relay_event(wire, b"\x82\x01\xa1a\xc3\xa1b")
    assert as_json == {"1": "b"} and as_pack == {1: "b"}
    wire2 = Wire()
    # {false: "a", 0: "b"}
    as_json, as_pack = _relay_event(wire2, b"\x82\xc2\xa1a\x00\xa1b")
    assert as_json == {"false": "b"} and as_pack == {False: "b"}


def test_odd_keys_bytes_floats_and_ints_as_json_peers_see_them(wire: Wire) -> None:
    """nil/array keys become JSON text, bytes padded standard base64, NaN/±Infinity null, 64-bit ints exact."""
    value = {None: 1, "b": b"\xfb\xff", "nan": math.nan, "inf": math.inf, "ninf": -math.inf,
             "big": 2**64 - 1, "small": -(2**63), "float": 0.1}
    packed = msgspec.msgpack.encode(value)
    as_json, as_pack = _relay_event(wire, packed)
    assert as_json == {"null": 1, "b": "+/8=", "nan": None, "inf": None, "ninf": None,
                       "big": 2**64 - 1, "small": -(2**63), "float": 0.1}
    assert as_pack["b"] == b"\xfb\xff" and math.isnan(as_pack["nan"]) and as_pack["inf"] == math.inf


def test_a_json_integer_msgpack_cannot_hold_is_invalid_message_naming_its_path(wire: Wire) -> None:
    """2**64 in a JSON frame gets invalid_message naming ``$.args.n``."""
    client = wire.open("client")
    wire.send(client, '{"type":"submit","req_id":4,"op":"echo","args":{"n":18446744073709551616}}')
    [error] = wire.errors(client)
    assert error["code"] == errors.INVALID_MESSAGE and "`$.args.n`" in error["message"]


# ------------------------------------------------------------------ §4 req_id, event.attempt, hello.protocol


@pytest.mark.parametrize("msg", [
    {"type": "list_workers", "req_id": -1},
    {"type": "get_plan", "req_id": -7, "plan_id": "x"},
    {"type": "submit", "req_id": -2, "op": "echo"},
])
def test_a_negative_req_id_is_invalid_message_naming_the_field(wire: Wire, msg: dict[str, Any]) -> None:
    """req_id below 0 is refused with invalid_message naming `$.req_id`; nothing is done."""
    client = wire.open("client")
    wire.send_json(client, msg)
    [error] = wire.errors(client)
    assert error["code"] == errors.INVALID_MESSAGE and "`$.req_id`" in error["message"]
    assert not wire.core.plans


def test_req_id_zero_is_accepted_and_echoed(wire: Wire) -> None:
    """req_id 0 is accepted ("no request") and echoed as 0."""
    client = wire.open("client")
    wire.send_json(client, {"type": "list_workers", "req_id": 0})
    [reply] = wire.take(client)
    assert reply["type"] == "workers" and reply["req_id"] == 0


def test_a_worker_event_without_attempt_is_invalid_message_and_stops_nothing(wire: Wire) -> None:
    """event.attempt defaults to 0, which is never a lease: an event without it gets invalid_message naming
    attempt (not stale_lease, whose attempt 0 a worker would read as "stop any"), is not forwarded, and the plan
    goes on: the same event with its attempt is forwarded."""
    worker, client = wire.worker(), wire.open("client")
    plan_id = wire.run_plan(client, worker)
    wire.send_json(worker, {"type": "event", "plan_id": plan_id, "kind": "log", "data": "x"})
    [error] = wire.errors(worker)
    assert (error["code"], error["plan_id"]) == (errors.INVALID_MESSAGE, plan_id) and "attempt" in error["message"]
    assert not [m for m in wire.take(client) if m.get("kind") == "log"]
    assert wire.core.plans[plan_id].state == "running"
    wire.send_json(worker, {"type": "event", "plan_id": plan_id, "attempt": 1, "kind": "log", "data": "y", "seq": 9})
    assert [m["data"] for m in wire.take(client) if m.get("kind") == "log"] == ["y"]


@pytest.mark.parametrize("version", [0, 2, 99])
def test_hello_with_another_protocol_version_is_refused_and_not_registered(wire: Wire, version: int) -> None:
    """hello.protocol other than 1 gets invalid_argument naming hello.protocol and both versions."""
    worker = wire.open("worker")
    wire.send_json(worker, {"type": "hello", "worker_id": "w9", "capabilities": {}, "protocol": version})
    [error] = wire.errors(worker)
    assert error["code"] == errors.INVALID_ARGUMENT
    assert f"hello.protocol is {version}" in error["message"] and f"protocol {PROTOCOL_VERSION}" in error["message"]
    assert "w9" not in wire.core.registry
    wire.send_json(worker, {"type": "heartbeat"})
    assert [e["code"] for e in wire.errors(worker)] == [errors.NOT_REGISTERED]


# ------------------------------------------------------------------ §5 fencing: a finished plan has no lease


def test_done_for_another_workers_finished_plan_is_stale_not_4403(wire: Wire) -> None:
    """After w1's plan succeeded, w2's done for that attempt is stale_lease; w2's session stays open."""
    w1, client = wire.worker("w1"), wire.open("client")
    plan_id = wire.run_plan(client, w1)
    wire.send_json(w1, {"type": "done", "plan_id": plan_id, "attempt": 1, "outcome": "succeeded", "result": 1})
    w2 = wire.worker("w2")
    wire.send_json(w2, {"type": "done", "plan_id": plan_id, "attempt": 1, "outcome": "failed"})
    [error] = wire.errors(w2)
    assert (error["code"], error["plan_id"]) == (errors.STALE_LEASE, plan_id)
    assert w2 not in wire.closes
    assert wire.core.plans[plan_id].state == "succeeded"


def test_done_for_another_workers_current_lease_still_closes_4403(wire: Wire) -> None:
    """A worker naming the current attempt of a lease another worker holds is closed 4403; nothing changes."""
    w1, client = wire.worker("w1"), wire.open("client")
    plan_id = wire.run_plan(client, w1)
    w2 = wire.worker("w2")
    wire.send_json(w2, {"type": "done", "plan_id": plan_id, "attempt": 1, "outcome": "failed"})
    assert wire.closes[w2][0] == errors.CLOSE_FORBIDDEN
    assert "leased to another worker" in wire.closes[w2][1]
    assert wire.core.plans[plan_id].state == "running"


# ------------------------------------------------------------------ §2 which errors count toward 4400

COUNTED: list[tuple[str, str, list[dict[str, Any]]]] = [
    ("bad_frame", "client", []),
    ("invalid_message", "client", [{"type": "get_plan", "req_id": 1}]),
    ("unknown_type", "client", [{"type": "frobnicate", "req_id": 1}]),
    ("not_registered", "worker", [{"type": "heartbeat"}]),
    ("hello.protocol", "worker", [{"type": "hello", "worker_id": "w", "capabilities": {}, "protocol": 2}]),
    ("empty worker_id", "worker", [{"type": "hello", "worker_id": "", "capabilities": {}}]),
    ("long worker_id", "worker", [{"type": "hello", "worker_id": "w" * 200, "capabilities": {}}]),
]
NOT_COUNTED: list[tuple[str, list[dict[str, Any]]]] = [
    ("plan_not_found", [{"type": "get_plan", "req_id": 1, "plan_id": "nope"}]),
    ("invalid_argument (submit)", [{"type": "submit", "req_id": 1, "op": ""}]),
    ("invalid_argument (list_plans)", [{"type": "list_plans", "req_id": 1, "limit": 0}]),
    ("forbidden", [{"type": "drain_worker", "req_id": 1, "worker_id": "w"}]),
]


@pytest.mark.parametrize(("name", "role", "msgs"), COUNTED, ids=[c[0] for c in COUNTED])
def test_these_errors_count_toward_the_4400_limit(name: str, role: str, msgs: list[dict[str, Any]]) -> None:
    """max_protocol_errors of them close the session 4400."""
    wire = Wire(max_protocol_errors=3)
    conn = wire.open(role)
    for _ in range(3):
        if name == "bad_frame":
            wire.send(conn, "{nope")
        else:
            wire.send_json(conn, *msgs)
    assert wire.closes.get(conn, (None,))[0] == errors.CLOSE_PROTOCOL


def test_stale_lease_and_already_registered_count_as_documented() -> None:
    """already_registered counts; stale_lease (a late worker, not a broken one) does not."""
    wire = Wire(max_protocol_errors=3)
    worker = wire.worker("w1")
    for _ in range(5):
        wire.send_json(worker, {"type": "event", "plan_id": "gone", "attempt": 1, "kind": "log"})
    assert worker not in wire.closes
    for _ in range(3):
        wire.send_json(worker, {"type": "hello", "worker_id": "w1", "capabilities": {}})
    assert wire.closes[worker][0] == errors.CLOSE_PROTOCOL


@pytest.mark.parametrize(("name", "msgs"), NOT_COUNTED, ids=[c[0] for c in NOT_COUNTED])
def test_answers_to_well_formed_requests_do_not_count(name: str, msgs: list[dict[str, Any]]) -> None:
    """Refusals of a well-formed request never close the session, however many."""
    wire = Wire(max_protocol_errors=3)
    client = wire.open("client")
    for _ in range(10):
        wire.send_json(client, *msgs)
    assert client not in wire.closes
    assert wire.core.sessions[client].protocol_errors == 0


def test_a_reserved_event_kind_counts() -> None:
    """A worker event with a reserved kind is invalid_message and counts toward 4400."""
    wire = Wire(max_protocol_errors=2)
    worker = wire.worker("w1")
    for _ in range(2):
        wire.send_json(worker, {"type": "event", "plan_id": "p", "attempt": 1, "kind": "succeeded"})
    assert wire.closes[worker][0] == errors.CLOSE_PROTOCOL


# ------------------------------------------------------------------ §5 timeouts: the coordinator's backstop


@pytest.fixture
def slow() -> Wire:
    """A wire whose workers are not reaped while the fake clock jumps minutes (they would stop beating)."""
    return Wire(heartbeat_timeout_s=1e9)


def test_a_running_plan_past_timeout_and_grace_fails_timeout_and_its_worker_is_cancelled(slow: Wire) -> None:
    """Running timeout_s + grace with no done: failed timeout (enforced_by coordinator), cancel sent, lease held."""
    worker, client = slow.worker(), slow.open("client")
    slow.now = 1.0
    plan_id = slow.run_plan(client, worker, timeout_s=10)
    slow.tick(1.0 + 10 + DEFAULT_GRACE_S - 0.01)
    assert slow.core.plans[plan_id].state == "running"
    slow.tick(1.0 + 10 + DEFAULT_GRACE_S)
    assert slow.core.plans[plan_id].state == "failed"
    [cancel] = [m for m in slow.take(worker) if m.get("type") == "cancel"]
    assert (cancel["plan_id"], cancel["attempt"]) == (plan_id, 1)
    [failed] = [m for m in slow.take(client) if m.get("kind") == "failed"]
    assert failed["data"]["code"] == errors.TIMEOUT
    assert failed["data"]["detail"] == {"timeout_s": 10, "grace_s": DEFAULT_GRACE_S, "enforced_by": "coordinator"}
    assert plan_id in slow.core.registry.get("w1").leases  # held until the worker's done
    slow.send_json(worker, {"type": "done", "plan_id": plan_id, "attempt": 1, "outcome": "cancelled"})
    assert not slow.errors(worker)
    assert plan_id not in slow.core.registry.get("w1").leases
    assert slow.core.plans[plan_id].state == "failed"


def test_a_plan_whose_worker_reports_in_time_is_left_alone(slow: Wire) -> None:
    """The worker's own done(failed, timeout) ends it; the coordinator's tick later changes nothing."""
    worker, client = slow.worker(), slow.open("client")
    plan_id = slow.run_plan(client, worker, timeout_s=5)
    error = {"code": "timeout", "message": "ran past 5 s"}
    slow.send_json(worker, {"type": "done", "plan_id": plan_id, "attempt": 1, "outcome": "failed", "error": error})
    slow.tick(1000.0)
    plan = slow.core.plans[plan_id]
    assert plan.state == "failed" and plan.error == ErrorInfo("timeout", "ran past 5 s")
    assert not [m for m in slow.take(worker) if m.get("type") == "cancel"]


def test_a_plan_without_timeout_is_never_timed_out(slow: Wire) -> None:
    """No timeout_s: the coordinator never fails it, however long it runs."""
    worker, client = slow.worker(), slow.open("client")
    plan_id = slow.run_plan(client, worker)
    slow.tick(10**7)
    assert slow.core.plans[plan_id].state == "running"


def test_a_plan_with_inputs_is_timed_from_its_last_input(slow: Wire) -> None:
    """With inputs, the clock starts when the worker reported the last declared input arrived."""
    worker, client = slow.worker(), slow.open("client")
    inputs = [{"name": "a.bin", "size": 1, "digest": "sha256:" + "0" * 64},
              {"name": "b.bin", "size": 1, "digest": "sha256:" + "1" * 64}]
    plan_id = slow.run_plan(client, worker, timeout_s=10, inputs=inputs)
    slow.tick(500.0)  # uploads are slow: the handler has not started, no coordinator clock
    assert slow.core.plans[plan_id].state == "running"
    for name in ("a.bin", "b.bin"):
        slow.send_json(worker, {"type": "event", "plan_id": plan_id, "attempt": 1, "kind": "input_received",
                                "data": {"name": name, "size": 1, "digest": "x", "via": "direct"}})
    slow.tick(500.0 + 10 + DEFAULT_GRACE_S - 0.01)
    assert slow.core.plans[plan_id].state == "running"
    slow.tick(500.0 + 10 + DEFAULT_GRACE_S)
    assert slow.core.plans[plan_id].state == "failed"


def test_timeouts_do_not_keep_ended_plans(slow: Wire) -> None:
    """Thousands of plans that end in time leave the deadline heap compacted, not growing without bound."""
    worker, client = slow.worker(caps='{"ops":["echo"],"max_concurrency":1}'), slow.open("client")
    for i in range(3000):
        slow.send_json(client, {"type": "submit", "req_id": i + 1, "op": "echo", "timeout_s": 3600})
        assign = next(m for m in slow.take(worker) if m.get("type") == "assign")
        slow.send_json(worker, {"type": "accept", "plan_id": assign["plan_id"], "attempt": 1})
        slow.send_json(worker, {"type": "done", "plan_id": assign["plan_id"], "attempt": 1, "outcome": "succeeded"})
        slow.take(worker)
        slow.take(client)
    assert len(slow.core.timeouts) < 1100


# ------------------------------------------------------------------ the tables of PROTOCOL.md = the Structs

# Every record of protocol/messages.py (a Struct that is not a message), the known ones named so a
# lost import is noticed; a record added later is found by the scan and needs its §3 table too.
KNOWN_RECORDS: tuple[type[msgspec.Struct], ...] = (
    Capabilities, GpuInfo, Load, Requirements, RoutingHints, RunningPlan, ErrorInfo, PlanInfo, WorkerInfo,
    InputSpec, OutputSpec, DataKey, Receipt,
)
RECORDS: tuple[type[msgspec.Struct], ...] = tuple(
    cls for cls in vars(messages).values()
    if isinstance(cls, type) and issubclass(cls, msgspec.Struct) and cls.__module__ == messages.__name__
    and cls not in ALL_MESSAGE_TYPES and not cls.__name__.startswith("_")
)
assert set(KNOWN_RECORDS) <= set(RECORDS)
RELAY_STREAM_FIELDS = {"plan_id", "attempt", "name", "direction"}
_HEADING = re.compile(r"^\*\*(`?)([A-Za-z_]+)\1\*\*")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
RELAY_MESSAGES = ("data_open", "data_chunk", "data_credit", "data_end")


def _cells(line: str) -> list[str]:
    """The cells of a markdown table row (``\\|`` inside a cell is not a separator)."""
    return [c.strip() for c in _CELL_SPLIT.split(line.strip().strip("|"))]
_FIELD = re.compile(r"^`([a-z_0-9]+)`")


def _tables() -> dict[str, list[dict[str, Any]]]:
    """Every ``**`name`**`` / ``**Name**`` heading of PROTOCOL.md followed by a ``| Field |`` table."""
    found: dict[str, list[dict[str, Any]]] = {}
    lines = PROTOCOL_MD.read_text().splitlines()
    heading: str | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        match = _HEADING.match(line)
        if match:
            heading = match.group(2)
            if re.search(r"\bNo fields\b", line):
                found.setdefault(heading, []).append({"fields": {}, "defaults": True})
        elif line.startswith("| Field |") and heading is not None:
            columns = _cells(line)
            fields: dict[str, str | None] = {}
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = _cells(lines[i])
                name = _FIELD.match(cells[0])
                assert name, f"PROTOCOL.md: a row of {heading!r} does not start with a `field`: {lines[i]}"
                fields[name.group(1)] = cells[columns.index("Default")] if "Default" in columns else None
                i += 1
            found.setdefault(heading, []).append({"fields": fields, "defaults": "Default" in columns})
            heading = None
            continue
        elif line.startswith("#"):
            heading = None
        i += 1
    return found


def _relay_rows() -> dict[str, set[str]]:
    """The §11 Relay table: message -> the fields it names (besides the stream's four)."""
    rows: dict[str, set[str]] = {}
    for line in PROTOCOL_MD.read_text().splitlines():
        match = re.match(r"^\| `(data_[a-z]+)` \| [^|]+ \| (.+) \|$", line)
        if match and match.group(1) in RELAY_MESSAGES:
            rows[match.group(1)] = set(re.findall(r"`([a-z_]+)` \(", match.group(2)))
    return rows


def _required(cls: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls) if f.required}


def _names(cls: type[msgspec.Struct]) -> set[str]:
    return {f.name for f in msgspec.structs.fields(cls)}


@pytest.mark.parametrize("cls", ALL_MESSAGE_TYPES, ids=type_name)
def test_every_message_table_lists_exactly_the_structs_fields(cls: type[msgspec.Struct]) -> None:
    """Each table of a message has one row per field of its Struct, required where the Struct requires it."""
    tag = type_name(cls)  # type: ignore[arg-type]
    relay = _relay_rows()
    if tag in relay:
        assert relay[tag] | RELAY_STREAM_FIELDS == _names(cls), f"§11 Relay row of {tag!r}"
        return
    tables = _tables().get(tag)
    if tag == "error" and tables is None:
        pytest.fail("PROTOCOL.md has no table for `error`")
    assert tables, f"PROTOCOL.md has no field table for message `{tag}`"
    for table in tables:
        assert set(table["fields"]) == _names(cls), f"PROTOCOL.md table of `{tag}`"
        _check_required(tag, cls, table)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_every_record_table_lists_exactly_the_structs_fields(cls: type[msgspec.Struct]) -> None:
    """Each record of §3 has a table with one row per field of its Struct."""
    tables = _tables().get(cls.__name__)
    assert tables, f"PROTOCOL.md §3 has no table for {cls.__name__}"
    for table in tables:
        assert set(table["fields"]) == _names(cls), f"PROTOCOL.md table of {cls.__name__}"
        _check_required(cls.__name__, cls, table)


def _check_required(name: str, cls: type[msgspec.Struct], table: dict[str, Any]) -> None:
    if not table["defaults"]:  # no Default column: every field is required
        assert _required(cls) == set(table["fields"]), f"PROTOCOL.md table of {name}: give it a Default column"
        return
    said_required = {field for field, default in table["fields"].items() if default == "required"}
    assert said_required == _required(cls), f"PROTOCOL.md table of {name}: `required` rows"
