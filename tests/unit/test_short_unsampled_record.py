"""The assign's one-character "no" follows the worker's latest hello: the registry copies
``capabilities.short_unsampled`` onto the worker's record (coordinator/workers.py), which the scheduler tests a plan."""

from __future__ import annotations

from protocol.messages import Assign, Capabilities, Hello
from tests.unit.test_core import Harness


def _caps(short: bool) -> Capabilities:
    return Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=4, short_unsampled=short)


def test_a_worker_that_reconnects_with_another_hello_gets_the_form_its_new_hello_says() -> None:
    """A worker registered with short_unsampled gets "0"; back under the same id from an older binary (no
    short_unsampled; within its grace, presenting its session secret) it gets "00", and "0" again once a newer one
    says it reads it."""
    h = Harness()
    c = h.client()
    forms = []
    for conn, short in ((100, True), (101, False), (102, True)):
        h.submit(c, traceparent="00")
        h.core.open_session(conn, "worker", h.now, address="10.0.0.100:4000")
        h.send(conn, Hello(worker_id="w", capabilities=_caps(short), session_secret=h.secrets.get("w", "")))
        assert h.core.state.registry.get("w").short_unsampled is short
        forms.append([a.traceparent for a in h.take(conn) if isinstance(a, Assign)])
        h.core.close_session(conn, h.now)
    assert forms[0] == ["0"]
    assert forms[1][-1] == "00" and forms[2][-1] == "0"
