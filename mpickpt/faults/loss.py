"""What a failure takes: embedding shards (row ranges of ranks) lost after a step. Local."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class LostShard:
    """Local rows [start, stop) of `rank` (the rank's whole shard, or a part of it that stands
    for one of several embedding servers emulated per rank)."""

    rank: int
    start: int
    stop: int
    held: int
    """Rows the rank holds in all."""

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == self.held


@dataclass(frozen=True)
class Loss:
    """Embedding shards whose rows and sparse optimizer state are gone after a step (and, for
    whole ranks, the parity those ranks held)."""

    shards: tuple[LostShard, ...]
    after_step: int

    @classmethod
    def of_ranks(cls, ranks, after_step: int, plan) -> "Loss":
        """The loss of whole ranks (`plan` gives their row counts). Local."""
        return cls(tuple(LostShard(r, 0, plan.local_rows(r), plan.local_rows(r))
                         for r in sorted(set(ranks))), after_step)

    @property
    def ranks(self) -> frozenset[int]:
        return frozenset(s.rank for s in self.shards)

    def of_rank(self, rank: int) -> list[LostShard]:
        """This rank's lost row ranges. Local."""
        return [s for s in self.shards if s.rank == rank]

    def share(self, total_rows: int) -> float:
        """The lost rows as a share of the model's embedding rows. Local."""
        return sum(s.rows for s in self.shards) / max(total_rows, 1)

    def __str__(self) -> str:
        what = f"ranks {sorted(self.ranks)}" if all(s.whole for s in self.shards) else \
            "shards " + ", ".join(f"{s.rank}[{s.start}:{s.stop})" for s in self.shards)
        return f"{what} lost their shards after step {self.after_step}"
