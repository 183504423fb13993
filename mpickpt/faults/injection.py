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

    def due(self, step: int, rank: int, interrupted: bool = False) -> bool:
        """Whether `rank`, having finished step `step`, is to die now. `interrupted`: a peer's
        death broke step `step` + 1 (or what follows step `step`): a rank named for that step
        dies then too, instead of recovering, so that ranks named together die together even
        when one of them sees another's death before it reaches its own. Local."""
        return rank in self.ranks and (step == self.step or
                                       (interrupted and step + 1 == self.step))

    def maybe_kill(self, step: int, rank: int, interrupted: bool = False) -> None:
        """SIGKILL this process if it is named for this step (`due`). Local."""
        if self.due(step, rank, interrupted):
            os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True, kw_only=True, slots=True)
class FailAt(StepRanks):
    """One `--inject-failure` event STEP:RANK[,RANK...]: after step STEP those ranks lose their
    embedding shards, sparse optimizer state and parity (filled with NaN) while the job keeps
    running."""

    FLAG = "--inject-failure"

    def due(self, step: int) -> bool:
        return step == self.step


@dataclass(frozen=True, slots=True)
class FailureScript:
    """`--inject-failure STEP:RANK[,RANK...][/STEP:RANK[,RANK...]...]`: one or more scripted
    losses, each fired once (a rollback that replays its step does not fire it again)."""

    events: tuple[FailAt, ...]

    @classmethod
    def parse(cls, text: str) -> "FailureScript":
        """Parse the events separated by '/', naming the flag in the error. Local."""
        events = tuple(FailAt.parse(part) for part in text.split("/"))
        steps = [e.step for e in events]
        if len(set(steps)) != len(steps):
            raise ValueError(f"{FailAt.FLAG} names a step twice: {text!r}")
        return cls(events=tuple(sorted(events, key=lambda e: e.step)))

    def check_world(self, world_size: int) -> None:
        """Every named rank exists. Local."""
        for event in self.events:
            event.check_world(world_size)

    def due(self, step: int, fired: set) -> FailAt | None:
        """The event after `step` not yet in `fired` (which it joins), or None. Local."""
        for event in self.events:
            if event.due(step) and event.step not in fired:
                fired.add(event.step)
                return event
        return None
