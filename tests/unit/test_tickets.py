"""Data-plane tickets (protocol/tickets.py) and the coordinator's grants (coordinator/data_plane.py), pure."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.core import Coordinator, CoreConfig
from coordinator.data_plane import MAX_KEPT_KEYS, key_rotation_problem
from protocol.messages import (
    Accept,
    Capabilities,
    DataGrant,
    DataKeys,
    DataTicket,
    Done,
    Error,
    Event,
    Hello,
    InputSpec,
    OutputSpec,
    Submit,
)
from protocol.tickets import (
    DIGEST_DEFAULT,
    FileClaim,
    TicketClaims,
    TicketError,
    digest_problem,
    name_problem,
    new_hasher,
    sign,
    verify,
    worker_key,
)

MASTER = b"k" * 32
WALL = 1_700_000_000.0
DIGEST = "sha256:" + "0" * 64


def make(**changes: Any) -> str:
    fields: dict[str, Any] = {"plan": "p", "attempt": 2, "worker": "w", "dir": "put",
                              "files": {"x": FileClaim(10, DIGEST)}, "exp": WALL + 60}
    fields.update(changes)
    return sign(TicketClaims(**fields), "k1", worker_key(MASTER, "w"))


def check(ticket: str, keys: dict[str, bytes] | None = None, **changes: Any) -> FileClaim:
    request: dict[str, Any] = {"wall": WALL, "worker": "w", "plan": "p", "attempt": 2, "direction": "put", "name": "x"}
    request.update(changes)
    return verify(ticket, keys if keys is not None else {"k1": worker_key(MASTER, "w")}, **request)[1]


def test_a_valid_ticket_gives_the_declared_size_and_digest() -> None:
    """A ticket verifies for exactly its plan, attempt, worker, direction and name."""
    assert check(make()) == FileClaim(10, DIGEST)


@pytest.mark.parametrize(
    ("ticket_changes", "request_changes", "status"),
    [
        ({}, {"plan": "q"}, 403),
        ({}, {"attempt": 1}, 403),
        ({}, {"worker": "v"}, 403),
        ({}, {"direction": "get"}, 403),
        ({}, {"name": "y"}, 403),
        ({"exp": WALL - 1}, {}, 401),
        ({"exp": WALL}, {}, 401),
    ],
)
def test_foreign_or_expired_tickets_are_refused(
    ticket_changes: dict[str, Any], request_changes: dict[str, Any], status: int
) -> None:
    """Another plan, attempt, worker, direction or name is 403; an expired ticket is 401."""
    with pytest.raises(TicketError) as refused:
        check(make(**ticket_changes), **request_changes)
    assert refused.value.status == status


def test_forged_tickets_are_401() -> None:
    """A changed claim, another key, an unknown key id and garbage are all 401."""
    ticket = make()
    prefix, kid, body, mac = ticket.split(".")
    forged_claims = make(attempt=3).split(".")[2]
    for forged in (f"{prefix}.{kid}.{forged_claims}.{mac}", f"{prefix}.k9.{body}.{mac}", "garbage", "fw1.k1.!.!"):
        with pytest.raises(TicketError) as refused:
            check(forged)
        assert refused.value.status == 401
    other = sign(TicketClaims("p", 2, "w", "put", {"x": FileClaim(10, DIGEST)}, WALL + 60), "k1", b"x" * 32)
    with pytest.raises(TicketError):
        check(other)


def test_rotated_key_keeps_in_flight_tickets_valid() -> None:
    """After a rotation the worker holds current and previous keys: a ticket of the previous one still verifies."""
    old_ticket = make()
    keys = {"k2": worker_key(b"n" * 32, "w"), "k1": worker_key(MASTER, "w")}
    assert check(old_ticket, keys) == FileClaim(10, DIGEST)
    with pytest.raises(TicketError):  # two rotations later it is gone
        check(old_ticket, {"k3": b"z" * 32, "k2": keys["k2"]})


@pytest.mark.parametrize("name", ["", "a/b", "a\\b", "..", "a..b", ".", "a\x00b", "é" * 128, "tab\there"])
def test_bad_names(name: str) -> None:
    """Separators, dot-dot, NUL, control characters, empty and over 255 UTF-8 bytes are refused."""
    assert name_problem(name, "inputs[0].name") is not None


# The published test vectors for b"abc" (BLAKE3's test_vectors.json, FIPS 180-2, RFC 7693).
ABC_DIGESTS = [
    "blake3:6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85",
    "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
    "blake2b:ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d1"
    "7d87c5392aab792dc252d5de4533cc9518d38aa8dbf1925ab92386edd4009923",
]


@pytest.mark.parametrize("digest", ABC_DIGESTS)
def test_every_declarable_digest_algorithm_hashes_to_its_published_vector(digest: str) -> None:
    """A client in another language may declare blake3, sha256 or blake2b; the worker's hasher agrees with each."""
    assert digest_problem(digest, "inputs[0].digest") is None
    hasher = new_hasher(digest)
    hasher.update(b"a")
    hasher.update(memoryview(b"bc"))  # in pieces, as an upload arrives
    assert f"{digest.partition(':')[0]}:{hasher.hexdigest()}" == digest


def test_a_blake3_digest_of_the_wrong_length_is_refused_naming_it() -> None:
    """blake3 (the SDK's default, PROTOCOL.md) is 64 hex digits, like sha256."""
    assert DIGEST_DEFAULT == "blake3"
    assert digest_problem("blake3:" + "0" * 63, "inputs[0].digest") == (
        "inputs[0].digest must be blake3: and 64 lowercase hex digits"
    )


# --------------------------------------------------------------------------- the core's grants


def core_with_worker(data_url: str = "http://127.0.0.1:9") -> Coordinator:
    core = Coordinator(CoreConfig(), new_id=iter(f"p{i}" for i in range(100)).__next__)
    core.set_wall_offset(WALL)
    core.data.rotate("k1", MASTER, 0.0)
    core.open_session(1, "worker", 0.0)
    core.receive(1, Hello(worker_id="w", capabilities=Capabilities(ops=["op"]), data_url=data_url), 0.0)
    core.open_session(2, "client", 0.0)
    core.take_effects()
    return core


def test_leased_plan_with_inputs_gets_a_data_ready_ticket_the_worker_accepts() -> None:
    """data_ready carries the worker's URL and a put ticket that verifies with the worker's welcome key."""
    core = core_with_worker()
    core.receive(2, Submit(req_id=1, op="op", inputs=[InputSpec("x", 10, DIGEST)], outputs=["y"]), 1.0)
    sent = core.take_effects().sends
    ready = next(m for m in sent[2] if isinstance(m, Event) and m.kind == "data_ready")
    assert ready.data["url"] == "http://127.0.0.1:9"
    assign = next(m for m in sent[1] if type(m).__name__ == "Assign")
    assert assign.inputs == [InputSpec("x", 10, DIGEST)] and assign.outputs == ["y"]
    keys = {k.kid: k.key for k in core.data.worker_keys("w")}
    claim = verify(ready.data["ticket"], keys, wall=WALL + 1, worker="w", plan=ready.plan_id, attempt=1,
                   direction="put", name="x")[1]
    assert claim == FileClaim(10, DIGEST)
    assert ready.data["expires_at"] == WALL + 1.0 + CoreConfig().data_ticket_ttl_s


def test_rotation_sends_new_keys_to_connected_workers() -> None:
    """A rotation sends data_keys (new first, previous kept) to every connected worker."""
    core = core_with_worker()
    core.data.rotate("k2", b"n" * 32, 5.0)
    keys = [m for m in core.take_effects().sends[1] if isinstance(m, DataKeys)]
    assert [k.kid for k in keys[0].keys] == ["k2", "k1"]


@pytest.mark.parametrize(
    ("inputs", "outputs", "field"),
    [
        ([InputSpec("a/b", 1, DIGEST)], [], "inputs[0].name"),
        ([InputSpec("a", 1, DIGEST), InputSpec("..", 1, DIGEST)], [], "inputs[1].name"),
        ([InputSpec("a", -1, DIGEST)], [], "inputs[0].size"),
        ([InputSpec("a", 1, "md5:00")], [], "inputs[0].digest"),
        ([], ["ok", "x\x00"], "outputs[1]"),
    ],
)
def test_bad_data_specs_are_refused_at_submit_naming_the_field(
    inputs: list[InputSpec], outputs: list[str], field: str
) -> None:
    """Bad names, sizes and digests get invalid_argument naming the field; no plan is made."""
    core = core_with_worker()
    core.receive(2, Submit(req_id=1, op="op", inputs=inputs, outputs=outputs), 1.0)
    (error,) = core.take_effects().sends[2]
    assert isinstance(error, Error) and error.code == "invalid_argument" and field in error.message
    assert not core.plans


def test_data_ticket_for_outputs_after_success() -> None:
    """data_ticket(get) answers a grant covering the outputs the worker reported in done."""
    core = core_with_worker()
    core.receive(2, Submit(req_id=1, op="op", outputs=["y"]), 1.0)
    plan_id = next(iter(core.plans))
    core.take_effects()
    core.receive(1, Accept(plan_id=plan_id, attempt=1), 2.0)
    core.receive(1, Done(plan_id=plan_id, attempt=1, outcome="succeeded", outputs=[OutputSpec("y", 3, DIGEST)]), 3.0)
    core.receive(2, DataTicket(req_id=2, plan_id=plan_id), 4.0)
    grant = next(m for m in core.take_effects().sends[2] if isinstance(m, DataGrant))
    assert grant.files == {"y": [3, DIGEST]} and grant.direction == "get"


def test_a_key_rotated_out_keeps_verifying_for_the_tickets_life_then_is_dropped() -> None:
    """With rotations shorter than the TTL, a ticket signed just before a rotation verifies until it expires
    (its key outlives the next rotations), and its key is gone at the first rotation after that."""
    core = Coordinator(CoreConfig(data_ticket_ttl_s=100.0, data_key_rotation_s=30.0), new_id=iter(["p"]).__next__)
    core.set_wall_offset(WALL)
    core.data.rotate("k1", MASTER, 0.0)
    core.open_session(1, "worker", 0.0)
    core.receive(1, Hello(worker_id="w", capabilities=Capabilities(ops=["op"]), data_url="http://w"), 0.0)
    core.open_session(2, "client", 0.0)
    core.receive(2, Submit(req_id=1, op="op", inputs=[InputSpec("x", 10, DIGEST)]), 29.0)
    ready = next(m for m in core.take_effects().sends[2] if isinstance(m, Event) and m.kind == "data_ready")
    for at, kid in ((30.0, "k2"), (60.0, "k3"), (90.0, "k4")):  # three rotations within the ticket's life
        core.data.rotate(kid, kid.encode() * 16, at)
    keys = {k.kid: k.key for k in core.data.worker_keys("w")}
    assert list(keys) == ["k4", "k3", "k2", "k1"]
    verify(ready.data["ticket"], keys, wall=WALL + 128.0, worker="w", plan=ready.plan_id, attempt=1,
           direction="put", name="x")
    # k1 signed until k2 was published, publish_s (the reconnect grace and a tick: 6 s) after its rotation at 30:
    # tickets it signed live until 136.
    core.data.rotate("k5", b"5" * 32, 130.0)
    assert [k.kid for k in core.data.worker_keys("w")] == ["k5", "k4", "k3", "k2", "k1"]
    core.data.rotate("k6", b"6" * 32, 136.0)
    assert [k.kid for k in core.data.worker_keys("w")] == ["k6", "k5", "k4", "k3", "k2"]


def test_kept_keys_are_capped_and_a_rotation_too_short_for_the_ttl_is_refused() -> None:
    """At most MAX_KEPT_KEYS keys are kept (data_keys stays small), and a rotation that would need more is named
    for what it is, with the shortest rotation that works."""
    core = Coordinator(CoreConfig(data_ticket_ttl_s=1000.0, data_key_rotation_s=1.0), new_id=iter(["p"]).__next__)
    for at in range(3 * MAX_KEPT_KEYS):
        core.data.rotate(f"k{at}", MASTER, float(at))
    kids = [k.kid for k in core.data.worker_keys("w")]
    assert kids == [f"k{at}" for at in range(3 * MAX_KEPT_KEYS - 1, 2 * MAX_KEPT_KEYS - 1, -1)]
    assert len(kids) == MAX_KEPT_KEYS
    problem = key_rotation_problem(3600.0, 60.0)
    assert problem is not None
    assert "--data-key-rotation 60 is too short for --data-ticket-ttl 3600" in problem
    assert "at least 514.286 s" in problem
    assert key_rotation_problem(3600.0, 3600.0 / (MAX_KEPT_KEYS - 1)) is None
    assert key_rotation_problem(3600.0, 0.0) is None  # never rotated: one key
    assert key_rotation_problem(3600.0, 86400.0) is None
