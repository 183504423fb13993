"""The report of a finished rebuild, reduced over the control channel beside training.

When a rebuild ends, every rank starts two reductions of its figures (sums of units, degraded
rows and bytes received; the slowest rank's round work and wall time) and goes on training;
the report is completed at the next place that needs it (the next lookup, a settle, the
history). Waiting for them at the end of the rebuild's last round put two blocking
collectives of 4 processes on 2 cores into that step: measured 14 ms on the lost rank and
20-26 ms on the others, a third of the rebuild's whole cost to training in `bench/parity.py`.
"""
from __future__ import annotations

import numpy as np

from mpickpt.control import MAX, SUM


SUMMED = ("units", "degraded_rows", "received_bytes", "mapped_bytes")
"""Figures the report sums over the ranks."""
SLOWEST = ("round_seconds", "seconds")
"""Figures the report takes the slowest rank's of (round work; wall, failure to last unit)."""


class RebuildReport:
    """One finished rebuild's figures, their reductions (SUMMED, SLOWEST) in flight.
    Construction starts them (collective over the control channel: every rank constructs it at
    the same point; on a channel already aborted it starts none); `result` waits for them
    (local)."""

    def __init__(self, control, rb, after_step: int, done_step: int):
        """`rb`: the finished `Rebuild`; `after_step`: the step after which its ranks were lost;
        `done_step`: the step in which its last units were rebuilt."""
        self.local = {"ranks": sorted(rb.failed), "after_step": after_step,
                      "done_step": done_step, "units": rb.total,
                      "degraded_rows": rb.degraded_rows, "received_bytes": rb.received_bytes,
                      "mapped_bytes": rb.mapped_bytes,
                      "rounds": rb.rounds, "memory_rounds": rb.memory_rounds,
                      "beside_rounds": rb.beside_rounds,
                      "seconds": rb.finished_at - rb.started, "round_seconds": rb.seconds}
        self._sums = np.zeros(len(SUMMED), dtype=np.int64)
        self._slowest = np.zeros(len(SLOWEST), dtype=np.float64)
        self._requests, self._failed = [], None
        try:
            self._requests = [
                control.Iallreduce(np.array([self.local[k] for k in SUMMED], dtype=np.int64),
                                   self._sums, SUM),
                control.Iallreduce(np.array([self.local[k] for k in SLOWEST], dtype=np.float64),
                                   self._slowest, MAX)]
        except RuntimeError as e:  # the channel was aborted already (a death is known)
            self._failed = e

    def result(self) -> tuple[dict, str | None]:
        """(the record, None), the job's totals in it; or, where the reductions failed (a death
        ended the generation), (this rank's own figures, why). Local."""
        try:
            if self._failed is not None:
                raise self._failed
            for request in self._requests:  # done before a death aborted the channel: kept
                if request.Finished() is None:
                    request.Wait()
        except RuntimeError as e:
            return dict(self.local), f"this rank's figures only: {e}"
        return {**self.local, **{k: int(v) for k, v in zip(SUMMED, self._sums)},
                **{k: float(v) for k, v in zip(SLOWEST, self._slowest)}}, None
