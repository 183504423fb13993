"""KindPlanner: chooses each checkpoint's rows and parents for one rank, asking its `Kind`.

Every run starts with a full baseline (a restored model or a new plan invalidates the tracking),
and so does the first checkpoint after one that was abandoned (its rows were cleared from the
tracker). `plan` is collective (one allreduce of the changed-row counts, and whatever the kind
reduces), so every rank takes the same decision.
"""
from __future__ import annotations

import numpy as np

from mpickpt.kinds.base import ChainState, Kind, SavePlan
from mpickpt.kinds.full import Full


class KindPlanner:
    """The chain state of one rank and the decisions taken on it by its `kind`.

    `allreduce_sum` / `allreduce_max` reduce a numpy vector over the ranks (the control channel
    in a job; stand-ins in single-process harnesses)."""

    def __init__(self, kind: Kind, local_rows: int, allreduce_sum, allreduce_max):
        self.kind, self.full = kind, Full()
        self._sum, self._max = allreduce_sum, allreduce_max
        self.state = ChainState(np.zeros(local_rows, dtype=bool))
        self._marked = False
        """Whether any row of `since_base` was set since it was last cleared (a kind that
        tracks no rows never sets one, and its baselines skip clearing the whole vector)."""
        self.decisions: list[dict] = []

    @property
    def policy(self) -> str:
        return self.kind.name

    @property
    def tracks_rows(self) -> bool:
        return self.kind.tracks_rows

    @property
    def chain(self) -> str:
        return self.state.name

    def reset(self) -> None:
        """The next checkpoint must be a full baseline (start, restore, abandoned checkpoint)."""
        self.state.base_step = None

    def plan(self, step: int, changed: np.ndarray | None, attempt: str) -> SavePlan:
        """Decide checkpoint `step` given the rows changed since the last one. Collective."""
        if changed is not None:
            self.state.since_base[changed] = True
            self._marked = True
            counts = self._sum(np.array([len(changed), np.count_nonzero(self.state.since_base)],
                                        dtype=np.int64))
        else:  # no row tracking on any rank (the kind is the job's): nothing to sum
            counts = np.zeros(2, dtype=np.int64)
        reason = ("first checkpoint of the chain" if self.state.base_step is None and
                  self.kind.tracks_rows else self.kind.baseline_reason(self.state, counts,
                                                                       self._max))
        if reason is not None:
            return self._baseline(step, attempt, reason)
        return self._increment(step, changed, counts)

    def _baseline(self, step: int, attempt: str, reason: str) -> SavePlan:
        s = self.state
        if self._marked:
            s.since_base[:] = False
            self._marked = False
        s.base_step, s.steps, s.name = step, [], self.kind.chain_name(step, attempt)
        self.kind.started(s)
        self._log(step, "full", reason)
        return SavePlan("full", None, [], s.name, reason, format=self.full)

    def _increment(self, step: int, changed: np.ndarray, counts) -> SavePlan:
        s = self.state
        inc = self.kind.increment(s, step, changed, counts)
        s.steps.append(step)
        reason = f"{int(counts[0])} rows changed since the last checkpoint, {int(counts[1])} " \
                 f"since the baseline at step {s.base_step}"
        self._log(step, self.kind.format, reason)
        return SavePlan(self.kind.format, np.asarray(inc.rows, dtype=np.int64), inc.parents,
                        s.name, reason, inc.columns, format=self.kind)

    def _log(self, step: int, kind: str, reason: str) -> None:
        self.decisions.append({"step": step, "kind": kind, "reason": reason})

    # ---- measurements --------------------------------------------------------------------
    def record_write(self, kind: str, seconds: float) -> None:
        """This rank's write time of a finished checkpoint (C_base or C_incre). Local."""
        self.kind.record_write(kind == "full", seconds)

    def record_restore(self, chain: str, step: int, seconds: float) -> None:
        """A measured restore of checkpoint `step`'s increments (from the extractor). Local."""
        self.kind.record_restore(chain, step, seconds)
