"""The checkpoint-interval and recovery-mode models of CPR (§2.2, §4.1) and Young's interval, in
steps. Pure functions of given costs, so every rank computes the same answer from agreed inputs.

- Young: the interval minimising full recovery's overhead, T_save = sqrt(2 O_save T_fail).
- CPR eq. 1 (full recovery), overhead over a job of T_total:
  O_save T_total / T_save + (O_load + T_save / 2 + O_res) T_total / T_fail
  (the lost computation of a failure is half an interval on average).
- CPR eq. 2 (partial recovery): O_save T_total / T_save + (O_load + O_res) T_total / T_fail, with
  the O_load of a partial recovery: only the lost shards are read, which at scale is a small part
  of a full restore (with one O_load for both modes, as CPR writes it, a large job whose full
  restore is slow never passes the benefit check although partial recovery costs it far less).
- CPR eq. 4: E[PLS] = 0.5 T_save / (T_fail N_emb), so T_save = 2 PLS N_emb T_fail; with failures
  losing a share L of the embedding shards (L = 1 / N_emb for one node of N_emb), the share
  replaces 1 / N_emb: T_save = 2 PLS T_fail / L.
- The benefit check (§4.1): compute the partial interval from the target PLS, compare eq. 2 at that
  interval with eq. 1 at Young's interval, and keep partial recovery only if it saves at least
  `MIN_BENEFIT` of full recovery's overhead; otherwise use full recovery.
Local.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MIN_BENEFIT = 0.10
"""Partial recovery must cut the expected overhead by at least this share, or full recovery is
kept: it is exact, and a small gain does not pay for the accuracy partial recovery risks."""


@dataclass(frozen=True)
class Costs:
    """What the models need, every time in steps."""

    save: float
    """O_save: training time one checkpoint costs (its stall and waits)."""
    load: float
    """O_load: time to load a checkpoint at a recovery."""
    reschedule: float
    """O_res: time to replace the failed nodes (emulated in-job)."""
    mtbf: float
    """T_fail: mean time between failures of the job."""
    total: float
    """T_total: failure-free length of the job."""
    partial_load: float | None = None
    """O_load of a partial recovery, where only the lost shards are read (None: O_load)."""

    @property
    def load_partial(self) -> float:
        return self.load if self.partial_load is None else self.partial_load


@dataclass(frozen=True)
class Decision:
    """A recovery mode with its checkpoint interval and the expected overheads behind it."""

    mode: str
    """'partial' or 'full'."""
    interval: float
    """Steps between checkpoints for that mode."""
    full_overhead: float
    """Eq. 1 at Young's interval, as a share of T_total."""
    partial_overhead: float
    """Eq. 2 at the PLS interval, as a share of T_total."""
    young: float
    pls_interval: float
    expected_pls: float
    """E[PLS] of partial recovery at its interval (eq. 4)."""
    costs: Costs
    fixed: bool = False
    """Both modes weighed at the job's fixed interval (`--ckpt-interval N`): partial recovery
    then also has to meet the PLS target there."""
    target_pls: float | None = None

    def explain(self) -> str:
        """The decision and every input, for the log. Local."""
        return f"recovery auto: {self.mode} recovery ({self.inputs()})"

    def inputs(self) -> str:
        """What the decision weighed. Local."""
        c = self.costs
        weighed = (f"expected overhead full {self.full_overhead:.2%}, partial "
                   f"{self.partial_overhead:.2%} at the fixed interval {self.interval:.0f} "
                   f"steps, E[PLS] {self.expected_pls:.4f} against the target "
                   f"{self.target_pls:.4f}") if self.fixed else (
            f"expected overhead full {self.full_overhead:.2%} at Young's {self.young:.1f} "
            f"steps, partial {self.partial_overhead:.2%} at the PLS interval "
            f"{self.pls_interval:.1f} steps, E[PLS] {self.expected_pls:.4f}")
        return (f"{weighed}; O_save "
                f"{c.save:.3f}, O_load {c.load:.3f} (partial {c.load_partial:.3f}), O_res {c.reschedule:.3f}, T_fail "
                f"{c.mtbf:.1f}, T_total {c.total:.0f} steps")

    def as_dict(self) -> dict:
        return asdict(self)


def young_interval(save: float, mtbf: float) -> float:
    """sqrt(2 O_save T_fail), at least one step. Local."""
    return max(1.0, math.sqrt(2.0 * max(save, 0.0) * mtbf))


def pls_interval(target_pls: float, mtbf: float, lost_share: float) -> float:
    """CPR eq. 4 solved for T_save: 2 PLS T_fail / L, at least one step. Local."""
    return max(1.0, 2.0 * target_pls * mtbf / lost_share)


def expected_pls(interval: float, mtbf: float, lost_share: float) -> float:
    """CPR eq. 4: 0.5 T_save L / T_fail. Local."""
    return 0.5 * interval * lost_share / mtbf


def full_overhead(c: Costs, interval: float) -> float:
    """CPR eq. 1 over T_total, as a share of T_total. Local."""
    return c.save / interval + (c.load + interval / 2.0 + c.reschedule) / c.mtbf


def partial_overhead(c: Costs, interval: float) -> float:
    """CPR eq. 2 over T_total, as a share of T_total. Local."""
    return c.save / interval + (c.load_partial + c.reschedule) / c.mtbf


def benefit_check(c: Costs, target_pls: float, lost_share: float,
                  min_benefit: float = MIN_BENEFIT, fixed: float | None = None) -> Decision:
    """CPR's choice between partial and full recovery, with each mode's interval; `fixed`:
    the job's interval, at which both modes are weighed instead (partial recovery only where
    its E[PLS] there meets `target_pls`). Local."""
    if fixed is not None:
        full, part = full_overhead(c, fixed), partial_overhead(c, fixed)
        pls = expected_pls(fixed, c.mtbf, lost_share)
        mode = "partial" if part <= (1.0 - min_benefit) * full and pls <= target_pls \
            else "full"
        return Decision(mode, fixed, full, part, fixed, fixed, pls, c, True, target_pls)
    young = young_interval(c.save, c.mtbf)
    part_t = pls_interval(target_pls, c.mtbf, lost_share)
    full, part = full_overhead(c, young), partial_overhead(c, part_t)
    mode = "partial" if part <= (1.0 - min_benefit) * full else "full"
    return Decision(mode, part_t if mode == "partial" else young, full, part, young, part_t,
                    expected_pls(part_t, c.mtbf, lost_share), c)
