"""What a worker adds to its ``hello`` and ``heartbeat`` beyond plan counts: energy, carbon and
the load of the inference engine it fronts, and the background tasks that keep them fresh.

The agent calls, and nothing else (worker_agent/agent.py):

* :meth:`Telemetry.start` / :meth:`~Telemetry.stop` around its whole run;
* :meth:`~Telemetry.capabilities` on every ``hello`` (carbon zone, served models);
* :meth:`~Telemetry.load` on every ``heartbeat`` (µJ/token, power, zone intensity, engine load);
* :meth:`~Telemetry.plan_started` / :meth:`~Telemetry.plan_finished` around each plan run (the latter
  returns the plan's energy and carbon receipt, or None when nothing was measured: worker_agent/receipts.py).

Every one of these returns at once from cached values: NVML is read in the power sampler's
thread, the carbon command and the engine's metrics in their own tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Sequence

import msgspec
import structlog

import protocol
from worker_agent.argtypes import non_negative_float, positive_float
from worker_agent.carbon import CarbonIntensity
from worker_agent.energy import EnergyMeter, Nvml, PowerSampler
from worker_agent.inference import InferenceEngine
from worker_agent.receipts import ReceiptMeter

log = structlog.get_logger(__name__)

__all__ = ["Telemetry", "add_telemetry_arguments", "telemetry_from_args"]


class Telemetry:
    """Energy, carbon and engine figures of one worker.

    Args:
        meter: energy per token (a configured value when nothing measures it).
        sampler: NVML power sampler feeding ``meter``; None without NVML.
        nvml: the open NVML library, closed by :meth:`stop`.
        carbon: the zone's grid intensity; None: unknown.
        engine: the inference engine this worker fronts, if any.
        models: model names to advertise besides the engine's own.
        power_w: the worker's power model (``--power-watts``) for estimated receipts; 0: none.
    """

    def __init__(
        self,
        *,
        meter: EnergyMeter | None = None,
        sampler: PowerSampler | None = None,
        nvml: Nvml | None = None,
        carbon: CarbonIntensity | None = None,
        engine: InferenceEngine | None = None,
        models: Sequence[str] = (),
        power_w: float = 0.0,
    ) -> None:
        self.meter = meter or EnergyMeter()
        self.sampler = sampler
        self.carbon = carbon
        self.engine = engine
        self.models = list(models)
        self._nvml = nvml
        self._tasks: list[asyncio.Task[None]] = []
        counters = (lambda: sampler.energy_mj) if sampler is not None else None
        self.receipts = ReceiptMeter(  # each plan's receipt (worker_agent/receipts.py)
            clock=time.monotonic, power_w=power_w, uj_per_token=self.meter.configured_uj_per_token,
            counters_mj=counters, intensity=self._intensity,
        )
        self.timed = self.receipts.timed or self.meter.measured
        """Whether plans' starts are noted (see plan_started): False without NVML or a power model, and then a plan
        without tokens or devices needs neither call (worker_agent/runner.py asks before making their key)."""

    def _intensity(self) -> float:
        return self.carbon.g_per_kwh if self.carbon is not None else 0.0

    async def start(self) -> None:
        """Start sampling and refreshing; learn the engine's models and load. An engine that does not
        answer only warns, after at most two 5 s request timeouts (a refused connection: at once)."""
        if self.sampler is not None:
            self.sampler.start()
        if self.engine is not None:
            await self.engine.discover_models()
            if self.engine.metrics_url is not None:
                await self.engine.scrape_metrics()  # so the first heartbeat already carries the engine's load
                self._tasks.append(asyncio.create_task(self.engine.poll_metrics_forever(), name="engine-metrics"))
        if self.carbon is not None and self.carbon.command is not None:
            self._tasks.append(asyncio.create_task(self.carbon.refresh_forever(), name="carbon-command"))

    async def stop(self) -> None:
        """Stop every background task, the sampler thread and NVML; close engine connections."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.sampler is not None:
            await asyncio.to_thread(self.sampler.stop)
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None
        if self.engine is not None:
            await self.engine.aclose()

    def capabilities(self, caps: protocol.Capabilities) -> protocol.Capabilities:
        """``caps`` with the carbon zone, the served models and engine traits filled in."""
        changes: dict[str, object] = {}
        if self.carbon is not None and self.carbon.zone:
            changes["carbon_zone"] = self.carbon.zone
        models = [*self.models, *(self.engine.models if self.engine is not None else ())]
        if models:
            changes["models"] = list(dict.fromkeys([*caps.models, *models]))
        if self.engine is not None:
            figures = self.engine.figures()
            if not caps.kv_blocks and figures.kv_blocks_total and figures.kv_block_tokens:
                # No --kv-blocks: KV admission uses the engine's own block budget.
                changes.update(kv_blocks=figures.kv_blocks_total, kv_block_tokens=figures.kv_block_tokens)
        return msgspec.structs.replace(caps, **changes) if changes else caps

    def load(self, load: protocol.Load) -> protocol.Load:
        """``load`` with energy, power, carbon and engine figures filled in."""
        changes: dict[str, object] = {}
        if self.meter.uj_per_token:
            changes["uj_per_token"] = round(self.meter.uj_per_token, 3)
        if self.meter.power_w:
            changes["power_w"] = round(self.meter.power_w, 3)
        if self.carbon is not None and self.carbon.g_per_kwh:
            changes["zone_intensity_g_per_kwh"] = self.carbon.g_per_kwh
        if self.engine is not None:
            engine = self.engine.load
            changes.update(
                engine_running=engine.running, engine_waiting=engine.waiting, kv_cache_usage=engine.kv_cache_usage
            )
            figures = self.engine.figures()  # queued tokens, KV blocks, latency (worker_agent/inference.py)
            changes.update(
                queued_tokens=max(load.queued_tokens, figures.queued_tokens),
                kv_blocks_used=figures.kv_blocks_used or load.kv_blocks_used,
                latency_p50_ms=figures.latency_p50_ms or load.latency_p50_ms,
                latency_p99_ms=figures.latency_p99_ms or load.latency_p99_ms,
            )
        return msgspec.structs.replace(load, **changes) if changes else load

    def plan_started(self, plan_id: str, physical: Sequence[int] = ()) -> None:
        """A plan began running on this worker; ``physical``: NVML indices of the whole GPUs it holds alone."""
        if self.timed:  # without NVML or a power model nothing is noted per plan (worker_agent/receipts.py)
            self.meter.plan_started(plan_id)
            self.receipts.started(plan_id, physical)

    def plan_finished(
        self, plan_id: str, tokens: int, physical: Sequence[int] = (), devices: Sequence[str] = (), run_s: float = 0.0
    ) -> protocol.Receipt | None:
        """A plan that ran ``run_s`` seconds ended having reported ``tokens`` generated tokens: its receipt.

        None when it would say nothing: no NVML, no power model, no tokens and no devices (docs/PROTOCOL.md
        §Receipt: the worker then sends none).
        """
        if not self.timed and not tokens and not devices:
            return None
        used = self.meter.plan_finished(plan_id, tokens)
        if used is not None and used.tokens:
            log.debug("plan energy", plan_id=plan_id, joules=round(used.joules, 3), tokens=used.tokens,
                      uj_per_token=round(used.uj_per_token, 1))
        return self.receipts.finished(
            plan_id, tokens=tokens, physical=physical, devices=devices,
            power_joules=used.joules if used is not None else None, run_s=run_s,
        )


# --------------------------------------------------------------------------- command line


def add_telemetry_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the energy, carbon and inference flags of ``fleetwire worker``.

    ``--carbon-zone`` and ``--model`` are the worker's own flags (worker_agent/main.py): the zone
    is read from there (or ``$FLEETWIRE_CARBON_ZONE``).
    """
    group = parser.add_argument_group("energy and carbon")
    group.add_argument("--carbon-file", metavar="PATH",
                       help="zone intensities (gCO2e/kWh) overriding the built-in table: JSON or 'ZONE grams' lines")
    group.add_argument("--carbon-command", metavar="CMD",
                       help="shell command printing this zone's intensity (or a JSON table), run periodically")
    group.add_argument("--carbon-interval", type=positive_float, default=300.0, metavar="S",
                       help="seconds between runs of --carbon-command (default 300)")
    group.add_argument("--uj-per-token", type=non_negative_float, default=0.0, metavar="UJ",
                       help="energy per generated token to report when NVML cannot measure it (default 0: unknown)")
    group.add_argument("--power-watts", type=non_negative_float, default=0.0, metavar="W",
                       help="this host's power draw, for estimated plan receipts where NVML cannot measure "
                            "(split over the plans running; default 0: unknown)")
    group.add_argument("--power-sample-interval", type=positive_float, default=0.5, metavar="S",
                       help="seconds between NVML power readings (default 0.5)")
    group = parser.add_argument_group("inference engine")
    group.add_argument("--inference-url", metavar="URL",
                       help="OpenAI-compatible server to front with op 'generate', e.g. http://127.0.0.1:8000")
    group.add_argument("--inference-model", metavar="NAME",
                       help="model to request when a plan names none (default: the server's first model)")
    group.add_argument("--inference-api-key", metavar="KEY",
                       help="bearer key for the server (default $FLEETWIRE_INFERENCE_API_KEY)")
    group.add_argument("--engine-metrics-url", metavar="URL",
                       help="the engine's Prometheus endpoint (default <inference-url>/metrics; 'none' to skip)")
    group.add_argument("--engine-metrics-interval", type=positive_float, default=2.0, metavar="S",
                       help="seconds between engine metrics scrapes (default 2)")


def telemetry_from_args(ns: argparse.Namespace) -> Telemetry:
    """A :class:`Telemetry` from parsed ``fleetwire worker`` flags; opens NVML when present.

    Raises:
        ValueError: a flag value that cannot work (unreadable carbon file, bad URL).
    """
    carbon = None
    zone = getattr(ns, "carbon_zone", "") or os.environ.get("FLEETWIRE_CARBON_ZONE", "")
    if zone or ns.carbon_file or ns.carbon_command:
        carbon = CarbonIntensity(zone, file=ns.carbon_file, command=ns.carbon_command, interval_s=ns.carbon_interval)
    engine = None
    if ns.inference_url:
        metrics_url = "" if ns.engine_metrics_url is None else ns.engine_metrics_url
        engine = InferenceEngine(
            ns.inference_url,
            model=ns.inference_model,
            api_key=ns.inference_api_key or os.environ.get("FLEETWIRE_INFERENCE_API_KEY"),
            metrics_url=None if metrics_url == "none" else metrics_url,
            metrics_interval_s=ns.engine_metrics_interval,
        )
    nvml = Nvml.open()
    meter = EnergyMeter(configured_uj_per_token=ns.uj_per_token, measured=nvml is not None)
    sampler = (
        PowerSampler(nvml.power_w, meter, ns.power_sample_interval, read_energy_mj=nvml.energy_mj)
        if nvml is not None else None
    )
    return Telemetry(
        meter=meter, sampler=sampler, nvml=nvml, carbon=carbon, engine=engine, power_w=getattr(ns, "power_watts", 0.0)
    )
