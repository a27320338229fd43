"""Energy and carbon receipts: the worker's pure computation (fake clock, fake NVML counter), and the
core carrying the projection and the receipt to the terminal event, the store and the metrics."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from coordinator.io.ops.metrics import CoordinatorCollector
from coordinator.io.stores.store import MemoryStore
from coordinator.receipts import Footprint, settle
from coordinator.records import PlanStatus
from fleetwire.cli.console import duration_s, footprint, receipt_line
from protocol.messages import (
    Accept,
    Assign,
    Cancel,
    Done,
    ErrorInfo,
    GetPlan,
    Heartbeat,
    Load,
    PlanInfo,
    PlanReply,
    Receipt,
    RoutingHints,
)
from tests.unit.test_core import Harness, only
from tests.unit.test_durability_core import Durable
from worker_agent.energy import EnergyMeter
from worker_agent.receipts import J_PER_KWH, ReceiptMeter, co2e_g
from worker_agent.telemetry import Telemetry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- worker side (pure)


def test_power_model_splits_each_interval_among_the_plans_running_then() -> None:
    """Without NVML, a plan's joules are --power-watts x its share of each interval, estimated."""
    clock = Clock()
    meter = ReceiptMeter(clock=clock, power_w=100.0, intensity=lambda: 400.0)
    meter.started("a")
    clock.now += 10  # a alone: 1000 J to a
    meter.started("b")
    clock.now += 10  # a and b: 500 J each
    a = meter.finished("a", tokens=7)
    clock.now += 5  # b alone: 500 J
    b = meter.finished("b")
    assert (a.joules, a.source, a.estimated, a.tokens, a.run_s) == (1500.0, "power_model", True, 7, 20.0)
    assert (b.joules, b.run_s) == (1000.0, 15.0)
    assert a.co2e_g == pytest.approx(1500 / J_PER_KWH * 400)
    assert a.intensity_g_per_kwh == 400.0


def test_nvml_counter_delta_over_the_plans_gpus_is_measured() -> None:
    """With NVML, a plan holding GPUs 0 and 2 gets the delta of their energy counters (mJ), not estimated."""
    clock = Clock()
    counters: list[float | None] = [1_000.0, 50_000.0, 2_000.0]
    meter = ReceiptMeter(clock=clock, power_w=300.0, counters_mj=lambda: counters)
    meter.started("p", physical=[0, 2])
    counters[:] = [6_000.0, 90_000.0, 4_500.0]  # GPU 1 (not the plan's) moved too
    clock.now += 3
    r = meter.finished("p", physical=[0, 2], devices=["0", "2"], power_joules=999.0)
    assert (r.joules, r.source, r.estimated, r.devices) == (7.5, "nvml_counter", False, ["0", "2"])
    assert r.co2e_g == 0.0 and r.intensity_g_per_kwh == 0.0  # unknown zone: no grams, never a guess


def test_without_a_counter_the_sampled_power_share_is_used_on_an_nvml_host() -> None:
    """On an NVML host, a plan without GPUs of its own (or a GPU without a counter) gets its power share."""
    clock = Clock()
    meter = ReceiptMeter(clock=clock, counters_mj=lambda: [None])
    meter.started("p", physical=[0])
    r = meter.finished("p", physical=[0], power_joules=42.0)
    assert (r.joules, r.source, r.estimated) == (42.0, "nvml_power", False)


def test_configured_uj_per_token_then_nothing() -> None:
    """Without NVML or a power model: µJ/token x tokens (estimated); without that either: 0 J, source none."""
    clock = Clock()
    meter = ReceiptMeter(clock=clock, uj_per_token=2_000.0)
    meter.started("p")
    assert (meter.finished("p", tokens=500).joules, meter.finished("q").source) == (1.0, "none")
    bare = ReceiptMeter(clock=clock)
    bare.started("p")
    r = bare.finished("p", tokens=10)
    assert (r.joules, r.source, r.estimated) == (0.0, "none", True)


def test_a_worker_that_measures_nothing_sends_no_receipt_and_notes_no_start() -> None:
    """No NVML, power model or tokens: Telemetry gives no receipt and keeps nothing per plan; tokens still get one."""
    bare = Telemetry()
    assert not bare.receipts.timed
    bare.plan_started("p")
    assert bare.receipts.running == 0  # nothing noted on a plain CPU worker's plan path
    assert bare.plan_finished("p", 0, run_s=0.5) is None
    counted = bare.plan_finished("q", 7, run_s=0.5)
    assert counted is not None and (counted.source, counted.tokens, counted.run_s) == ("none", 7, 0.5)
    priced = Telemetry(meter=EnergyMeter(configured_uj_per_token=2_000.0)).plan_finished("r", 500, run_s=1.0)
    assert priced is not None and (priced.joules, priced.source) == (1.0, "uj_per_token")
    timed = Telemetry(power_w=10.0)
    assert timed.receipts.timed
    timed.plan_started("s")
    assert timed.receipts.running == 1
    receipt = timed.plan_finished("s", 0)
    assert receipt is not None and receipt.source == "power_model"


def test_bad_power_model_is_refused_and_bad_intensity_is_unknown() -> None:
    """A negative or infinite --power-watts is refused naming it; a NaN intensity counts as unknown."""
    with pytest.raises(ValueError, match="power model"):
        ReceiptMeter(clock=Clock(), power_w=-1)
    with pytest.raises(ValueError, match="power model"):
        ReceiptMeter(clock=Clock(), power_w=math.inf)
    assert co2e_g(100.0, math.nan) == 0.0


# ---------------------------------------------------------------- coordinator side (pure core)


def _beat(h: Harness, w: int, **load: Any) -> None:
    h.send(w, Heartbeat(load=Load(**load)))


def test_projection_at_assign_and_receipt_reach_the_terminal_event_record_and_metrics() -> None:
    """The core projects µJ/token x hinted tokens at assign, puts the worker's receipt with it in the
    succeeded event and the plan's record, and sums it by principal and op for /metrics."""
    h = Harness()
    w = h.worker("w1")
    _beat(h, w, uj_per_token=2_000.0, zone_intensity_g_per_kwh=360.0)
    c = h.client("team-a")
    pid = h.submit(c, hints=RoutingHints(prompt_tokens=1_000, max_output_tokens=4_000))
    assign = only(h.take(w), Assign)
    h.send(w, Accept(plan_id=pid, attempt=assign.attempt, seq=1))
    sent = Receipt(joules=12.3, co2e_g=0.41, estimated=True, source="power_model", tokens=3_900)
    h.send(w, Done(plan_id=pid, attempt=assign.attempt, outcome="succeeded", result=1, seq=2, receipt=sent))
    ended = [e for e in h.events(c, pid) if e.kind == "succeeded"]
    assert ended, "the client follows its plan"
    receipt = ended[0].data["receipt"]
    assert (receipt.joules, receipt.estimated, receipt.projected_joules) == (12.3, True, 8.0)  # 2000 µJ x 4000 out
    assert receipt.projected_co2e_g == pytest.approx(8.0 / J_PER_KWH * 360.0)
    h.send(c, GetPlan(req_id=99, plan_id=pid))
    info = only(h.take(c), PlanReply).plan
    assert info.receipt == receipt
    assert h.core.footprint.joules == {("team-a", "echo"): 12.3}
    families = {m.name: m for m in CoordinatorCollector(h.core, clock=lambda: h.now).collect()}
    samples = {(s.name, s.labels["principal"], s.labels["op"]): s.value
               for name in ("fleetwire_plan_energy_joules", "fleetwire_plan_co2e_grams")
               for s in families[name].samples}  # fmt: skip
    assert samples == {("fleetwire_plan_energy_joules_total", "team-a", "echo"): 12.3,
                       ("fleetwire_plan_co2e_grams_total", "team-a", "echo"): 0.41}  # fmt: skip


def test_failed_plan_carries_the_receipt_and_no_hint_means_no_projection() -> None:
    """A failed plan's terminal event carries the receipt; without token hints the projection is 0."""
    h = Harness()
    w = h.worker("w1")
    _beat(h, w, uj_per_token=2_000.0)
    c = h.client()
    pid = h.submit(c)
    assign = only(h.take(w), Assign)
    h.send(w, Accept(plan_id=pid, attempt=assign.attempt, seq=1))
    error = ErrorInfo(code="handler_error", message="boom")
    h.send(w, Done(plan_id=pid, attempt=assign.attempt, outcome="failed", error=error, seq=2,
                   receipt=Receipt(joules=5.0, source="nvml_counter")))  # fmt: skip
    failed = next(e for e in h.events(c, pid) if e.kind == "failed")
    assert failed.data["receipt"].joules == 5.0 and failed.data["receipt"].projected_joules == 0.0


def test_without_a_workers_receipt_the_projection_alone_is_kept_and_no_projection_means_none() -> None:
    """A done without a receipt (the worker measured nothing): a projected plan gets a receipt carrying the
    projection (source none); an unprojected one gets none, in its terminal event and its record."""
    h = Harness()
    w = h.worker("w1")
    _beat(h, w, uj_per_token=2_000.0)
    c = h.client()
    projected = h.submit(c, hints=RoutingHints(prompt_tokens=1_000, max_output_tokens=4_000))
    plain = h.submit(c)
    for _ in (projected, plain):  # one at a time (the worker runs one plan)
        assign = only(h.take(w), Assign)
        h.send(w, Accept(plan_id=assign.plan_id, attempt=assign.attempt))
        h.send(w, Done(plan_id=assign.plan_id, attempt=assign.attempt, outcome="succeeded", result=1))
    ended = {e.plan_id: e.data for e in h.events(c) if e.kind == "succeeded"}
    receipt = ended[projected]["receipt"]
    assert (receipt.source, receipt.joules, receipt.projected_joules) == ("none", 0.0, 8.0)
    assert "receipt" not in ended[plain]
    assert h.core.plans[plain].receipt is None and h.core.plans[projected].receipt == receipt


def test_a_cancelled_plans_late_receipt_is_stored_with_it() -> None:
    """Cancelled while running: the worker's done brings the receipt, which the plan's status record keeps."""
    h = Durable()
    w = h.worker("w1")
    c = h.client()
    pid = h.submit(c)
    assign = only(h.take(w), Assign)
    h.send(w, Accept(plan_id=pid, attempt=assign.attempt, seq=1))
    h.send(c, Cancel(req_id=50, plan_id=pid))
    h.send(w, Done(plan_id=pid, attempt=assign.attempt, outcome="cancelled", seq=2,
                   receipt=Receipt(joules=2.0, source="power_model", estimated=True)))  # fmt: skip
    h.restart(1.0)
    assert h.core.plans[pid].state == "cancelled"
    assert h.core.plans[pid].receipt == Receipt(joules=2.0, source="power_model", estimated=True)


def test_a_workers_bad_figures_are_zeroed_and_text_cut() -> None:
    """A receipt from a peer is checked: NaN, negative and infinite figures become 0, long text is cut."""
    bad = Receipt(joules=math.nan, co2e_g=-1.0, run_s=math.inf, tokens=-5, source="x" * 1000, devices=["d" * 500] * 100)
    kept = settle(bad, (1.5, 0.25))
    assert kept is not None
    assert (kept.joules, kept.co2e_g, kept.run_s, kept.tokens) == (0.0, 0.0, 0.0, 0)
    assert len(kept.source) == 64 and len(kept.devices) == 64 and all(len(d) == 64 for d in kept.devices)
    assert (kept.projected_joules, kept.projected_co2e_g) == (1.5, 0.25)
    assert settle(None, (1.0, 1.0)) is None


def test_footprint_pairs_are_bounded() -> None:
    """Past max_pairs distinct (principal, op) pairs, new ones are summed under _other."""
    fp = Footprint(max_pairs=2)
    for op in ("a", "b", "c", "d"):
        fp.add("p", op, Receipt(joules=1.0))
    assert fp.joules == {("p", "a"): 1.0, ("p", "b"): 1.0, ("_other", "_other"): 2.0}


def test_status_records_without_a_receipt_encode_as_before() -> None:
    """A plan without a receipt writes a status with no receipt key (old stores and checksums stay as they
    were), and such a status loads with receipt None."""
    h = Durable(store=MemoryStore())
    c = h.client()
    pid = h.submit(c)
    statuses = [r for r in h.records if isinstance(r, PlanStatus)]
    assert statuses and all(b"receipt" not in msgspec.msgpack.encode(s) for s in statuses)
    h.restart(1.0)
    assert h.core.plans[pid].receipt is None


# ---------------------------------------------------------------- CLI text


def test_receipt_line_and_footprint_rows() -> None:
    """The --follow line reads like the issue's, and --by sums receipts per principal."""
    r = Receipt(joules=12.34, co2e_g=0.41, estimated=True, intensity_g_per_kwh=300.0, projected_joules=11.0,
                source="power_model")  # fmt: skip
    assert receipt_line(r) == "energy 12.3 J (estimated), 0.41 gCO2e; projected 11.0 J"
    assert receipt_line(Receipt(joules=1.0, source="nvml_counter")) == "energy 1.0 J, gCO2e unknown (no zone intensity)"
    assert receipt_line(Receipt(source="none")).startswith("energy unknown")
    plans = [PlanInfo(id="1", op="x", state="succeeded", owner="a", receipt=Receipt(joules=2.0, co2e_g=0.5)),
             PlanInfo(id="2", op="x", state="failed", owner="a", receipt=Receipt(joules=1.0, estimated=True)),
             PlanInfo(id="3", op="y", state="succeeded", owner="b")]  # fmt: skip
    rows = footprint(plans, "principal")
    assert [(r["principal"], r["plans"], r["joules"], r["co2e_g"], r["estimated"], r["no_receipt"]) for r in rows] == [
        ("a", 2, 3.0, 0.5, 1, 0), ("b", 1, 0.0, 0.0, 0, 1)]
    assert (duration_s("24h"), duration_s("30m"), duration_s("90")) == (86400.0, 1800.0, 90.0)
    with pytest.raises(Exception, match="24h"):
        duration_s("soon")
