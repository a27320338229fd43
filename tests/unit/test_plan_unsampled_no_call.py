"""A plan submitted with the caller's "no" (``"00"``, or ``"0"``) is made without a sampling test call (issue #32).

At 1 % sampling 99 plans in 100 carry it; ``Plan.from_submit`` tells it apart by comparison and leaves the plan
unsampled, so the interpreted core makes no ``is_sampled`` call for it (one Python call a plan, docs/PERFORMANCE.md
§T32l). A full W3C context is still read for its flag.
"""

from __future__ import annotations

from typing import Any

import pytest

import coordinator.plans as plans_module
from coordinator.plans import Plan
from protocol.messages import Submit
from protocol.tracecontext import is_sampled

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def test_unsampled_forms_make_no_sampling_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counted(text: str) -> Any:
        calls.append(text)
        return is_sampled(text)

    monkeypatch.setattr(plans_module, "is_sampled", counted)
    for form in ("00", "0"):
        plan = Plan.from_submit(Submit(req_id=1, op="echo", traceparent=form), "p1", "alice", 0)
        assert plan.traceparent == "00" and not plan.sampled
    assert calls == []


@pytest.mark.parametrize(("flags", "sampled"), [("01", True), ("00", False), ("03", True)])
def test_a_full_context_is_read_for_its_flag(flags: str, sampled: bool) -> None:
    context = f"00-{TRACE}-00f067aa0ba902b7-{flags}"
    plan = Plan.from_submit(Submit(req_id=1, op="echo", traceparent=context), "p1", "alice", 0)
    assert plan.traceparent == context and plan.sampled is sampled


def test_no_context_is_unsampled() -> None:
    plan = Plan.from_submit(Submit(req_id=1, op="echo"), "p1", "alice", 0)
    assert plan.traceparent == "" and not plan.sampled
