"""The bytes a worker's numbered messages leave off the no-op path, pinned: re-sends after a reconnect, stale and
foreign leases, an attempt of 0, a reserved event kind and messages before ``hello`` (issue #29's cut of the worker
message path, coordinator/worker_sessions/dispatch.py and recovery.py, must not move what anyone sees)."""

from __future__ import annotations

import hashlib
import itertools
from typing import Any

import msgspec

from coordinator import Coordinator, CoreConfig
from protocol.messages import Accept, Assign, Capabilities, Done, Event, Hello, Reject, RunningPlan, Submit, Welcome

W1, W2, CLIENT, W1_AGAIN, STRANGER = 1, 2, 3, 4, 5
_encode = msgspec.msgpack.Encoder().encode


def _steps() -> list[Any]:
    """Each step's effects as plain data (frames per connection encoded, records encoded, closes), and the
    core's counters at the end."""
    ids = (f"p{i}" for i in itertools.count(1))
    core = Coordinator(CoreConfig(), new_id=lambda: next(ids))
    out: list[Any] = []

    secrets: list[str] = []

    def take() -> list[Assign]:
        effects = core.take_effects()
        secrets.extend(m.session_secret for msgs in effects.sends.values() for m in msgs if type(m) is Welcome)
        sends = sorted((conn, [_encode(m).hex() for m in msgs]) for conn, msgs in effects.sends.items())
        out.append((sends, [_encode(r).hex() for r in effects.records], effects.closes))
        return [m for msgs in effects.sends.values() for m in msgs if type(m) is Assign]

    caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=2)
    core.open_session(W1, "worker", 0.0, address="127.0.0.1:4001")
    core.receive(W1, Hello(worker_id="w1", capabilities=caps), 0.0)
    core.open_session(CLIENT, "client", 0.0, principal="alice")
    core.open_session(STRANGER, "worker", 0.0, address="127.0.0.1:4009")
    take()
    # Before hello: each of a plan's three messages (and a reject) is answered not_registered.
    core.receive(STRANGER, Accept(plan_id="p1", attempt=1, seq=1), 0.5)
    core.receive(STRANGER, Event(plan_id="p1", attempt=1, kind="echo", data=1, seq=2), 0.5)
    core.receive(STRANGER, Done(plan_id="p1", attempt=1, outcome="succeeded", result=1, seq=3), 0.5)
    take()
    for i in range(3):
        core.receive(CLIENT, Submit(req_id=i + 1, op="echo", args=i, subscribe=True), 1.0)
    assigns = take()  # two placed on w1 (its room), one queued
    a, b = assigns[0], assigns[1]
    core.receive(W1, Accept(plan_id=a.plan_id, attempt=a.attempt, seq=1), 2.0)
    core.receive(W1, Event(plan_id=a.plan_id, attempt=a.attempt, kind="echo", data=1, seq=2), 2.0)
    take()
    # A reconnect: the same worker's new session re-sends both (acked, dropped), then goes on.
    core.close_session(W1, 2.5)
    core.open_session(W1_AGAIN, "worker", 2.5, address="127.0.0.1:4001")
    core.receive(
        W1_AGAIN,
        Hello(
            worker_id="w1",
            capabilities=caps,
            session_secret=secrets[0],
            running=[RunningPlan(a.plan_id, a.attempt), RunningPlan(b.plan_id, b.attempt)],
        ),
        2.5,
    )
    take()
    core.receive(W1_AGAIN, Accept(plan_id=a.plan_id, attempt=a.attempt, seq=1), 3.0)
    core.receive(W1_AGAIN, Event(plan_id=a.plan_id, attempt=a.attempt, kind="echo", data=1, seq=2), 3.0)
    core.receive(W1_AGAIN, Accept(plan_id=a.plan_id, attempt=a.attempt, seq=2), 3.0)  # a repeated accept, new seq
    take()
    # Stale leases: a wrong attempt, an unknown plan, an attempt of 0, a reserved kind; each numbered.
    core.receive(W1_AGAIN, Accept(plan_id=b.plan_id, attempt=b.attempt + 1, seq=3), 4.0)
    core.receive(W1_AGAIN, Event(plan_id="nope", attempt=1, kind="echo", data=0, seq=4), 4.0)
    core.receive(W1_AGAIN, Event(plan_id=a.plan_id, kind="echo", data=0, seq=5), 4.0)
    core.receive(W1_AGAIN, Event(plan_id=a.plan_id, attempt=a.attempt, kind="running", data=0, seq=6), 4.0)
    core.receive(W1_AGAIN, Done(plan_id="nope", attempt=1, outcome="succeeded", result=0, seq=7), 4.0)
    take()
    core.receive(W1_AGAIN, Done(plan_id=a.plan_id, attempt=a.attempt, outcome="succeeded", result=1, seq=8), 5.0)
    core.receive(W1_AGAIN, Done(plan_id=a.plan_id, attempt=a.attempt, outcome="succeeded", result=1, seq=8), 5.0)
    core.receive(W1_AGAIN, Reject(plan_id=b.plan_id, attempt=b.attempt, code="busy", seq=9), 5.0)
    take()
    # Another worker names w1's lease: 4403, its session closed.
    core.open_session(W2, "worker", 6.0, address="127.0.0.1:4002")
    core.receive(W2, Hello(worker_id="w2", capabilities=caps), 6.0)
    take()
    held = next(p for p in core.state.plans.values() if p.worker_id == "w1" and not p.terminal)
    core.receive(W2, Done(plan_id=held.id, attempt=held.attempt, outcome="succeeded", result=0, seq=1), 7.0)
    take()
    out.append(sorted((k, v) for k, v in core.counters.items() if v))
    return out


PINNED = "b84333bb1f1ca223d05012d6ba188361e4354bc23029db229a5cfdf16892715f"


def test_the_worker_message_paths_bytes_are_pinned() -> None:
    """Re-sends, stale and foreign leases and unregistered sessions leave the bytes pinned here."""
    steps = _steps()
    digest = hashlib.sha256(repr(steps).encode()).hexdigest()
    assert digest == PINNED, (digest, steps)
