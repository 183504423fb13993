"""Durations of a training job in its own unit, the step, and the clock that converts to it.

Failure rates, checkpoint costs and intervals come in three units: steps (exact and reproducible),
seconds of real time (measured: a checkpoint's stall, a restore), and hours, either real or of an
*emulated* job (`--emulated-hours H` maps the run onto a job of H hours, CPR §5.1). Every formula
works in steps; `StepClock` converts, from the emulated hours per step or from the measured time of
a step. Local.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

UNITS = {"": "steps", "step": "steps", "steps": "steps", "s": "seconds", "sec": "seconds",
         "seconds": "seconds", "min": "minutes", "minutes": "minutes", "h": "hours",
         "hours": "hours"}
SECONDS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-z]*)\s*$")


@dataclass(frozen=True)
class Duration:
    """A positive length of time: `value` in `unit` ('steps', 'seconds', 'minutes', 'hours')."""

    value: float
    unit: str = "steps"

    @classmethod
    def parse(cls, text: str, what: str = "duration") -> "Duration":
        """'200', '200steps', '90s', '5min', '14h' -> Duration; ValueError naming `what`. Local."""
        m = _RE.match(str(text))
        unit = UNITS.get(m.group(2)) if m else None
        if unit is None or not float(m.group(1)) > 0:
            raise ValueError(f"{what} must be a positive number of steps, or with a unit like "
                             f"'14h', '90s', '5min', '300steps'; got {text!r}")
        return cls(float(m.group(1)), unit)

    def __str__(self) -> str:
        return f"{self.value:.4g} {self.unit}"

    def scaled(self, factor: float) -> "Duration":
        return Duration(self.value * factor, self.unit)


class StepClock:
    """Converts durations to steps: emulated hours per step when the run emulates a longer job,
    else the measured seconds per step (an exponential moving average). Local."""

    def __init__(self, hours_per_step: float | None = None):
        self.hours_per_step = hours_per_step
        self.seconds_per_step: float | None = None

    @property
    def emulated(self) -> bool:
        return self.hours_per_step is not None

    def note_step(self, seconds: float) -> None:
        """The wall time of one training step. Local."""
        self.seconds_per_step = seconds if self.seconds_per_step is None else \
            0.9 * self.seconds_per_step + 0.1 * seconds

    def steps(self, d: Duration) -> float | None:
        """`d` in steps; None while a real-time duration cannot be converted yet (no step has
        been measured). Emulated runs read hours (and seconds) as emulated time. Local."""
        if d.unit == "steps":
            return d.value
        seconds = d.value * SECONDS[d.unit]
        if self.emulated:
            return seconds / 3600.0 / self.hours_per_step
        if not self.seconds_per_step:
            return None
        return seconds / self.seconds_per_step

    def real_steps(self, seconds: float) -> float | None:
        """A measured real-time cost (a stall, a restore) in steps of this run. Local."""
        if not self.seconds_per_step:
            return None
        return seconds / self.seconds_per_step
