"""When IncrCP's stage 2 (the Bloom hit ratio) runs.

Stage 2 exists to skip reading an old row-0 chunk's keys when few of the new keys can be in it.
It costs a filter built for every chunk the extractor makes (a new column's chunks, the rows a
split leaves in row 0) and a test of the new keys in the chunk's key range against it. Where
the same rows are hot in every interval, every old chunk holds more than R of the new keys, the
stage passes every chunk it tests and its cost buys nothing: a third of the extractor's CPU on
the Criteo-shaped synthetic stream (`bench/time_lost.py`, issue 23). The stage goes off after
`quiet` ingestions in a row whose tests skipped nothing, and while off runs again for one
ingestion now and then, a probe (rebuilding the filters it lacks from the chunks' keys), to
notice when it would skip again; one skip turns it back on. The first probe comes
`probe_every` ingestions after the stage last ran. A probe costs a filter for every row-0 chunk,
as many as the chain has columns, so each probe that skips nothing doubles the gap to the next,
up to `longest` ingestions (one probe in 8 was ~9 % of the extractor's CPU on that stream after
60 ingestions); a skip brings the gap back to `probe_every`.

Which chunks are extracted does not depend on it: a Bloom filter has no false negatives, so a
chunk that stage 2 skips (hits < R·rows) has fewer than R·rows duplicates and stage 3's exact
count keeps it too. Local: one per extractor.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BloomStage:
    quiet: int = 2
    """Ingestions in a row that tested chunks and skipped none before the stage goes off."""
    probe_every: int = 8
    """While off, the first probe runs this many ingestions after the stage last ran."""
    longest: int = 64
    """The longest gap between probes (each probe that skips nothing doubles it)."""
    streak: int = 0
    """Ingestions in a row, among those where the stage ran and tested chunks, that skipped
    none."""
    since_run: int = 0
    """Ingestions since the stage last ran."""
    gap: int = field(default=0, init=False)
    """Ingestions from the last run to the next probe while off (`probe_every` at first)."""

    def __post_init__(self):
        if self.quiet < 1 or self.probe_every < 1:
            raise ValueError(f"BloomStage: quiet and probe_every must be >= 1, got "
                             f"{self.quiet} and {self.probe_every}")
        if self.longest < self.probe_every:
            raise ValueError(f"BloomStage: longest ({self.longest}) must be at least "
                             f"probe_every ({self.probe_every})")
        self.gap = self.probe_every

    @property
    def off(self) -> bool:
        """Whether the stage is off (it still runs for a probe). Local."""
        return self.streak >= self.quiet

    def runs(self) -> bool:
        """Whether the next ingestion builds filters and tests chunks against them. Local."""
        return not self.off or self.since_run + 1 >= self.gap

    def record(self, ran: bool, tested: int, skipped: int) -> None:
        """An ingestion's outcome: whether the stage ran, how many chunks reached it and how
        many it skipped. Local."""
        probe = ran and self.off
        self.since_run = 0 if ran else self.since_run + 1
        if not ran or not tested:
            return
        self.streak = 0 if skipped else self.streak + 1
        if skipped:
            self.gap = self.probe_every
        elif probe:
            self.gap = min(2 * self.gap, self.longest)

    @classmethod
    def always(cls) -> "BloomStage":
        """A stage that never goes off (tests of the filters themselves). Local."""
        return cls(quiet=1 << 62)
