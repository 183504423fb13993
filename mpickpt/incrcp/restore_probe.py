"""When the extractor times a restore of a checkpoint's increments (IncrCP's R_i, the input of the
cost model that decides baselines), and what it reports when it does not.

Timing a restore reads the checkpoint's whole rectangle, which grows with the chain: timed at
every increment, the background reads O(n) rows per checkpoint and O(n^2) over a chain of n. The
paper infers R from history, observing that it grows near-linearly with the data loaded. A probe
times the first increment of a chain and then again whenever the rectangle's rows have grown by
`growth` since the last timing; in between it reports the last timing scaled by the rectangle's
rows. Over a whole chain the timed reads then add up to at most growth / (growth - 1) restores of
its final rectangle (5 at the default 1.25), instead of about n / 2. With `--incrcp-reset never`
nothing reads R, and nothing is timed. Local: one probe per extractor process.
"""
from __future__ import annotations

GROWTH = 1.25
"""Time a restore again once the rectangle holds this many times the rows of the last timed one."""


class RestoreProbe:
    """The last timed restore per chain, and the rule for the next. Local."""

    def __init__(self, growth: float = GROWTH):
        if growth <= 1.0:
            raise ValueError(f"restore probe growth must exceed 1, got {growth!r}")
        self.growth = growth
        self.last: tuple[str, int, float] | None = None
        """(chain, rectangle rows, seconds) of the last timed restore: one chain at a time, as
        the extractor keeps one index."""

    def due(self, chain: str, rows: int) -> bool:
        """Whether a rectangle of `rows` rows of `chain` must be timed. Local."""
        if self.last is None or self.last[0] != chain:
            return True
        return self.last[1] <= 0 or rows >= self.growth * self.last[1]

    def estimate(self, rows: int) -> float:
        """The last timing scaled to `rows` rows (call only when not `due`). Local."""
        _, last_rows, seconds = self.last
        return seconds * rows / last_rows

    def restore_seconds(self, chain: str, rows: int, time_it) -> tuple[float, bool]:
        """(R of a rectangle of `rows` rows, whether it was timed): `time_it()` times it when
        due, else the estimate. Local."""
        if self.due(chain, rows):
            self.last = (chain, rows, time_it())
            return self.last[2], True
        return self.estimate(rows), False
