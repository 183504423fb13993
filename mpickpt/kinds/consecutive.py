"""`consecutive`: a full baseline, then the rows changed since the previous checkpoint; restore
reads the baseline and every increment up to the step, newer rows overwriting older ones (the
naive incremental restore IncrCP improves on). Local."""
from __future__ import annotations

from mpickpt.kinds.base import Increment, Kind
from mpickpt.store.segments import whole_files


class Consecutive(Kind):
    """Increments hold the rows changed since the last save; every one is a parent of the next."""

    name = format = "consecutive"

    def increment(self, chain, step, changed, counts):
        return Increment(changed, [chain.base_step, *chain.steps])

    def segments(self, root, manifest, parents):
        return [s for m in [*parents, manifest] for s in whole_files(m)]
