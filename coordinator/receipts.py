"""Energy and carbon receipts on the coordinator's side: the projection made at assign, the
receipt a worker's ``done`` brings, and the running footprint per principal and op.

Theory of operation (docs/PROTOCOL.md §Receipt, docs/OPERATIONS.md §Energy and carbon):

* At assign, :func:`projection` prices the plan with the figure placement ranks by
  (coordinator/placement/policies.py): the chosen worker's µJ/token * the plan's hinted maximum
  output tokens, and that energy at the worker's zone intensity. A worker's µJ/token is energy
  per *generated* token (worker_agent/energy.py), so the prompt is not counted again and the
  projection is a bound: the plan may stop before its maximum. No output hint or no figure: no
  projection. It is kept on the plan (``Plan.projected``), for this attempt only.
* At the end, :func:`settle` takes the worker's receipt (measured or estimated; a worker is a
  peer: every figure is checked, a bad one becomes 0, text is cut) and adds the projection. A
  plan that ended without a receipt (an older worker, a lease lost) gets none.
* :class:`Footprint` sums the receipts by (principal, op) for ``/metrics``
  (``fleetwire_plan_energy_joules_total``, ``fleetwire_plan_co2e_grams_total``). Past
  :data:`MAX_PAIRS` pairs, new pairs are summed under ``("_other", "_other")`` so a principal
  with a million op names cannot grow the exposition without bound.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from coordinator.placement.policies import projected_g, projected_uj
from coordinator.workers import WorkerRecord
from protocol.messages import Receipt, RoutingHints

__all__ = ["MAX_PAIRS", "OTHER", "Footprint", "projection", "settle"]

MAX_PAIRS: Final = 4096  # (principal, op) pairs the footprint keeps apart
OTHER: Final = "_other"
MAX_TEXT: Final = 64  # a receipt's source and each device name are cut to this many characters
MAX_DEVICES: Final = 64


def projection(hints: RoutingHints, worker: WorkerRecord) -> tuple[float, float] | None:
    """(J, gCO2e) placement projects for a plan with ``hints`` on ``worker``; None when it cannot."""
    tokens = hints.max_output_tokens  # µJ/token is per generated token (module docstring)
    load = worker.load
    if tokens <= 0 or load is None or not 0 < load.uj_per_token < math.inf:
        return None
    uj = projected_uj(load.uj_per_token, tokens)
    intensity = load.zone_intensity_g_per_kwh
    grams = projected_g(uj, intensity) if 0 < intensity < math.inf else 0.0
    return uj / 1e6, grams


def _figure(value: float) -> float:
    return value if isinstance(value, int | float) and 0 <= value < math.inf else 0.0


def settle(receipt: Receipt | None, projected: tuple[float, float] | None) -> Receipt | None:
    """The receipt to keep: the worker's, checked, with the projection added; None without one."""
    if receipt is None:
        return None
    if (
        0 <= receipt.joules < math.inf and 0 <= receipt.co2e_g < math.inf and 0 <= receipt.run_s < math.inf
        and 0 <= receipt.intensity_g_per_kwh < math.inf and receipt.tokens >= 0 and len(receipt.source) <= MAX_TEXT
        and not receipt.devices
    ):  # the usual receipt: kept as decoded (it is this step's own object), the projection added
        if projected:
            receipt.projected_joules, receipt.projected_co2e_g = round(projected[0], 6), projected[1]
        else:
            receipt.projected_joules = receipt.projected_co2e_g = 0.0
        return receipt
    return msgspec.structs.replace(
        receipt,
        joules=_figure(receipt.joules),
        co2e_g=_figure(receipt.co2e_g),
        intensity_g_per_kwh=_figure(receipt.intensity_g_per_kwh),
        run_s=_figure(receipt.run_s),
        tokens=max(0, receipt.tokens),
        source=receipt.source[:MAX_TEXT],
        devices=[d[:MAX_TEXT] for d in receipt.devices[:MAX_DEVICES]],
        projected_joules=round(projected[0], 6) if projected else 0.0,
        projected_co2e_g=projected[1] if projected else 0.0,
    )


class Footprint:
    """Joules and grams of CO2e of finished plans, by (principal, op), since the coordinator started."""

    def __init__(self, max_pairs: int = MAX_PAIRS) -> None:
        self.max_pairs = max_pairs
        self.joules: dict[tuple[str, str], float] = {}
        self.co2e_g: dict[tuple[str, str], float] = {}

    def add(self, principal: str, op: str, receipt: Receipt) -> None:
        """Count one plan's receipt."""
        key = (principal, op)
        if key not in self.joules and len(self.joules) >= self.max_pairs:
            key = (OTHER, OTHER)
        self.joules[key] = self.joules.get(key, 0.0) + receipt.joules
        self.co2e_g[key] = self.co2e_g.get(key, 0.0) + receipt.co2e_g
