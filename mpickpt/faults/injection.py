"""Failure injection for fault tests: a real SIGKILL of a rank after a given step, or the loss of
ranks' embedding shards (wiped to NaN) inside a running job."""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRanks:
    """STEP:RANK[,RANK...] of an injection flag."""

    FLAG = "--inject-kill"
    step: int
    ranks: tuple[int, ...]

    @classmethod
    def parse(cls, text: str):
        """Parse 'STEP:RANK[,RANK...]', naming the flag in the error. Local."""
        try:
            step, ranks = text.split(":")
            parsed = cls(step=int(step), ranks=tuple(int(r) for r in ranks.split(",")))
        except ValueError:
            raise ValueError(f"{cls.FLAG} must look like STEP:RANK[,RANK...], got {text!r}") from None
        if parsed.step < 1 or any(r < 0 for r in parsed.ranks):
            raise ValueError(f"{cls.FLAG} needs a step >= 1 and ranks >= 0, got {text!r}")
        if len(set(parsed.ranks)) != len(parsed.ranks):
            raise ValueError(f"{cls.FLAG} names a rank twice: {text!r}")
        return parsed

    def check_world(self, world_size: int) -> None:
        """Every named rank exists. Local."""
        bad = [r for r in self.ranks if r >= world_size]
        if bad:
            raise ValueError(f"{self.FLAG} names ranks {bad}, but the world has {world_size} ranks")


@dataclass(frozen=True, kw_only=True, slots=True)
class KillAt(StepRanks):
    """`--inject-kill STEP:RANK[,RANK...]`: those ranks SIGKILL themselves after step STEP."""

    FLAG = "--inject-kill"

    def maybe_kill(self, step: int, rank: int) -> None:
        """SIGKILL this process if it is named for this step. Local."""
        if step == self.step and rank in self.ranks:
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailAt(StepRanks):
    """`--inject-failure STEP:RANK[,RANK...]`: after step STEP those ranks lose their embedding
    shards, sparse optimizer state and parity (filled with NaN) while the job keeps running."""

    FLAG = "--inject-failure"

    def due(self, step: int) -> bool:
        return step == self.step
