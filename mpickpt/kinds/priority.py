"""`priority`: prioritized partial saves (CPR §4.2 MFU and SSU, SCAR §4.2). Between full
baselines, each save writes at most a fraction r (`--ckpt-save-fraction`) of each table shard's
rows, those its priority tracker (`--ckpt-priority`, `mpickpt.track.priority`) ranks highest:
most lookups since the row was last saved (mfu), a subsampled list of looked-up rows (ssu), or the
largest change since the row was last saved (scar). Restore applies the baseline and every save
since, newest row winning, so a checkpoint of this kind is *approximate*: rows changed since they
were last written keep their older value. It is meant for partial recovery (CPR), where a lost
shard reloads from it while everything else keeps going. A new baseline is taken every K saves
(`--priority-baseline-every`, default 4 x ceil(1 / r); 0: never, which matches full checkpoints'
save bandwidth at r times their interval, CPR's setting); restore reads the baseline and every save
since. Local.
"""
from __future__ import annotations

import math

from mpickpt.kinds.base import Increment, Kind
from mpickpt.store.segments import whole_files

RULES = ("mfu", "ssu", "scar")
"""`--ckpt-priority`: the trackers of `mpickpt.track.priority` (imported when a job attaches one,
so that reading checkpoints never imports torch)."""
DEFAULT_FRACTION = 0.125
"""CPR §6.1: 8 times more frequent saves of at most 1/8 of the rows (r = 0.125)."""
BASELINE_CYCLES = 4
"""Default saves between baselines, in units of ceil(1 / r): a cycle writes about
(1 + 4 - r) / 4 = 1.22 times the rows full checkpoints at r times the interval would."""


class Priority(Kind):
    """Partial saves of the highest-priority rows; baselines every ceil(1 / r) saves."""

    name = format = "priority"
    exact = False

    def __init__(self, total_rows: int = 0, config=None):
        super().__init__(total_rows, config)
        self.rule = getattr(config, "priority", None) or "mfu"
        self.fraction = getattr(config, "save_fraction", None) or DEFAULT_FRACTION
        if self.rule not in RULES:
            raise ValueError(f"--ckpt-priority must be one of {', '.join(RULES)}, got "
                             f"{self.rule!r}")
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"--ckpt-save-fraction must lie in (0, 1], got {self.fraction!r}")
        every = getattr(config, "priority_baseline_every", None)
        self.every = BASELINE_CYCLES * math.ceil(1.0 / self.fraction) if every is None else every
        self.save_share = self.fraction
        self.tracker = None
        self._remove = None

    def attach(self, model) -> str:
        from mpickpt.model.contract import PRIORITY, require
        from mpickpt.track.priority import make_tracker, shard_ranges

        require(model, PRIORITY)
        emb = model.embeddings
        ranges = shard_ranges(model.plan, emb.topo.rank)
        self.tracker = make_tracker(self.rule, len(emb.local_gids), ranges, emb.device,
                                    self.fraction, weight=emb.weight, seed=emb.topo.rank)
        self._remove = emb.add_count_hook(self.tracker.observe)
        table_bytes = emb.weight.numel() * emb.weight.element_size()
        return (f"prioritized saves ({self.rule}, r = {self.fraction:g}): at most "
                f"{self.fraction:.1%} of each table shard per save, a baseline "
                + (f"every {self.every} saves" if self.every else "only at the start")
                + f"; tracker memory {self.tracker.nbytes} bytes "
                f"({self.tracker.nbytes / 1e6:.2f} MB) on rank {emb.topo.rank}, "
                f"{self.tracker.nbytes / max(table_bytes, 1):.2%} of its embedding rows "
                f"(CPR Table 1)")

    def detach(self) -> None:
        if self._remove is not None:
            self._remove()
            self._remove = None

    def baseline_reason(self, chain, counts, reduce_max):
        if self.every and len(chain.steps) + 1 >= self.every:
            return f"priority: a new baseline every {self.every} saves"
        return None

    def started(self, chain):
        if self.tracker is not None:
            self.tracker.reset()

    def increment(self, chain, step, changed, counts):
        rows = self.tracker.select(self.fraction)
        self.tracker.saved(rows)
        return Increment(rows, [chain.base_step, *chain.steps])

    def segments(self, root, manifest, parents):
        return [s for m in [*parents, manifest] for s in whole_files(m)]
