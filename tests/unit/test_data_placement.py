"""Placement prefers a worker with a data endpoint for a plan with inputs or outputs, when otherwise tied."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from protocol.messages import Assign, Capabilities, Hello, InputSpec, RoutingHints
from tests.unit.test_core import Harness

DIGEST = "sha256:" + "0" * 64
INPUTS = [InputSpec(name="x", size=10, digest=DIGEST)]
_CONNS = itertools.count(1000)  # connection ids of these workers (the harness numbers its own from 1)
POLICIES = ["least_busy", "joule_weighted", "carbon_weighted", "latency_weighted", "kv_aware"]


def worker(h: Harness, worker_id: str, data_url: str = "", max_concurrency: int = 2) -> int:
    """A worker like every other; ``data_url``: its data endpoint (none by default)."""
    conn = next(_CONNS)
    h.core.open_session(conn, "worker", h.now, address=f"10.0.0.{conn}:4000")
    caps = Capabilities(cpu_cores=4, ram_bytes=8_000_000_000, ops=["echo"], max_concurrency=max_concurrency)
    h.send(conn, Hello(worker_id=worker_id, capabilities=caps, data_url=data_url))
    return conn


def placed_on(h: Harness, conns: dict[str, int], client: int, **submit: Any) -> str:
    """Submit a plan; the id of the worker it was assigned to."""
    plan_id = h.submit(client, **submit)
    for name, conn in conns.items():
        if any(isinstance(m, Assign) and m.plan_id == plan_id for m in h.take(conn)):
            return name
    raise AssertionError(f"plan {plan_id} was not assigned")


@pytest.fixture
def fleet() -> tuple[Harness, dict[str, int], int]:
    """Worker "a" without a data endpoint, "b" with one: "a" wins every plain tie (lower id)."""
    h = Harness()
    conns = {"a": worker(h, "a"), "b": worker(h, "b", data_url="http://10.0.0.2:7000")}
    return h, conns, h.client()


@pytest.mark.parametrize("policy", POLICIES)
def test_plan_with_inputs_goes_to_the_worker_with_a_data_endpoint(
    fleet: tuple[Harness, dict[str, int], int], policy: str
) -> None:
    """Tied otherwise, a plan with inputs goes to "b" (data endpoint), though "a" has the lower id."""
    h, conns, client = fleet
    assert placed_on(h, conns, client, inputs=INPUTS, hints=RoutingHints(policy=policy)) == "b"


def test_plan_with_outputs_only_prefers_it_too(fleet: tuple[Harness, dict[str, int], int]) -> None:
    """Declared outputs alone are enough: their bytes leave the worker by its data endpoint."""
    h, conns, client = fleet
    assert placed_on(h, conns, client, outputs=["out"]) == "b"


def test_plan_without_data_keeps_the_plain_tie_break(fleet: tuple[Harness, dict[str, int], int]) -> None:
    """A plan with neither inputs nor outputs is placed as before: the lower id of two idle workers."""
    h, conns, client = fleet
    assert placed_on(h, conns, client) == "a"


@pytest.mark.parametrize("policy", POLICIES)
def test_a_less_busy_worker_still_wins(fleet: tuple[Harness, dict[str, int], int], policy: str) -> None:
    """The preference only breaks ties: once "b" holds a plan, the next plan with inputs goes to idle "a"."""
    h, conns, client = fleet
    hints = RoutingHints(policy=policy)
    assert placed_on(h, conns, client, inputs=INPUTS, hints=hints) == "b"
    assert placed_on(h, conns, client, inputs=INPUTS, hints=hints) == "a"
