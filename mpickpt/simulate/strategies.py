"""The fault-tolerance strategies mpickpt offers, as the simulator sees them: how often each saves,
what a save costs in the foreground and in the background, what a failure costs it, and what a
time limit or preemption costs it. One class per strategy; `STRATEGIES` names them. Local.

Reactions to a failure of some nodes:
- rollback: every rank reloads the newest committed checkpoint; the work since it is lost;
- partial (CPR): only the failed nodes' shards reload it; nobody loses work, the PLS grows by the
  lost share x the samples since that checkpoint;
- rebuild (ECRM): the failed nodes' rows are decoded from parity while training goes on; nothing
  is lost, unless a group lost more than r nodes or a rebuild was still running (then rollback).
Each reaction first replaces the failed nodes: warm hot spares in place (`Scenario.spare_nodes`,
`EventCosts.in_place`: rendezvous and groups of the next generation) or a rescheduled node.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from mpickpt.recovery.config import DEFAULT_TARGET_PLS
from mpickpt.recovery.cpr_model import (Costs, benefit_check, expected_pls, pls_interval,
                                        young_interval)
from mpickpt.simulate.costs import EventCosts
from mpickpt.simulate.scenario import Scenario


REBUILD_BUDGET = 0.07
"""mpickpt's default --rebuild-budget (`ParityConfig.budget`): a rebuild round takes at most 0.07
of a step."""


@dataclass(frozen=True)
class Reaction:
    kind: str
    """'rollback', 'partial' or 'rebuild'."""
    wall: float
    """Seconds the job stands still (for a rebuild: replacing the node plus the rebuild's work,
    which runs inside the following steps)."""
    window: float = 0.0
    """Seconds after `wall` during which the recovery is still running (a parity rebuild spread
    over steps at --rebuild-budget): another failure then cannot be rebuilt."""
    load: float = 0.0
    """The part of `wall` that reads a checkpoint (before the first one there is none to read:
    the lost rows start again from their initial values)."""


@dataclass(frozen=True)
class SavePlan:
    interval: float
    """Progress seconds between checkpoints."""
    stall: float
    """Foreground seconds per checkpoint (mean over baselines and increments)."""
    write: float
    """Background seconds per checkpoint until it commits (mean)."""
    bytes: float
    """Bytes per checkpoint (mean), whole job."""
    storage: float
    """Bytes kept to restore the newest checkpoint (its baseline and increments)."""
    upkeep: float = 0.0
    """Share added to every step (parity, priority trackers)."""

    def with_(self, **kw) -> "SavePlan":
        return replace(self, **kw)


def young_with_writes(stall: float, write: float, mtbf: float) -> float:
    """Young's interval when a checkpoint cannot start before the previous one's write is done,
    so that O_save = stall + the wait max(0, write - T), as the trainer measures it and re-plans
    from: the T that minimises O_save(T) / T + T / (2 T_fail). Local."""
    t = young_interval(stall, mtbf)
    if t >= write:
        return t

    def cost(t: float) -> float:
        return (stall + max(0.0, write - t)) / t + t / (2.0 * mtbf)
    waiting = young_interval(stall + write, mtbf)  # the optimum while every save waits
    return min((c for c in (write, waiting) if c <= write), key=cost)


class Strategy:
    """Full checkpoints at Young's interval, full rollback on every failure."""

    name = "full"
    label = "full checkpoints at Young's interval, full rollback"
    pls_saves = False
    """Partial recoveries count the samples since the newest (prioritized) save."""

    def __init__(self, sc: Scenario, ec: EventCosts):
        self.sc, self.ec = sc, ec
        self.plan = self.save_plan()

    def save_plan(self) -> SavePlan:
        ec = self.ec
        return SavePlan(young_with_writes(ec.stall, ec.write, self.sc.job_mtbf), ec.stall,
                        ec.write, ec.full_bytes, ec.full_bytes)

    def load(self) -> float:
        """A full rollback's restore."""
        return self.ec.load

    def replace(self, nodes: list[int]) -> float:
        """Seconds until the failed nodes' ranks are back: warm spares in place when the
        scenario has enough spare nodes, else a rescheduled node (CPR's O_res)."""
        if len(nodes) <= self.sc.spare_nodes:
            return self.ec.in_place(self.sc.ranks)
        return self.ec.reschedule

    def react(self, nodes: list[int], rebuilding: bool) -> Reaction:
        load = self.load()
        return Reaction("rollback", self.replace(nodes) + load, load=load)

    def job_end(self) -> float:
        """A time limit or preemption: an emergency checkpoint in the signal's grace time,
        requeue, relaunch and restore (nothing is lost)."""
        p = self.plan
        return p.stall + p.write + self.ec.requeue + self.ec.relaunch + self.load()


def saved_share(ec: EventCosts) -> float:
    """Mean share of a full checkpoint one save of an incremental chain writes: a baseline every
    `baseline_every` saves, increments of `incr_share` between. Local."""
    b = ec.baseline_every
    return (1 + (b - 1) * ec.incr_share) / b


class CheckNRun(Strategy):
    name = "cnr"
    label = "Check-N-Run: incremental + 4-bit quantized, full rollback"

    def save_plan(self) -> SavePlan:
        ec, b = self.ec, self.ec.baseline_every
        share = saved_share(ec)
        stall, write = ec.stall * share, ec.write * share * ec.quant_ratio
        chain = ec.full_bytes * ec.quant_ratio * (1 + (b - 1) / 2 * ec.incr_share)
        return SavePlan(young_with_writes(stall, write, self.sc.job_mtbf), stall, write,
                        ec.full_bytes * share * ec.quant_ratio, chain)

    def load(self) -> float:
        b = self.ec.baseline_every  # baseline plus half a chain of increments on average
        return self.ec.load * self.ec.quant_ratio * (1 + (b - 1) / 2 * self.ec.incr_share)


class IncrCP(Strategy):
    name = "incrcp"
    label = "IncrCP: lossless increments in 2-D chunks, full rollback"

    def save_plan(self) -> SavePlan:
        ec = self.ec
        share = saved_share(ec)
        return SavePlan(young_with_writes(ec.stall * share, ec.write * share, self.sc.job_mtbf),
                        ec.stall * share, ec.write * share, ec.full_bytes * share,
                        ec.full_bytes * (1 + ec.incr_share))

    def load(self) -> float:
        # the baseline plus the rectangle of chunks current at the checkpoint (IncrCP §4)
        return self.ec.load * (1 + self.ec.incr_share)


class Parity(Strategy):
    """ECRM: parity groups of k data + r parity nodes (one rank per node and group), full
    checkpoints at Young's interval below it."""

    name = "parity"

    def __init__(self, sc, ec, k: int = 4, r: int = 1):
        self.k, self.r, self.name = k, r, f"parity-k{k}r{r}"
        self.label = f"ECRM parity k={k}, r={r}, falling back to full rollback"
        super().__init__(sc, ec)

    def save_plan(self) -> SavePlan:
        return super().save_plan().with_(upkeep=self.ec.parity_upkeep)

    def covers(self, nodes: list[int], rebuilding: bool) -> bool:
        if rebuilding or self.sc.nodes < self.k + self.r:
            return False
        groups: dict[int, int] = {}
        for n in nodes:
            groups[n // (self.k + self.r)] = groups.get(n // (self.k + self.r), 0) + 1
        return max(groups.values()) <= self.r

    def react(self, nodes, rebuilding):
        if self.covers(nodes, rebuilding):
            work = self.ec.rebuild_node * len(nodes)
            return Reaction("rebuild", self.replace(nodes) + work, work / REBUILD_BUDGET)
        return super().react(nodes, rebuilding)


class Partial(Strategy):
    """CPR-vanilla: full checkpoints at the PLS interval (eq. 4), partial recovery."""

    name = "cpr"
    label = "CPR partial recovery at the target PLS"

    def save_plan(self) -> SavePlan:
        ec = self.ec
        t = pls_interval(self.sc.target_pls, self.sc.job_mtbf, self.sc.expected_lost_share())
        return SavePlan(t, ec.stall, ec.write, ec.full_bytes, ec.full_bytes)

    def react(self, nodes, rebuilding):
        load = self.ec.load_node * len(nodes)
        return Reaction("partial", self.replace(nodes) + load, load=load)


class Prioritized(Partial):
    """CPR-MFU / CPR-SSU: r x N rows of each table 1/r times as often (the same bandwidth)."""

    pls_saves = True

    def __init__(self, sc, ec, rule: str = "mfu"):
        self.name, self.rule = f"cpr-{rule}", rule
        self.label = f"CPR-{rule.upper()}: prioritized partial saves, partial recovery"
        super().__init__(sc, ec)

    def save_plan(self) -> SavePlan:
        base, r = super().save_plan(), self.ec.priority_fraction
        return SavePlan(base.interval * r, base.stall * r, base.write * r, base.bytes * r,
                        base.bytes * 2, self.ec.priority_upkeep.get(self.rule, 0.0))

    def react(self, nodes, rebuilding):
        # the baseline and the prioritized saves since (about one baseline's worth of rows)
        load = 2 * self.ec.load_node * len(nodes)
        return Reaction("partial", self.replace(nodes) + load, load=load)


class Survivors(Partial):
    """Real process failures: the job dies, the survivors dump their state to node-local memory,
    the job is relaunched, the survivors read their dumps and the dead ranks reload their shards
    from the checkpoint (partial recovery across the relaunch, at the PLS interval)."""

    name = "survivors"
    label = "survivor dumps across a relaunch + partial recovery"

    def react(self, nodes, rebuilding):
        ec = self.ec
        load = ec.load_node * len(nodes)
        return Reaction("partial", ec.dump + ec.relaunch + ec.dump_load + load, load=load)


class Auto(Strategy):
    """`--recovery auto` with its defaults (no parity): CPR's benefit check between partial
    recovery at the default target PLS and full recovery at Young's interval, from the costs the
    job measures (here: the predicted ones)."""

    name = "auto"
    label = "--recovery auto (defaults)"

    def __init__(self, sc, ec):
        share = sc.expected_lost_share()  # the job's estimate before it measures one
        replace = ec.in_place(sc.ranks) if sc.spare_nodes else ec.reschedule
        costs = Costs(save=ec.stall, load=ec.load, reschedule=replace, mtbf=sc.job_mtbf,
                      total=sc.train_seconds, partial_load=ec.load * share)
        self.decision = benefit_check(costs, DEFAULT_TARGET_PLS, sc.expected_lost_share())
        inner = Partial if self.decision.mode == "partial" else Strategy
        self.inner = inner(sc.with_(target_pls=DEFAULT_TARGET_PLS), ec)
        super().__init__(sc, ec)

    def save_plan(self) -> SavePlan:
        return self.inner.plan

    def react(self, nodes, rebuilding):
        return self.inner.react(nodes, rebuilding)

    @property
    def mode(self) -> str:
        return self.decision.mode


STRATEGIES = {
    "full": Strategy, "cnr": CheckNRun, "incrcp": IncrCP,
    "parity-k4r1": lambda sc, ec: Parity(sc, ec, 4, 1),
    "parity-k8r2": lambda sc, ec: Parity(sc, ec, 8, 2),
    "cpr": Partial, "cpr-mfu": lambda sc, ec: Prioritized(sc, ec, "mfu"),
    "cpr-ssu": lambda sc, ec: Prioritized(sc, ec, "ssu"), "survivors": Survivors, "auto": Auto,
}
"""Name -> constructor(scenario, event costs)."""


def build(name: str, sc: Scenario, ec: EventCosts) -> Strategy:
    """The strategy `name`; ValueError naming the known ones. Local."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return STRATEGIES[name](sc, ec)


def analytic_pls(strategy: Strategy) -> float:
    """CPR eq. 4 for a partial strategy at its interval (0 for the others). Local."""
    if not isinstance(strategy, Partial):
        return 0.0
    return expected_pls(strategy.plan.interval, strategy.sc.job_mtbf,
                        strategy.sc.expected_lost_share())
