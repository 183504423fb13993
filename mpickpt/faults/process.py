"""Failure processes: the times between failures of a job, as a renewal process.

- ``exponential:MTBF``: memoryless failures with mean time between failures MTBF.
- ``gamma:SHAPE,SCALE``: gamma-distributed times between failures (mean SHAPE x SCALE). CPR fitted
  the time to failure of 20,000 production training jobs with a gamma distribution (§3.1, Fig. 3)
  but prints no parameters; it reports a median time between failures of 8-17 h and an MTBF of
  14-30 h. A gamma whose median/mean ratio is 8/14 = 0.57 (or 17/30 = 0.57) has shape 0.68, so
- ``cpr:MTBF`` is gamma with shape 0.68 and scale MTBF / 0.68: CPR's fitted shape (derived from
  its median and mean, as above), with the MTBF of your job. A shape below 1 makes failures more
  likely early in a job, as CPR observed (Fig. 3b).

Times take a unit (`mpickpt.durations`): '300' or '300steps', '14h', '90s'. Local.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpickpt.durations import Duration

CPR_GAMMA_SHAPE = 0.68
"""The shape whose median/mean ratio (0.57) matches CPR's production statistics (§3.1)."""
KINDS = ("exponential", "gamma", "cpr")


@dataclass(frozen=True)
class FailureModel:
    """Times between failures: gamma(shape, scale); exponential is shape 1."""

    kind: str
    shape: float
    scale: Duration

    @classmethod
    def parse(cls, text: str) -> "FailureModel":
        """'exponential:MTBF', 'gamma:SHAPE,SCALE' or 'cpr:MTBF'; ValueError naming the flag and
        the forms expected. Local."""
        name, _, rest = str(text).partition(":")
        try:
            if name == "exponential":
                return cls("exponential", 1.0, Duration.parse(rest, "the MTBF"))
            if name == "cpr":
                mtbf = Duration.parse(rest, "the MTBF")
                return cls("cpr", CPR_GAMMA_SHAPE, mtbf.scaled(1.0 / CPR_GAMMA_SHAPE))
            if name == "gamma":
                shape, scale = rest.split(",")
                if not float(shape) > 0:
                    raise ValueError(f"the shape must be > 0, got {shape!r}")
                return cls("gamma", float(shape), Duration.parse(scale, "the scale"))
        except ValueError as e:
            raise ValueError(f"--failure-model {text!r}: {e}") from None
        raise ValueError(f"--failure-model must be exponential:MTBF, gamma:SHAPE,SCALE or "
                         f"cpr:MTBF (times like 300, 300steps, 14h), got {text!r}")

    @property
    def mean(self) -> Duration:
        """The mean time between failures (MTBF)."""
        return self.scale.scaled(self.shape)

    def gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` times between failures, in the unit of `scale`. Local."""
        return rng.gamma(self.shape, self.scale.value, size=n)

    def __str__(self) -> str:
        if self.kind == "exponential":
            return f"exponential, MTBF {self.mean}"
        return f"gamma (shape {self.shape:g}, scale {self.scale}; MTBF {self.mean})" + \
            (" (CPR's fitted shape)" if self.kind == "cpr" else "")
