"""`differential` (Check-N-Run's one-shot baseline): a full baseline, then the rows changed since
it; restore reads the baseline and the one increment. Local."""
from __future__ import annotations

import numpy as np

from mpickpt.kinds.base import Increment, Kind
from mpickpt.store.segments import whole_files


class Differential(Kind):
    """Increments hold every row changed since the baseline."""

    name = format = "differential"

    def increment(self, chain, step, changed, counts):
        return Increment(np.nonzero(chain.since_base)[0], [chain.base_step])

    def segments(self, root, manifest, parents):
        return [s for m in [*parents, manifest] for s in whole_files(m)]
