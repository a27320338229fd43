"""What a deferred plan avoided: the accounting rule for a receipt's ``avoided_co2e_g``.

**The rule.** When a plan the shifter held ends, with ``E`` kWh measured over a run of ``d``
seconds that started at ``t_run`` in zone ``Z``, submitted at ``t_submit``:

    avoided_co2e_g = E * (mean I_Z over [t_submit, t_submit + d] - mean I_Z over [t_run, t_run + d])

where ``I_Z`` is the zone's intensity as the forecast book knows it *when the plan ends* — for
both windows, which then both lie in the past. The receipt also states the second mean: the
intensity it ran at.

**Why it does not overstate.**

* *One source for both sides.* Both means are read from the same values at the same moment.
  Mixing sources — the forecast at submit for the counterfactual, a measurement for what it
  emitted — would book the forecast's error as savings (a forecast that runs 10 % high would
  "save" 10 % of every plan, deferred or not).
* *Not the values that chose the window.* The planner held the plan for the window its forecast
  showed greenest; by selection that forecast is more likely too low there than too high (the
  winner's curse). Reading both windows from the latest values — the provider's actuals where
  it publishes them, its newest forecast otherwise — leaves that optimism out.
* *Same energy, same duration, same zone on both sides.* The counterfactual is the run as it
  happened, moved to its submit time, in the zone it ran in: what the placement's choice of zone
  saved (``carbon_weighted``) is not counted again as time shifting.
* *No clamp at zero.* A plan that ran at a dirtier time than its submit counts negative, so a
  sum over plans is not one-sided. A plan that was not held avoided nothing (it gets 0, not a
  figure from queueing delays it did not choose).
* *Unknown is unknown.* When the book does not cover both windows the figure is None, never a
  guess from the forecast's fill value.

Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.carbon_time.forecast import StepForecast

__all__ = ["Avoided", "avoided_co2e"]


@dataclass(frozen=True, slots=True)
class Avoided:
    """A held plan's accounting: grams avoided, and the two mean intensities it came from."""

    avoided_co2e_g: float
    ran_g_per_kwh: float  # mean intensity over the run as it happened
    at_submit_g_per_kwh: float  # mean intensity over the same run moved to its submit time


def avoided_co2e(intensity: StepForecast | None, energy_kwh: float, submitted_s: float, started_s: float,
                 ran_s: float) -> Avoided | None:
    """The rule above for one plan; None when ``intensity`` does not cover both windows."""
    if intensity is None or energy_kwh < 0 or ran_s < 0:
        return None
    first, last = min(submitted_s, started_s), max(submitted_s, started_s) + ran_s
    if first < intensity.start_s or last > intensity.end_s:
        return None
    at_submit = intensity.mean(submitted_s, submitted_s + ran_s)
    ran = intensity.mean(started_s, started_s + ran_s)
    return Avoided(energy_kwh * (at_submit - ran), ran, at_submit)
