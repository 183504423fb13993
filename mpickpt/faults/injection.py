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
        _distinct(cls.FLAG, parsed.ranks, text)
        return parsed

    def check_world(self, world_size: int) -> None:
        """Every named rank exists. Local."""
        _in_world(self.FLAG, self.ranks, world_size)


def _distinct(flag: str, ranks: tuple[int, ...], text: str) -> None:
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"{flag} names a rank twice: {text!r}")


def _in_world(flag: str, ranks: tuple[int, ...], world_size: int) -> None:
    bad = [r for r in ranks if r >= world_size]
    if bad:
        raise ValueError(f"{flag} names ranks {bad}, but the world has {world_size} ranks")


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
class KillSettling:
    """`--inject-kill-settling RANK[,RANK...]`: those ranks SIGKILL themselves in the job's first
    in-place recovery, after generation 1 formed and before its peer watch stands (survivors
    and replacements alike), where only the old ring and the store can tell the others."""

    FLAG = "--inject-kill-settling"
    ranks: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> "KillSettling":
        """Parse 'RANK[,RANK...]', naming the flag in the error. Local."""
        try:
            ranks = tuple(int(r) for r in text.split(","))
        except ValueError:
            raise ValueError(f"{cls.FLAG} must look like RANK[,RANK...], got {text!r}") from None
        if any(r < 0 for r in ranks):
            raise ValueError(f"{cls.FLAG} needs ranks >= 0, got {text!r}")
        _distinct(cls.FLAG, ranks, text)
        return cls(ranks=ranks)

    def check_world(self, world_size: int) -> None:
        """Every named rank exists. Local."""
        _in_world(self.FLAG, self.ranks, world_size)

    def maybe_kill(self, generation: int, rank: int, restart: int) -> None:
        """SIGKILL this process if it is named and settles into generation 1 of the job's
        first launch. Local."""
        if generation == 1 and restart == 0 and rank in self.ranks:
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
