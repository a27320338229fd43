"""Grid carbon intensity of the worker's zone, in gCO2e/kWh, for its ``load`` frames.

Three sources, the later overriding the earlier (docs/OPERATIONS.md §Energy and carbon):

1. **Built in**: :data:`BUILTIN_G_PER_KWH`, annual averages per country (ISO 3166 alpha-2 code).
   Source: Ember, *Yearly Electricity Data*, 2023 values of "carbon intensity of electricity
   generation" (lifecycle gCO2e per kWh generated), as republished by Our World in Data
   (ourworldindata.org/grapher/carbon-intensity-electricity), rounded to whole grams. Annual
   averages of generation: they ignore imports and the hour of day, so they are a default, not a
   measurement.
2. **A file** (``--carbon-file``): JSON ``{"ZONE": grams, ...}`` or lines ``ZONE grams`` (``#``
   starts a comment). It extends and overrides the table.
3. **A command** (``--carbon-command``), run every ``--carbon-interval`` seconds with the zone in
   ``$FLEETWIRE_CARBON_ZONE``: its stdout is either a bare number (grams for this zone) or a JSON
   object like the file. A failing command (non-zero exit, timeout, unparsable output) is logged
   and the previous value is kept.

Zones are matched exactly, then by the part before the first ``-`` (``US-CAL-CISO`` falls back to
``US``), case-insensitively. An unknown zone reports 0 (unknown), never a guess.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import structlog

from wireio.spawn import kill_session, started

log = structlog.get_logger(__name__)

__all__ = ["BUILTIN_G_PER_KWH", "CarbonIntensity", "lookup", "parse_table"]

#: Annual average gCO2e/kWh of electricity generation, 2023 (Ember via Our World in Data; see above).
BUILTIN_G_PER_KWH: Final[Mapping[str, float]] = {
    "WORLD": 481,
    "AR": 354, "AT": 111, "AU": 549, "BD": 691, "BE": 138, "BG": 335, "BR": 98, "CA": 170,
    "CL": 291, "CN": 582, "CO": 260, "CR": 53, "CY": 534, "CZ": 450, "DE": 381, "DK": 152,
    "EC": 150, "EE": 417, "EG": 570, "FI": 79, "FR": 56, "GE": 168, "GR": 337, "HR": 205,
    "HU": 204, "IE": 291, "IN": 713, "IR": 655, "NO": 30, "PL": 662, "SE": 41,
    # Same table and year; these were not re-read against it when this file was written: check
    # them (or override them with --carbon-file) where the figure matters.
    "ES": 174, "GB": 238, "IT": 331, "JP": 485, "KR": 432, "NL": 268, "SG": 471, "US": 369,
}


def lookup(zone: str, table: Mapping[str, float]) -> float | None:
    """The intensity of ``zone`` in ``table`` (keys upper-case): exact, then the prefix before ``-``."""
    key = zone.strip().upper()
    if not key:
        return None
    if key in table:
        return table[key]
    country, _, _ = key.partition("-")
    return table.get(country)


def _grams(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: expected a number of gCO2e/kWh, got {value!r}")
    grams = float(value)
    if not math.isfinite(grams) or grams < 0:
        raise ValueError(f"{where}: intensity must be a finite number >= 0, got {value!r}")
    return grams


def parse_table(text: str, source: str) -> dict[str, float]:
    """Zones and intensities from JSON ``{"ZONE": grams}`` or ``ZONE grams`` lines.

    Raises:
        ValueError: naming ``source`` and the line or key that is wrong.
    """
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not valid JSON: {exc}") from None
        return {str(zone).upper(): _grams(value, f"{source}: zone {zone!r}") for zone, value in data.items()}
    table: dict[str, float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{source}:{number}: expected 'ZONE grams', got {line!r}")
        try:
            value = float(parts[1])
        except ValueError:
            raise ValueError(f"{source}:{number}: {parts[1]!r} is not a number") from None
        table[parts[0].upper()] = _grams(value, f"{source}:{number}")
    return table


class CarbonIntensity:
    """The current intensity of one zone, from the table, a file and a periodic command.

    Args:
        zone: the grid zone (e.g. ``FR``, ``US-CAL-CISO``); empty: unknown (0).
        file: a table file that extends and overrides the built-in one.
        command: a shell command whose output gives the intensity (see the module docstring).
        interval_s: how often the command runs.
        timeout_s: how long one run of the command may take.

    Raises:
        ValueError: the file cannot be read or parsed, or a bad interval.
    """

    def __init__(
        self,
        zone: str = "",
        *,
        file: str | Path | None = None,
        command: str | None = None,
        interval_s: float = 300.0,
        timeout_s: float = 30.0,
    ) -> None:
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError("carbon command interval and timeout must be > 0 s")
        self.zone = zone.strip()
        self.command = command
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._table: dict[str, float] = dict(BUILTIN_G_PER_KWH)
        if file is not None:
            path = Path(file)
            try:
                text = path.read_text()
            except OSError as exc:
                raise ValueError(f"cannot read carbon file {path}: {exc.strerror or exc}") from None
            self._table.update(parse_table(text, str(path)))
        self._from_command: float | None = None
        if self.zone and lookup(self.zone, self._table) is None and command is None:
            log.warning("unknown carbon zone: intensity reported as 0", zone=self.zone)

    @property
    def g_per_kwh(self) -> float:
        """The intensity now: the command's latest answer, else the table's; 0 when unknown."""
        if self._from_command is not None:
            return self._from_command
        if not self.zone:
            return 0.0
        return lookup(self.zone, self._table) or 0.0

    def accept_output(self, stdout: str) -> float:
        """Take a command's output (a number, or a JSON table that has this zone).

        Raises:
            ValueError: the output does not say this zone's intensity.
        """
        text = stdout.strip()
        try:
            grams = _grams(float(text), "carbon command")
        except ValueError:
            table = parse_table(text, "carbon command output")
            found = lookup(self.zone, table)
            if found is None:
                raise ValueError(f"carbon command output has no value for zone {self.zone!r}") from None
            grams = found
        self._from_command = grams
        return grams

    async def refresh(self) -> None:
        """Run the command once; on any failure keep the previous value and log why."""
        if self.command is None:
            return
        env = {**os.environ, "FLEETWIRE_CARBON_ZONE": self.zone}
        # Its own session, so a timeout or the worker's stop kills the shell and whatever it started; a stop that
        # comes while asyncio starts it too (wireio/spawn.py: asyncio would kill the shell alone).
        start = asyncio.create_subprocess_shell(
            self.command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        proc = await started(start, kill_session)
        try:  # not asyncio.wait_for: on 3.11 it loses a cancel that comes as the command ends (Telemetry.stop's:
            async with asyncio.timeout(self.timeout_s):  # refresh_forever went on and the worker's stop waited)
                stdout, stderr = await proc.communicate()
        except TimeoutError:
            await kill_session(proc)
            log.warning("carbon command timed out; keeping the previous value", timeout_s=self.timeout_s)
            return
        except asyncio.CancelledError:  # Telemetry.stop: the command does not outlive the worker
            await kill_session(proc)
            raise
        if proc.returncode != 0:
            log.warning(
                "carbon command failed; keeping the previous value",
                status=proc.returncode,
                stderr=stderr.decode(errors="replace").strip()[-500:],
            )
            return
        try:
            grams = self.accept_output(stdout.decode(errors="replace"))
        except ValueError as exc:
            log.warning("carbon command output not understood; keeping the previous value", error=str(exc))
            return
        log.debug("carbon intensity refreshed", zone=self.zone, g_per_kwh=grams)

    async def refresh_forever(self) -> None:
        """Run the command now and then every ``interval_s`` until cancelled."""
        while self.command is not None:
            await self.refresh()
            await asyncio.sleep(self.interval_s)
