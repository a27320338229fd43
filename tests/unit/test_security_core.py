"""Security rules without sockets: scopes and plan limits in the core, tokens, limits, the codec's guards."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from coordinator import Coordinator, CoreConfig
from coordinator.audit import snapshot, violations
from coordinator.auth import TokenFileError, TokenStore, hash_token, parse_token_file
from coordinator.limits import Limits, PenaltyBox, TokenBucket, origin_refused
from fleetwire.cli.security import LIMIT_DEFAULTS, PLAN_LIMIT_DEFAULTS
from protocol import Codec, DecodeFailure, errors
from protocol.messages import (
    Accept,
    Accepted,
    Cancel,
    Capabilities,
    Done,
    Error,
    Event,
    FromClient,
    FromWorker,
    GetPlan,
    Hello,
    PlanReply,
    Reject,
    Submit,
    ToClient,
)


class Core:
    """A core with a fake clock; sessions opened with explicit principals; effects kept per connection."""

    def __init__(self, **config: Any) -> None:
        ids = (f"p{i}" for i in itertools.count(1))
        self.core = Coordinator(CoreConfig(**config), new_id=lambda: next(ids))
        self.conns = itertools.count(1)
        self.inbox: dict[int, list[Any]] = {}
        self.closes: list[tuple[int, int]] = []

    def open(self, role: str, principal: str, *, admin: bool = False, worker_ids: str | None = None) -> int:
        conn = next(self.conns)
        self.core.open_session(conn, role, 0.0, principal=principal, address=f"10.0.0.{conn}:1", admin=admin,
                               worker_ids=worker_ids)  # type: ignore[arg-type]
        return conn

    def send(self, conn: int, msg: Any) -> list[Any]:
        self.core.receive(conn, msg, 0.0)
        effects = self.core.take_effects()
        for c, msgs in effects.sends.items():
            self.inbox.setdefault(c, []).extend(msgs)
        self.closes.extend((c, code) for c, code, _ in effects.closes)
        assert violations(self.core) == []
        return self.inbox.pop(conn, [])

    def worker(self, worker_id: str, *, worker_ids: str | None = None) -> int:
        conn = self.open("worker", "workers", worker_ids=worker_ids)
        self.send(conn, Hello(worker_id=worker_id, capabilities=Capabilities(ops=["echo"], max_concurrency=4)))
        return conn

    def submit(self, conn: int, **kw: Any) -> list[Any]:
        return self.send(conn, Submit(req_id=1, op="echo", **kw))


def accepted_id(msgs: list[Any]) -> str:
    return next(m.plan_id for m in msgs if isinstance(m, Accepted))


# ---------------------------------------------------------------- scopes (row 14)


@pytest.mark.parametrize(
    ("role", "mtype"),
    [("client", "hello"), ("client", "heartbeat"), ("client", "done"), ("client", "event"),
     ("worker", "submit"), ("worker", "cancel"), ("worker", "list_workers")],
)
def test_message_of_the_other_role_closes_4403_and_changes_nothing(role: str, mtype: str) -> None:
    """A message type that only the other role may send closes the session 4403; the state is as it was."""
    c = Core()
    alice = c.open("client", "alice")
    c.worker("w1")
    plan_id = accepted_id(c.submit(alice))
    conn = c.open(role, "mallory")
    before = snapshot(c.core)
    with capture_logs() as logs:
        replies = c.send(conn, DecodeFailure(errors.UNKNOWN_TYPE, f"unknown message type {mtype!r}", 0, mtype))
    assert replies == [] and c.closes == [(conn, errors.CLOSE_FORBIDDEN)]
    assert snapshot(c.core) == before
    refused = [e for e in logs if e["event"] == "refused: out of scope"]
    assert len(refused) == 1 and refused[0]["principal"] == "mallory" and refused[0]["conn_id"] == conn
    assert c.send(conn, GetPlan(req_id=2, plan_id=plan_id)) == []  # a closing session is not served


def test_unknown_type_of_neither_role_stays_a_protocol_error() -> None:
    """A type no peer may send (a typo, or a coordinator-only type) is answered unknown_type, not closed."""
    c = Core()
    alice = c.open("client", "alice")
    for mtype in ("welcome", "submitt"):
        replies = c.send(alice, DecodeFailure(errors.UNKNOWN_TYPE, "unknown", 4, mtype))
        assert [(m.code, m.req_id) for m in replies] == [(errors.UNKNOWN_TYPE, 4)]
    assert c.closes == []


def test_worker_id_outside_the_tokens_glob_is_refused() -> None:
    """A worker token limited to gpu-* cannot register cpu-1 (4403, nothing registered) but can register gpu-1."""
    c = Core()
    conn = c.open("worker", "gpu-fleet", worker_ids="gpu-*")
    before = snapshot(c.core)
    c.send(conn, Hello(worker_id="cpu-1", capabilities=Capabilities(ops=["echo"])))
    assert c.closes == [(conn, errors.CLOSE_FORBIDDEN)]
    assert snapshot(c.core) == before and "cpu-1" not in c.core.registry
    ok = c.worker("gpu-1", worker_ids="gpu-*")
    assert "gpu-1" in c.core.registry and (ok, errors.CLOSE_FORBIDDEN) not in c.closes


@pytest.mark.parametrize("make", [
    lambda pid: Accept(plan_id=pid, attempt=1),
    lambda pid: Reject(plan_id=pid, attempt=1),
    lambda pid: Event(plan_id=pid, attempt=1, kind="log", data="forged"),
    lambda pid: Done(plan_id=pid, attempt=1, outcome="succeeded", result="forged"),
])
def test_worker_acting_on_another_workers_lease_is_closed_4403(make: Any) -> None:
    """Worker A naming worker B's current lease is closed 4403, and B's plan, lease and stream are untouched."""
    c = Core()
    alice = c.open("client", "alice")
    b = c.worker("b")
    plan_id = accepted_id(c.submit(alice))
    assert c.core.plans[plan_id].worker_id == "b"
    a = c.worker("a")
    before = snapshot(c.core)
    assert c.send(a, make(plan_id)) == []
    assert c.closes == [(a, errors.CLOSE_FORBIDDEN)]
    assert snapshot(c.core) == before
    c.send(b, Done(plan_id=plan_id, attempt=1, outcome="succeeded", result="real"))
    assert c.core.plans[plan_id].result == "real"


def test_another_workers_cancelled_lease_is_still_forbidden() -> None:
    """A cancelled plan still names its last worker: another worker's done for it is 4403, not stale."""
    c = Core()
    alice = c.open("client", "alice")
    c.worker("b")
    plan_id = accepted_id(c.submit(alice))
    c.send(alice, Cancel(req_id=2, plan_id=plan_id))
    a = c.worker("a")
    before = snapshot(c.core)
    c.send(a, Done(plan_id=plan_id, attempt=1, outcome="cancelled"))
    assert c.closes == [(a, errors.CLOSE_FORBIDDEN)] and snapshot(c.core) == before


def test_a_workers_own_older_attempt_stays_stale_lease() -> None:
    """A worker late with its own older attempt gets stale_lease and stays connected."""
    c = Core()
    alice = c.open("client", "alice")
    a = c.worker("a")
    plan_id = accepted_id(c.submit(alice))
    c.send(a, Reject(plan_id=plan_id, attempt=1, reason="busy"))  # requeued; no other worker: it waits
    replies = c.send(a, Done(plan_id=plan_id, attempt=1, outcome="succeeded"))
    assert [m.code for m in replies if isinstance(m, Error)] == [errors.STALE_LEASE]
    assert c.closes == []


def test_clients_see_only_their_plans_and_admin_sees_all() -> None:
    """Bob cannot read or cancel Alice's plan (plan_not_found, plan untouched); an admin can."""
    c = Core()
    alice, bob = c.open("client", "alice"), c.open("client", "bob")
    ops = c.open("client", "ops", admin=True)
    plan_id = accepted_id(c.submit(alice))
    before = snapshot(c.core)
    for msg in (GetPlan(req_id=3, plan_id=plan_id), Cancel(req_id=4, plan_id=plan_id)):
        assert [m.code for m in c.send(bob, msg)] == [errors.PLAN_NOT_FOUND]
    assert snapshot(c.core) == before
    assert [type(m) for m in c.send(ops, GetPlan(req_id=5, plan_id=plan_id))] == [PlanReply]
    reply = [m for m in c.send(ops, Cancel(req_id=6, plan_id=plan_id)) if isinstance(m, PlanReply)]
    assert reply[0].plan.state == "cancelled"


# ---------------------------------------------------------------- plan limit


def test_plan_limit_answers_too_many_plans_and_frees_on_finish() -> None:
    """Past its limit a principal's submit gets too_many_plans (state unchanged); a finished plan frees a slot."""
    c = Core(max_plans_per_client=2)
    alice, bob = c.open("client", "alice"), c.open("client", "bob")
    first = accepted_id(c.submit(alice))
    accepted_id(c.submit(alice, plan_id="second"))
    before = snapshot(c.core)
    with capture_logs() as logs:
        refused = c.submit(alice)
        c.submit(alice)
    assert [(m.code, m.req_id) for m in refused] == [(errors.TOO_MANY_PLANS, 1)]
    assert "--max-plans-per-client" in refused[0].message
    assert snapshot(c.core) == before
    assert len([e for e in logs if e["event"] == "refused: plan limit"]) == 1  # once per session
    assert accepted_id(c.submit(alice, plan_id="second", subscribe=False)) == "second"  # a retry is not new
    accepted_id(c.submit(bob))  # limits are per principal
    c.send(alice, Cancel(req_id=9, plan_id=first))
    accepted_id(c.submit(alice))


def test_restored_plans_count_against_their_owners_plan_limit() -> None:
    """After a restart, an owner's restored queued and running plans count against --max-plans-per-client."""
    from tests.unit.test_durability_core import Durable, running_plan

    h = Durable(max_plans_per_client=2)
    c, _, _ = running_plan(h)  # alice: one running
    h.submit(c, plan_id="waiting")  # and one queued
    h.restart(now=100.0)
    assert h.core.quota.held("alice") == 2
    alice, bob = h.client("alice"), h.client("bob")
    h.send(alice, Submit(req_id=41, op="echo"))
    assert [m.code for m in h.take(alice) if isinstance(m, Error)] == [errors.TOO_MANY_PLANS]
    assert h.state(h.submit(bob)) == "queued"  # others are not held back
    h.send(alice, Cancel(req_id=42, plan_id="waiting"))  # a restored plan that ends frees its slot
    assert h.state(h.submit(alice, plan_id="third")) == "queued"


# ---------------------------------------------------------------- tokens


ALICE = f'[[token]]\nname = "alice"\nrole = "client"\nhash = "{hash_token("alice-token")}"\n'
FLEET = f'[[token]]\nname = "gpu"\nrole = "worker"\nworker_ids = "gpu-*"\nhash = "{hash_token("gpu-token")}"\n'


def test_token_file_names_roles_and_globs() -> None:
    """A token file gives each token a name, a role and (workers) an id glob; only hashes are stored."""
    principals = parse_token_file(ALICE + FLEET, "tokens.toml")
    assert [(p.name, p.role, p.worker_ids) for p in principals] == [
        ("alice", "client", None),
        ("gpu", "worker", "gpu-*"),
    ]
    assert "alice-token" not in repr(principals)


@pytest.mark.parametrize(("text", "expected"), [
    ("[[token]]\nname = 'x'\nrole = 'client'\nhash = 'alice-token'\n", "never put the token itself"),
    ("[[token]]\nname = 'x'\nrole = 'root'\n" + f"hash = '{hash_token('t')}'\n", "'role' must be one of"),
    ("[[token]]\nrole = 'client'\n" + f"hash = '{hash_token('t')}'\n", "'name' must be a non-empty string"),
    ("[[token]]\nname = 'x'\nrol = 'client'\n", "unknown key(s) ['rol']"),
    ("[token]\nname = 'x'\n", "write [[token]], not [token]"),
    (ALICE + ALICE.replace("alice-token", "other"), "name 'alice' is used twice"),
    (ALICE.replace('"alice"', '"a2"') + ALICE, "the same token hash appears twice"),
    (ALICE.replace('role = "client"', 'role = "client"\nworker_ids = "x*"'), "applies to role 'worker' only"),
    ("not = [toml", "not valid TOML"),
])
def test_bad_token_file_says_which_entry_and_what_to_fix(text: str, expected: str) -> None:
    """Every mistake in a token file is refused with the file, the entry and what to change."""
    with pytest.raises(TokenFileError) as info:
        parse_token_file(text, "tokens.toml")
    assert "tokens.toml" in str(info.value) and expected in str(info.value)


def test_token_store_authenticates_reloads_and_reports_revoked(tmp_path: Path) -> None:
    """Tokens match by hash; a reload reports removed principals; a broken file keeps the old tokens."""
    path = tmp_path / "tokens.toml"
    path.write_text(ALICE + FLEET)
    store = TokenStore(path, [("worker", "worker", "env-worker-token")])
    alice = store.authenticate("alice-token")
    assert alice is not None and alice.name == "alice" and not alice.admin
    assert store.authenticate("alice-token ") is None and store.authenticate("") is None
    assert store.authenticate("env-worker-token") is not None
    path.write_text(FLEET)
    assert [p.name for p in store.reload()] == ["alice"]
    assert not store.current(alice) and store.authenticate("alice-token") is None
    path.write_text("broken = [")
    with pytest.raises(TokenFileError):
        store.reload()
    assert store.authenticate("gpu-token") is not None  # the old tokens stay in force


def test_inline_token_name_clash_is_refused(tmp_path: Path) -> None:
    """An environment token whose name is also in the token file is refused at start."""
    path = tmp_path / "tokens.toml"
    path.write_text(ALICE)
    with pytest.raises(TokenFileError, match="also given inline"):
        TokenStore(path, [("alice", "client", "x")])


# ---------------------------------------------------------------- limits


def test_token_bucket_throttles_then_refuses_a_sustained_flood() -> None:
    """Within the rate nothing waits; over it the reader pauses; staying over it past the grace closes."""
    bucket = TokenBucket(rate=100.0, burst=10, grace_s=1.0, last_s=0.0)
    assert bucket.take(10, 0.0) == 0.0
    pause = bucket.take(5, 0.0)
    assert pause == pytest.approx(0.05)
    now = 0.0
    for _ in range(30):  # a peer that keeps sending as soon as it is read again
        now += pause or 0.0
        pause = bucket.take(5, now)
        if pause is None:
            break
    assert pause is None and now > 1.0
    calm = TokenBucket(rate=100.0, burst=10, grace_s=1.0, last_s=0.0)
    calm.take(15, 0.0)
    assert calm.take(1, 1.0) == 0.0 and calm.throttled_since is None  # it slowed down: forgiven


def test_single_message_flood_held_back_by_the_throttle_is_still_closed() -> None:
    """A flooder held back by TCP finds a token after each pause; that is no break: closed after the grace."""
    bucket = TokenBucket(rate=1000.0, burst=10, grace_s=1.0, last_s=0.0)
    now, outcome = 0.0, bucket.take(10, 0.0)
    while outcome is not None and now < 5.0:
        pause = bucket.take(1, now)  # the next frame was already waiting: read as soon as the pause ends
        if pause is None:
            outcome = None
            break
        if pause:
            now += pause + 0.002  # the reader's sleep overshoots a little, so a token or two is waiting
    assert outcome is None and 1.0 < now < 1.1


@pytest.mark.parametrize(("origin", "host", "allowed", "ok"), [
    (None, "c:8765", (), True),
    ("http://c:8765", "c:8765", (), True),
    ("https://evil.example", "c:8765", (), False),
    ("http://c:9999", "c:8765", (), False),
    ("https://dash.example.com", "c:8765", ("https://dash.example.com/",), True),
    ("https://evil.example", "c:8765", ("*",), True),
    ("null", "c:8765", (), False),
])
def test_origin_allow_list(origin: str | None, host: str, allowed: tuple[str, ...], ok: bool) -> None:
    """Browsers pass only from the coordinator's own origin or an allowed one; non-browsers send none."""
    assert (origin_refused(origin, host, allowed) is None) is ok


def test_penalty_box_cool_off_doubles_per_offence_and_is_forgiven() -> None:
    """Each offence doubles the cool-off up to the max; a peer clean for the max starts over; memory is bounded."""
    box = PenaltyBox(base_s=1.0, max_s=4.0, max_keys=2)
    assert box.refusal("alice@h", 0.0) is None
    assert [box.offend("alice@h", t) for t in (0.0, 1.5, 4.0, 9.0)] == [1.0, 2.0, 4.0, 4.0]
    assert box.refusal("alice@h", 10.0) == pytest.approx(3.0)
    assert box.refusal("bob@h", 10.0) is None  # per principal and address
    assert box.boxed(10.0) == 1
    assert box.refusal("alice@h", 13.0) is None  # cool-off over; strikes still remembered
    assert box.offend("alice@h", 14.0) == 4.0
    assert box.offend("alice@h", 30.0) == 1.0  # clean for longer than max_s: from the base again
    box.offend("bob@h", 30.1)
    box.offend("carol@h", 30.2)
    assert box.refusal("alice@h", 30.5) is None and box.boxed(30.5) == 2  # the oldest offender forgotten
    off = PenaltyBox(base_s=0.0, max_s=60.0)
    assert off.offend("x", 0.0) == 0.0 and off.refusal("x", 0.0) is None


def test_limits_refuse_values_that_cannot_work() -> None:
    """A negative, zero or tiny limit is refused with its name."""
    for bad in ({"max_connections": -1}, {"handshake_timeout_s": 0}, {"client_burst": 0},
                {"worker_frame_bytes": 10}, {"client_rate": -5}, {"penalty_base_s": -1}):
        with pytest.raises(ValueError, match=next(iter(bad)).removesuffix("_s").replace("_", ".")):
            Limits(**bad).check()  # type: ignore[arg-type]


def test_cli_limit_defaults_mirror_the_coordinators() -> None:
    """The CLI's help defaults are the Limits defaults."""
    defaults = Limits()
    assert {f: d for f, d in LIMIT_DEFAULTS.values()} == {
        f: getattr(defaults, f) for f, _ in LIMIT_DEFAULTS.values()
    }
    assert {f for f, _ in LIMIT_DEFAULTS.values()} | {"allowed_origins", "allowed_hosts"} == {
        f.name for f in dataclasses.fields(Limits)
    }


def test_cli_plan_limit_defaults_mirror_the_cores() -> None:
    """The CLI's help defaults of the plan limits are the CoreConfig defaults."""
    defaults = CoreConfig()
    assert {f: d for f, d in PLAN_LIMIT_DEFAULTS.values()} == {
        f: getattr(defaults, f) for f, _ in PLAN_LIMIT_DEFAULTS.values()
    }


# ---------------------------------------------------------------- codec guards


def test_json_integer_too_big_for_msgpack_is_refused_with_its_path() -> None:
    """A JSON integer msgpack cannot carry is refused at the boundary, naming where it is."""
    codec = Codec("json", FromClient, "client")
    msgs = codec.decode('[{"type":"submit","req_id":7,"op":"e","args":{"n":[1,18446744073709551616]}},'
                        '{"type":"submit","req_id":8,"op":"e","args":{"n":18446744073709551615}}]')
    assert isinstance(msgs[0], DecodeFailure) and msgs[0].req_id == 7
    assert "`$.args.n[1]`" in msgs[0].message
    assert isinstance(msgs[1], Submit)


def test_deeply_nested_message_is_refused_not_crashed() -> None:
    """A payload nested past the decoder's depth is an invalid_message, never a RecursionError."""
    codec = Codec("msgpack", FromWorker, "worker")
    deep = b"\x84\xa4type\xa5event\xa7plan_id\xa1p\xa4kind\xa1k\xa4data" + b"\x91" * 200_000 + b"\xc0"
    [failure] = codec.decode(deep)
    assert isinstance(failure, DecodeFailure) and "nested too deeply" in failure.message


def test_encode_safe_sends_msgpack_only_keys_to_json_peers() -> None:
    """Map keys JSON cannot hold (nil, bool, array) are sent as their JSON text instead of failing the frame."""
    worker = Codec("msgpack", FromWorker, "worker")
    raw = b"\x84\xa4type\xa5event\xa7plan_id\xa1p\xa4kind\xa1k\xa4data\x82\xc0\x01\x92\x01\x02\x03"
    [event] = worker.decode(raw)
    out = Codec("json", ToClient, "client")
    with pytest.raises(TypeError):
        out.encode([event])
    assert msgspec.json.decode(out.encode_safe([event]))["data"] == {"null": 1, "[1,2]": 3}


def test_token_hash_command_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetwire token hash` prints the token-file hash of the token on stdin, and refuses an empty one."""
    import argparse
    import asyncio
    import io

    from fleetwire.cli.security import _token_hash

    monkeypatch.setattr("sys.stdin", io.StringIO("alice-token\n"))
    assert asyncio.run(_token_hash(argparse.Namespace())) == 0
    assert capsys.readouterr().out.strip() == hash_token("alice-token")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert asyncio.run(_token_hash(argparse.Namespace())) == 2
