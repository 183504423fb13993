"""The failure-process emulator (CPR §5.1): failures drawn from a `FailureModel` inside a running
job, each losing a share of the embedding shards, recovered by the configured policy.

Time runs in executed steps (replayed steps after a rollback count again, as the wall clock does),
so a failure can strike during a replay. The schedule is drawn once from `--failure-seed` and the
job's shape: the same seed gives the same failure times and lost shards on every rank and in every
run. A failure of fraction F loses round(F x S) of S emulated embedding servers (at least one):
each rank's rows are split into the fewest equal parts that make F x S a whole number of servers
when possible (CPR's 12.5 % of 4 ranks is one half of one rank), or whole ranks when parity is on
(parity protects and rebuilds whole ranks). Local: every rank computes the same schedule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from mpickpt.faults.process import FailureModel
from mpickpt.faults.loss import Loss, LostShard
from mpickpt.store.file_spec import part_bounds


@dataclass(frozen=True)
class EmulatedFailure:
    """One failure: after `executed` steps of work (replays included), these shards are lost."""

    executed: int
    shards: tuple[LostShard, ...]


def servers_per_rank(fraction: float, world: int, whole_ranks: bool) -> int:
    """Emulated embedding servers per rank for failures of `fraction` of them. Local."""
    if whole_ranks:
        return 1
    return max(1, math.ceil(1.0 / (fraction * world) - 1e-9))


class FailureEmulator:
    """Draws failures from `model` (its time unit is `steps_per_unit` steps) and hands them to the
    trainer as its steps execute. Local and deterministic in `seed`."""

    def __init__(self, model: FailureModel, steps_per_unit: float, fraction: float,
                 local_rows: list[int], seed: int, whole_ranks: bool = False):
        self.model, self.steps_per_unit = model, steps_per_unit
        self.local_rows = list(local_rows)
        self.parts = servers_per_rank(fraction, len(local_rows), whole_ranks)
        self.servers = len(local_rows) * self.parts
        self.lost_per_failure = min(self.servers, max(1, round(fraction * self.servers)))
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.clock = 0.0
        self.executed = 0
        self.next = self._draw()
        self.fired: list[tuple[int, Loss | None]] = []

    @property
    def lost_share(self) -> float:
        """Servers lost per failure / all servers (CPR's 1 / N_emb for one node). Local."""
        return self.lost_per_failure / self.servers

    def _draw(self) -> EmulatedFailure:
        self.clock += float(self.model.gaps(self.rng, 1)[0]) * self.steps_per_unit
        picked = sorted(self.rng.choice(self.servers, size=self.lost_per_failure,
                                        replace=False).tolist())
        return EmulatedFailure(max(1, math.ceil(self.clock)),
                               tuple(self._server(s) for s in picked))

    def _server(self, index: int) -> LostShard:
        rank, part = divmod(index, self.parts)
        a, b = part_bounds(self.local_rows[rank], self.parts)[part]
        return LostShard(rank, a, b, self.local_rows[rank])

    def draw(self, n: int) -> list[EmulatedFailure]:
        """The next `n` failures, consumed (tests and the simulator use it). Local."""
        out = []
        for _ in range(n):
            out.append(self.next)
            self.next = self._draw()
        return out

    def progress(self) -> tuple[int, int]:
        """(steps executed, failures fired) so far: what `go_on_from` takes. Local."""
        return self.executed, len(self.fired)

    def go_on_from(self, executed: int, fired: int) -> None:
        """Continue from another process's `progress()` (the same model, seed and layout): a
        replacement of a dead rank, or a survivor that adopts the generation's agreed clock. The
        first `fired` failures count as fired (their losses are not known here: None). Local."""
        self.rng, self.clock = np.random.default_rng(self.seed), 0.0
        self.fired = [(f.executed, None) for f in (self._draw() for _ in range(fired))]
        self.next, self.executed = self._draw(), executed

    def step_done(self, step: int) -> Loss | None:
        """One more step executed (the trainer is after step `step`): the loss due now, if any.
        Local."""
        self.executed += 1
        if self.next.executed > self.executed:
            return None
        failure, self.next = self.next, self._draw()
        loss = Loss(failure.shards, step)
        self.fired.append((self.executed, loss))
        return loss

    def summary(self) -> str:
        """What happened, for the end of the run's log. Local."""
        return (f"failure emulator ({self.model}; {self.lost_per_failure} of {self.servers} "
                f"embedding servers per failure): {len(self.fired)} failures in "
                f"{self.executed} executed steps")
