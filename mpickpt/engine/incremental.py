"""The incremental machinery behind one `CheckpointManager`: the kind planner, the modified-row
tracker attached to the embeddings, and the kind's background companion (IncrCP's extractor).

The manager calls `plan` for every save, `written` once a save is durable, `poll` whenever it
polls, and `close` / `abort` when it stops; the tracker is detached from the embeddings then.
"""
from __future__ import annotations

import numpy as np

from mpickpt.background_priority import Background
from mpickpt.model.contract import INCREMENTAL, require
from mpickpt.kinds.base import SavePlan
from mpickpt.kinds.planner import KindPlanner
from mpickpt.kinds.registry import kind_named
from mpickpt.track.bitvector import RowBitVector


class IncrementalSaves:
    """One rank's kind planner, row tracker and companion. Construction is local; `plan` is
    collective."""

    def __init__(self, topo, config, model, root: str, say, background=None):
        """`background`: how and where the companion's process runs (a
        `mpickpt.background_priority.Background`; default: --ckpt-background, anywhere)."""
        self.topo = topo
        kind = kind_named(config.kind, int(sum(model.plan.table_sizes)), config)
        self.planner = KindPlanner(kind, model.plan.local_rows(topo.rank), self._allreduce("SUM"),
                                   self._allreduce("MAX"))
        self.tracker: RowBitVector | None = None
        self._detach = None
        if self.planner.tracks_rows:
            require(model, INCREMENTAL)
            self.tracker = RowBitVector(model.plan.local_rows(topo.rank), device=topo.device)
            self._detach = self.tracker.attach(model.embeddings)
        attached = kind.attach(model)
        if attached:
            say(attached)
        self.companion = kind.companion(root, config, say,
                                        background or Background.of(config.background))
        self.companion_cpu_seconds = 0.0
        """CPU the companion's process spent on its answered jobs, kept past `close`."""
        self.companion_bytes = 0
        """Bytes the companion's process wrote in its answered jobs, kept past `close`."""

    def _allreduce(self, op: str):
        topo = self.topo

        def reduce(values):  # the channel of the generation current at the call
            out = np.empty_like(values)
            topo.control.Allreduce(values, out, op=op)
            return out
        return reduce

    @property
    def tracks_rows(self) -> bool:
        return self.tracker is not None

    def plan(self, step: int, attempt: str) -> SavePlan:
        """What checkpoint `step` writes; clears the tracked rows. Collective."""
        changed = self.tracker.extract().cpu().numpy() if self.tracker is not None else None
        return self.planner.plan(step, changed, attempt)

    def reset(self) -> None:
        """The next save must be a full baseline (after a restore or an abandoned save). Local."""
        self.planner.reset()

    def written(self, save: SavePlan, step: int, seconds: float, parts: int, row_names) -> None:
        """A save of this rank is durable: feed its write time to the kind and hand an increment
        to the companion. Local."""
        self.planner.record_write(save.kind, seconds)
        if self.companion is not None and not save.is_full:
            self.companion.written(self.topo.rank, step, save.chain, parts, row_names,
                                   self.topo.is_root)

    def poll(self, drain: bool = False) -> None:
        """Take the companion's answers (every outstanding one with `drain`). Local."""
        if self.companion is not None:
            self.companion.poll(self.planner.kind, self.topo.rank, drain)
            self.companion_cpu_seconds = getattr(self.companion, "cpu_seconds", 0.0)
            self.companion_bytes = getattr(self.companion, "bytes_written", 0)

    def prioritize(self, background: str) -> None:
        """The companion's background process (the IncrCP extractor) at `background`. Local."""
        if self.companion is not None and hasattr(self.companion, "prioritize"):
            self.companion.prioritize(background)

    def close(self) -> None:
        """Finish the companion's queue, stop it and detach the tracker. Local. Safe twice."""
        self.poll(drain=True)
        self.abort()

    def abort(self) -> None:
        """Stop the companion now and detach the trackers. Local. Safe twice."""
        self.planner.kind.detach()
        if self.companion is not None:
            self.companion.close()
            self.companion = None
        if self._detach is not None:
            self._detach()
            self._detach = None
