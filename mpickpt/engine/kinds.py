"""Checkpoint kinds: which rows each checkpoint writes and what it builds on (Check-N-Run §4.1,
IncrCP §4.5).

- ``full``: every row, every time.
- ``differential`` (Check-N-Run's one-shot baseline): a full baseline, then rows changed since it.
- ``consecutive``: a full baseline, then rows changed since the previous checkpoint.
- ``intermittent``: differential, with Check-N-Run's history predictor taking a new full baseline
  when F_c <= I_c (F_c = 1 + S_1 + ... + S_i, I_c = (i + 1) S_i, sizes as fractions of the model).
- ``incrcp``: consecutive increments kept in IncrCP's 2-D chunk store, with its cost model: a new
  baseline when C_base + R_base < C_incre + R_base + R_{i+1}, R_{i+1} extrapolated linearly from
  the last two measured restores of the chain's checkpoints.

Every run starts with a full baseline (a restored model or a new plan invalidates the tracking), and
so does the first checkpoint after one that was abandoned (its rows were cleared from the tracker).
`plan` is collective (one allreduce), so every rank takes the same decision.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KINDS = ("full", "differential", "consecutive", "intermittent", "incrcp")
INCRCP_RESETS = ("cost", "never")
"""incrcp baseline resets: IncrCP's cost model, or one chain for the whole run."""


@dataclass
class SavePlan:
    """What one checkpoint writes."""

    kind: str
    """Format of this checkpoint: 'full', 'differential', 'consecutive' or 'incrcp'."""
    rows: np.ndarray | None
    """Sorted local rows to write, or None for every row."""
    parents: list[int]
    chain: str
    reason: str
    columns: list[int] = field(default_factory=list)
    """incrcp: the chain's incremental steps up to and including this one (its 2-D list columns)."""

    @property
    def is_full(self) -> bool:
        return self.kind == "full"


@dataclass
class CostModel:
    """IncrCP's construction/recovery times (seconds; the slowest rank's after the allreduce)."""

    base_write: float = 0.0
    incr_write: float = 0.0
    restores: list[tuple[int, float]] = field(default_factory=list)
    """(checkpoint step, measured restore seconds of its increments) of the current chain."""

    def predicted_restore(self) -> float:
        """R_{i+1}: linear extrapolation of the last two measured restores. Local."""
        if not self.restores:
            return 0.0
        if len(self.restores) == 1:
            return self.restores[-1][1]
        (_, r0), (_, r1) = self.restores[-2:]
        return max(r1, r1 + (r1 - r0))


class KindPlanner:
    """Chooses each checkpoint's kind and rows for one rank; decisions agree across ranks."""

    def __init__(self, policy: str, local_rows: int, total_rows: int, allreduce_sum, allreduce_max,
                 incrcp_reset: str = "cost"):
        if policy not in KINDS:
            raise ValueError(f"--ckpt-kind must be one of {', '.join(KINDS)}, got {policy!r}")
        if incrcp_reset not in INCRCP_RESETS:
            raise ValueError(f"--incrcp-reset must be 'cost' or 'never', got {incrcp_reset!r}")
        self.policy, self.total_rows, self.incrcp_reset = policy, total_rows, incrcp_reset
        self._sum, self._max = allreduce_sum, allreduce_max
        self.since_base = np.zeros(local_rows, dtype=bool)
        self.base_step: int | None = None
        self.chain_steps: list[int] = []
        self.chain = ""
        self.sizes: list[float] = []
        self.cost = CostModel()
        self.decisions: list[dict] = []

    @property
    def tracks_rows(self) -> bool:
        return self.policy != "full"

    def reset(self) -> None:
        """The next checkpoint must be a full baseline (start, restore, abandoned checkpoint)."""
        self.base_step = None

    def plan(self, step: int, changed: np.ndarray | None, attempt: str) -> SavePlan:
        """Decide checkpoint `step` given the rows changed since the last one. Collective."""
        if changed is not None:
            self.since_base[changed] = True
        counts = self._sum(np.array([len(changed) if changed is not None else 0,
                                     int(self.since_base.sum())], dtype=np.int64))
        full, reason = self._wants_full(counts)
        if full:
            return self._baseline(step, attempt, reason)
        return self._increment(step, changed, counts)

    def _wants_full(self, counts) -> tuple[bool, str]:
        if self.policy == "full":
            return True, "policy full"
        if self.base_step is None:
            return True, "first checkpoint of the chain"
        if self.policy == "intermittent" and self.sizes:
            i = len(self.sizes)
            f_c, i_c = 1.0 + sum(self.sizes), (i + 1) * self.sizes[-1]
            if f_c <= i_c:
                return True, f"predictor: F_c {f_c:.3f} <= I_c {i_c:.3f}"
        if self.policy == "incrcp" and self.incrcp_reset == "cost" and self.chain_steps:
            c_base, c_incr, r_next = self._max(np.array(
                [self.cost.base_write, self.cost.incr_write, self.cost.predicted_restore()]))
            if c_base < c_incr + r_next:
                return True, (f"cost model: C_base {c_base:.3f} s < C_incre {c_incr:.3f} s + "
                              f"R_next {r_next:.3f} s")
        return False, ""

    def _baseline(self, step: int, attempt: str, reason: str) -> SavePlan:
        self.since_base[:] = False
        self.base_step, self.chain_steps, self.sizes = step, [], []
        self.cost.restores = []
        self.chain = f"chain-{step:012d}-{attempt}" if self.policy == "incrcp" else ""
        self._log(step, "full", reason)
        return SavePlan("full", None, [], self.chain, reason)

    def _increment(self, step: int, changed: np.ndarray, counts) -> SavePlan:
        kind = {"intermittent": "differential"}.get(self.policy, self.policy)
        if kind == "differential":
            rows = np.nonzero(self.since_base)[0]
            parents = [self.base_step]
            self.sizes.append(int(counts[1]) / max(self.total_rows, 1))
        elif kind == "consecutive":
            rows, parents = changed, [self.base_step, *self.chain_steps]
        else:  # incrcp: the chunk index, not earlier manifests, locates the increments
            rows, parents = changed, [self.base_step]
        self.chain_steps.append(step)
        reason = f"{int(counts[0])} rows changed since the last checkpoint, {int(counts[1])} " \
                 f"since the baseline at step {self.base_step}"
        self._log(step, kind, reason)
        columns = list(self.chain_steps) if kind == "incrcp" else []
        return SavePlan(kind, np.asarray(rows, dtype=np.int64), parents, self.chain, reason, columns)

    def _log(self, step: int, kind: str, reason: str) -> None:
        self.decisions.append({"step": step, "kind": kind, "reason": reason})

    # ---- measurements --------------------------------------------------------------------
    def record_write(self, kind: str, seconds: float) -> None:
        """This rank's write time of a finished checkpoint (C_base or C_incre). Local."""
        if kind == "full":
            self.cost.base_write = seconds
        else:
            self.cost.incr_write = seconds

    def record_restore(self, chain: str, step: int, seconds: float) -> None:
        """A measured restore of checkpoint `step`'s increments (from the extractor). Local."""
        if chain == self.chain and chain:
            self.cost.restores.append((step, seconds))
