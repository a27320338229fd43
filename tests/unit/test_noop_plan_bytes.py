"""The bytes a no-op plan's steps leave, pinned: every frame the core sends, every record it journals and the usage
rows, encoded, for plans submitted, accepted, given events and finished (the per-plan path of issue #29: a cut of
its cost must not move what a client, a worker or the store sees)."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import msgspec

from coordinator import Coordinator, CoreConfig
from protocol.messages import Accept, Assign, Capabilities, Done, Event, Hello, Submit, Subscribe

WORKER, CLIENT, WATCHER = 1, 2, 3
_encode = msgspec.msgpack.Encoder().encode


def _steps() -> list[Any]:
    """Each step's effects as plain data: (frames per connection, records), every message and record encoded."""
    ids = (f"p{i}" for i in itertools.count(1))
    core = Coordinator(CoreConfig(), new_id=lambda: next(ids))
    out: list[Any] = []

    def take() -> list[Assign]:
        effects = core.take_effects()
        sends = sorted((conn, [_encode(m).hex() for m in msgs]) for conn, msgs in effects.sends.items())
        out.append((sends, [_encode(r).hex() for r in effects.records], effects.closes))
        return [m for msgs in effects.sends.values() for m in msgs if type(m) is Assign]

    core.open_session(WORKER, "worker", 0.0, address="127.0.0.1:4001")
    caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=10)
    core.receive(WORKER, Hello(worker_id="w1", capabilities=caps), 0.0)
    core.open_session(CLIENT, "client", 0.0, principal="alice")
    core.open_session(WATCHER, "client", 0.0, principal="admin", admin=True)
    take()
    core.receive(CLIENT, Submit(req_id=1, op="echo", args=1, subscribe=True), 1.0)
    core.receive(CLIENT, Submit(req_id=2, op="echo", args="two", subscribe=True, plan_id="mine"), 1.0)
    core.receive(CLIENT, Submit(req_id=3, op="echo", args=[3], subscribe=False), 1.0)
    assigns = take()
    core.receive(WATCHER, Subscribe(plan_ids=["p1"]), 1.5)  # an admin follows p1 too: two followers
    take()
    seq = 0
    for n, a in enumerate(assigns):
        core.receive(WORKER, Accept(plan_id=a.plan_id, attempt=a.attempt, seq=seq + 1), 2.0)
        core.receive(WORKER, Event(plan_id=a.plan_id, attempt=a.attempt, kind="echo", data=a.args, seq=seq + 2,
                                   ephemeral=n == 1), 2.0)  # fmt: skip
        core.receive(WORKER, Done(plan_id=a.plan_id, attempt=a.attempt, outcome="succeeded", result=a.args,
                                  seq=seq + 3), 2.0)  # fmt: skip
        seq += 3
        if n == 0:
            take()  # the first plan's end in its own step, the others' together
    take()
    core.tick(70.0)  # the usage ledger's rows go out once a tick
    take()
    return out


PINNED = "7a8fdf45155ebef8338a01bf36be9074092c7148c030ec20029c8dcc481acf4e"


def test_a_no_op_plans_bytes_are_pinned() -> None:
    """The frames, records and usage rows of three no-op plans (one named, one unsubscribed, one followed by an
    admin too) are byte for byte those pinned here."""
    steps = _steps()
    digest = hashlib.sha256(repr(steps).encode()).hexdigest()
    assert digest == PINNED, (digest, steps)
