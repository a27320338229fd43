"""What ``submit --follow`` and ``watch`` print for a plan's events and its end (fleetwire/cli/console.py)."""

from __future__ import annotations

import json

import pytest

from fleetwire import Client
from fleetwire.cli.console import finish
from fleetwire.plan import Plan
from fleetwire.stream import PlanStream
from protocol.messages import Event

TICKET = "fw1.k1.eyJwbGFuIjoicDEifQ.c2VjcmV0LW1hYw"
GET_TICKET = "fw1.k1.eyJkaXIiOiJnZXQifQ.b3RoZXItbWFj"


def _plan(*events: Event) -> Plan:
    stream = PlanStream("p1", live=True)
    for event in events:
        stream.feed(event)
    return Plan(stream, Client("ws://127.0.0.1:9"))


def _data_ready(seq: int) -> Event:
    data = {"attempt": 1, "worker_id": "w1", "url": "http://127.0.0.1:8766", "ticket": TICKET,
            "get_ticket": GET_TICKET, "expires_at": 1.9e9, "files": {"data": [4096, "blake3:ab"]}}
    return Event(plan_id="p1", seq=seq, kind="data_ready", data=data)


def _failed(seq: int) -> Event:
    return Event(plan_id="p1", seq=seq, kind="failed",
                 data={"code": "handler_error", "message": "boom", "worker_id": "w1", "attempt": 1})


@pytest.mark.parametrize("as_json", [False, True])
async def test_follow_never_prints_data_ready_tickets(as_json: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """A data_ready event is followed without its signed tickets: summarised in text, redacted in JSON."""
    plan = _plan(Event(plan_id="p1", seq=1, kind="leased", data={"worker_id": "w1", "attempt": 1}), _data_ready(2),
                 Event(plan_id="p1", seq=3, kind="succeeded", data={"result": 1, "worker_id": "w1", "attempt": 1}))
    assert await finish(plan, follow=True, as_json=as_json) == 0
    out = capsys.readouterr().out
    assert TICKET not in out and GET_TICKET not in out and "fw1." not in out
    if as_json:
        ready = next(r for r in map(json.loads, out.splitlines()) if r["kind"] == "data_ready")
        assert ready["data"]["ticket"] == ready["data"]["get_ticket"] == "(redacted)"
        assert ready["data"]["url"] == "http://127.0.0.1:8766"
        assert ready["data"]["files"] == {"data": [4096, "blake3:ab"]}
    else:
        line = next(line for line in out.splitlines() if "data_ready" in line)
        assert line == ("[2] data_ready attempt 1 on w1 via http://127.0.0.1:8766; inputs data (4096 B); "
                        "ticket and get_ticket (redacted)")


@pytest.mark.parametrize("as_json", [False, True])
async def test_failure_says_plan_failed_once(as_json: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed plan's closing line names the plan and its failure once: 'plan p1 failed [code]: message'."""
    plan = _plan(_failed(1))
    assert await finish(plan, follow=False, as_json=as_json) == 1
    captured = capsys.readouterr()
    if as_json:
        record = json.loads(captured.out.splitlines()[-1])
        assert record["error"] == {"code": "handler_error", "message": "boom"}
    else:
        assert captured.err.strip() == "plan p1 failed [handler_error]: boom"
