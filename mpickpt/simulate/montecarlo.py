"""Monte Carlo over runs: the same seed gives the same runs (one child seed per run), and every
reported quantity has its mean and a 95 % confidence interval. Local."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpickpt.simulate.costs import EventCosts
from mpickpt.simulate.engine import RunResult, simulate_run
from mpickpt.simulate.scenario import Scenario
from mpickpt.simulate.strategies import analytic_pls, build

Z95 = 1.96


@dataclass(frozen=True)
class Estimate:
    mean: float
    half: float
    """Half-width of the 95 % confidence interval of the mean."""

    @classmethod
    def of(cls, values) -> "Estimate":
        v = np.asarray(values, dtype=float)
        half = Z95 * v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("inf")
        return cls(float(v.mean()), float(half))

    def __str__(self) -> str:
        return f"{self.mean:.4g} ± {self.half:.2g}"


def run_many(strategy, sc: Scenario, runs: int, seed: int = 0) -> list[RunResult]:
    """`runs` runs of `strategy`, one child seed each (the same seed, the same runs). Local."""
    return [simulate_run(strategy, sc, np.random.default_rng(c))
            for c in np.random.SeedSequence(seed).spawn(runs)]


def simulate(name: str, sc: Scenario, ec: EventCosts, runs: int, seed: int = 0) -> dict:
    """`runs` runs of strategy `name`; their summary with confidence intervals. Local."""
    strategy = build(name, sc, ec)
    return summarize(strategy, sc, run_many(strategy, sc, runs, seed))


def summarize(strategy, sc: Scenario, results: list[RunResult]) -> dict:
    total, plan = sc.train_seconds, strategy.plan

    def est(fn) -> Estimate:
        return Estimate.of([fn(r) for r in results])
    out = {"strategy": strategy.name, "label": strategy.label, "runs": len(results),
           "overhead": est(lambda r: (r.wall - total) / total),
           "goodput": est(lambda r: total / r.wall),
           "pls": est(lambda r: r.pls), "failures": est(lambda r: r.failures),
           "parts": {k: est(lambda r, k=k: getattr(r, k) / total)
                     for k in ("save", "lost", "recovery", "job", "upkeep")},
           "rollbacks": est(lambda r: r.kinds["rollback"]),
           "diverged": sum(r.diverged for r in results) / len(results),
           "interval_s": plan.interval, "storage_bytes": plan.storage,
           "write_Bps": plan.bytes / (plan.interval + plan.stall),
           "analytic_pls": analytic_pls(strategy)}
    if hasattr(strategy, "mode"):
        out["mode"] = strategy.mode
    return out
