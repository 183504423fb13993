"""RecoveryPlanner: the checkpoint interval and, for `--recovery auto`, the recovery mode, planned
from what the running job measures (`recovery.cpr_model`).

At every checkpoint the ranks agree on their measurements with one allreduce (the slowest rank's
save, restore and write times, and step time), convert them to steps, and re-plan:

- `--ckpt-interval auto`: Young's interval sqrt(2 O_save T_fail);
- `--target-pls P` (partial recovery): CPR's 2 P T_fail / L, L the share of the embedding shards
  one failure loses;
- `--recovery auto`: CPR's benefit check, which picks partial or full recovery and the interval
  of the mode it picks (a fixed --ckpt-interval stays fixed).

A kind whose saves write only a share s of the rows (prioritized saves) saves s times as often,
for the save bandwidth of full checkpoints at the planned interval (CPR §6.1: 8 times as often, at
most 1/8 of the rows).

Each cost is the median of its last `WINDOW` measurements (one slow save on a busy machine should
not halve the interval). O_load is the measured restore time, or, before any restore, the
checkpoint write time (reading a checkpoint back is rarely slower than writing it).

Logging: every plan goes into `history` with its inputs (the run report's `plans`). The log gets a
plan line, with its inputs, when it is the first, when `--recovery auto` changes mode, or when the
interval has moved by a quarter or more since the last logged line: the measured costs jitter from
save to save, and a line at every save (next to the save's own line) would bury the moves that
matter. At the end of the run, `summary()` logs the last plan with its inputs and how many
re-plans there were.
"""
from __future__ import annotations

import numpy as np

from mpickpt.durations import StepClock
from mpickpt.recovery.cpr_model import Costs, Decision, benefit_check, pls_interval, young_interval

WINDOW = 5
"""Measurements each cost is the median of."""
LOG_CHANGE = 0.25
"""Relative change of the interval that is logged again."""


class RecoveryPlanner:
    """Collective `after_save`; everything else local."""

    def __init__(self, topo, config, mode: str, ckpt, restorer, clock: StepClock, mtbf,
                 lost_share: float, total_steps: int, say, reduce_max=None):
        """`reduce_max`: the collective elementwise max of a float64 array over the ranks
        (default: an Allreduce on `topo.control`)."""
        self.topo, self.config, self.mode = topo, config, mode
        self.reduce_max = reduce_max or _allreduce_max(topo)
        self.ckpt, self.restorer, self.clock = ckpt, restorer, clock
        self.mtbf, self.lost_share, self.total_steps, self.say = mtbf, lost_share, total_steps, say
        self.fixed = ckpt.config.fixed_interval if ckpt is not None else None
        self.young = ckpt is not None and ckpt.config.auto_interval
        self.pls = config.target_pls is not None
        self.decision: Decision | None = None
        self.history: list[dict] = []
        self._logged_interval: int | None = None
        self._step_seconds = 0.0

    @property
    def plans_interval(self) -> bool:
        """It sets the checkpoint interval (none is fixed, and something plans one). Local."""
        return self.fixed is None and (self.young or self.pls or self.mode == "auto")

    @property
    def watches_saves(self) -> bool:
        """It re-plans after every save (`after_save`): where it sets the interval, and for
        `--recovery auto`, whose benefit check picks the mode under a fixed interval too.
        Local."""
        return self.plans_interval or self.mode == "auto"

    def first_interval(self, default: int) -> int:
        """The interval until the first checkpoint measures O_save: CPR's when it needs no
        measurement (T_fail in steps or emulated hours), else a fiftieth of the run (an early
        first measurement), at most `default`. Local."""
        mtbf = self.clock.steps(self.mtbf) if self.mtbf is not None else None
        if self.pls and self.mode == "partial" and mtbf is not None:
            return max(1, round(self.share * pls_interval(self.config.target_pls, mtbf,
                                                          self.lost_share)))
        return max(1, min(default, -(-self.total_steps // 50)))

    @property
    def share(self) -> float:
        return self.ckpt.kind.save_share if self.ckpt is not None else 1.0

    def after_save(self, step: int) -> None:
        """Re-plan after the checkpoint taken at `step`. Collective."""
        costs = self._costs()
        if costs is None:
            return
        interval = None
        mode_changed = False
        if self.mode == "auto":
            decision = benefit_check(costs, self.config.pls_target, self.lost_share,
                                     fixed=self.fixed)
            mode_changed = self.decision is None or decision.mode != self.decision.mode
            if mode_changed:
                self.say(decision.explain())
            self.decision = decision
            interval = decision.interval
        elif self.pls and self.mode == "partial":
            interval = pls_interval(self.config.target_pls, costs.mtbf, self.lost_share)
        elif self.young:
            interval = young_interval(costs.save, costs.mtbf)
        if interval is None or self.fixed is not None:
            self._record(step, costs, interval, None)
            return
        self.ckpt.schedule.replan(interval * self.share, step)
        now, last = self.ckpt.schedule.interval, self._logged_interval
        self._record(step, costs, interval, now)
        if last is None or mode_changed or abs(now - last) >= LOG_CHANGE * last:
            self._logged_interval = now
            self.say(self.plan_line())

    def _record(self, step: int, costs: Costs, interval, planned) -> None:
        self.history.append({"step": step, "costs": costs.__dict__, "interval": interval,
                             "planned": planned, "why": self._why(costs),
                             "mode": self.decision.mode if self.decision else self.mode})

    def plan_line(self) -> str:
        """The newest plan with its inputs, for the log. Local."""
        last = self.history[-1]
        return f"checkpoint interval: {last['planned']} steps ({last['why']})"

    def summary(self) -> list[str]:
        """Lines for the end of the run: the last plan with its inputs and the number of re-plans
        (one per save). Local."""
        planned = [h for h in self.history if h["planned"] is not None]
        if not planned:
            return []
        sizes = [h["planned"] for h in planned]
        return [f"checkpoint planning: {len(planned)} re-plans, interval {min(sizes)}.."
                f"{max(sizes)} steps; last at step {planned[-1]['step']}: "
                f"{planned[-1]['planned']} steps ({planned[-1]['why']})"]

    def _why(self, c: Costs) -> str:
        scaled = f", x {self.share:g} for saves of that share of the rows" \
            if self.share < 1 else ""
        return f"{self._rule(c)}{scaled}; step {self._step_seconds:.4f} s"

    def _rule(self, c: Costs) -> str:
        if self.mode == "auto":
            return (f"{self.decision.mode} recovery chosen by CPR's benefit check: "
                    f"{self.decision.inputs()}")
        if self.pls and self.mode == "partial":
            return (f"CPR eq. 4: 2 x PLS {self.config.target_pls:g} x T_fail {c.mtbf:.1f} / "
                    f"lost share {self.lost_share:.3f}")
        return f"Young: sqrt(2 x O_save {c.save:.3f} x T_fail {c.mtbf:.1f}) in steps"

    def _costs(self) -> Costs | None:
        """The agreed measurements in steps, or None while T_fail cannot be expressed in steps
        yet. Collective."""
        ck, rs = self.ckpt, self.restorer
        local = np.array([_recent(ck.save_seconds), _recent(rs.seconds),
                          _recent(ck.write_seconds), self.clock.seconds_per_step or 0.0,
                          _recent(rs.partial_seconds)])
        save_s, load_s, write_s, step_s, partial_s = self.reduce_max(local).tolist()
        self._step_seconds = step_s
        clock = StepClock(self.clock.hours_per_step)
        clock.seconds_per_step = step_s or None
        mtbf = clock.steps(self.mtbf) if self.mtbf is not None else None
        if mtbf is None or not step_s:
            return None
        steps = clock.real_steps
        load = steps(load_s or write_s)
        # until a partial restore is measured: it reads the lost share of the rows
        partial = steps(partial_s) if partial_s else load * self.lost_share
        return Costs(save=steps(save_s), load=load,
                     reschedule=clock.steps(self.config.reschedule) or 0.0, mtbf=mtbf,
                     total=float(self.total_steps), partial_load=partial)

    def mode_for_loss(self) -> str:
        """'partial' or 'full' for a loss parity does not cover (auto). Local."""
        return self.decision.mode if self.decision is not None else "partial"


def _recent(values: list[float]) -> float:
    """The median of the last WINDOW measurements (0 without any). Local."""
    return float(np.median(values[-WINDOW:])) if values else 0.0


def _allreduce_max(topo):
    """The elementwise max over the ranks of `topo.control`. Collective when called."""
    def reduce(values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        topo.control.Allreduce(values, out, op="max")
        return out
    return reduce
