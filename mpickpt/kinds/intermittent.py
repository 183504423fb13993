"""`intermittent`: differential increments, with Check-N-Run's history predictor taking a new full
baseline when F_c <= I_c, where F_c = 1 + S_1 + ... + S_i and I_c = (i + 1) S_i, the sizes S as
fractions of the model (§4.1). Its increments are `differential` checkpoints. Local."""
from __future__ import annotations

from mpickpt.kinds.differential import Differential


class Intermittent(Differential):
    """Differential, with a new baseline once the predictor says a full checkpoint is cheaper."""

    name = "intermittent"
    format = "differential"

    def __init__(self, total_rows: int = 0, config=None):
        super().__init__(total_rows, config)
        self.sizes: list[float] = []

    def baseline_reason(self, chain, counts, reduce_max):
        if not self.sizes:
            return None
        i = len(self.sizes)
        f_c, i_c = 1.0 + sum(self.sizes), (i + 1) * self.sizes[-1]
        return f"predictor: F_c {f_c:.3f} <= I_c {i_c:.3f}" if f_c <= i_c else None

    def started(self, chain):
        self.sizes = []

    def increment(self, chain, step, changed, counts):
        self.sizes.append(int(counts[1]) / max(self.total_rows, 1))
        return super().increment(chain, step, changed, counts)
