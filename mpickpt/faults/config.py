"""FaultConfig: failure injection, the failure-process emulator and tracing (the `faults` flags)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mpickpt.faults.injection import FailureScript, KillAt, KillSettling
from mpickpt.faults.process import FailureModel
from mpickpt.options import int_at_least, option, positive_float


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"--failure-fraction must lie in (0, 1], got {text!r}")
    return value


@dataclass(frozen=True, kw_only=True, slots=True)
class FaultConfig:
    """Failure injection and emulation, and tracing, for fault tests and benchmarks."""

    OPTION_GROUP: ClassVar[str] = "faults"

    inject_kill: KillAt | None = option(None, parse=KillAt.parse, metavar="STEP:RANK[,RANK...]")
    """those ranks SIGKILL themselves after step STEP"""
    inject_kill_settling: KillSettling | None = option(None, parse=KillSettling.parse,
                                                       metavar="RANK[,RANK...]")
    """with --in-place: those ranks SIGKILL themselves in the first in-place recovery, after
    the next generation formed and before its peer watch stands (survivors or replacements)"""
    inject_failure: FailureScript | None = option(None, parse=FailureScript.parse,
                                                  metavar="STEP:RANK[,RANK...][/STEP:...]")
    """after step STEP those ranks lose their shards, optimizer state and parity (NaN) and the
    job recovers them with --recovery; several losses separated by '/'"""
    failure_model: FailureModel | None = option(None, parse=FailureModel.parse, metavar="MODEL")
    """emulate failures inside the job (CPR §5.1): exponential:MTBF, gamma:SHAPE,SCALE or
    cpr:MTBF (gamma with CPR's fitted shape 0.68); times in steps, or in hours with
    --emulated-hours; each goes through the same recovery as --inject-failure"""
    failure_fraction: float | None = option(None, parse=_fraction, metavar="F")
    """share of the embedding shards one emulated failure loses (CPR: 0.125, 0.25, 0.5); below
    1/ranks a rank stands for several embedding servers (default: one rank)"""
    failure_seed: int = option(0, parse=int_at_least(0))
    """seed of the emulated failures: the same seed gives the same failure steps and shards"""
    emulated_hours: float | None = option(None, parse=positive_float, metavar="H")
    """the run emulates a job of H hours (hours per step = H / --num-batches): the unit of
    failure models, --mtbf and --reschedule-time given in hours"""
    trace_samples: str | None = option(None, metavar="PATH")
    """rank 0 appends 'step position' for every step to PATH"""

    def check_world(self, world_size: int) -> None:
        """Every named rank exists. Local."""
        for injection in (self.inject_kill, self.inject_kill_settling,
                          self.inject_failure):
            if injection is not None:
                injection.check_world(world_size)

    @property
    def injects_losses(self) -> bool:
        return self.inject_failure is not None or self.failure_model is not None

    def hours_per_step(self, num_batches: int) -> float | None:
        return self.emulated_hours / num_batches if self.emulated_hours else None
