"""One Monte Carlo run of a job under a strategy: a discrete-event loop over failures and job-level
events, with the checkpoints between them in closed form (a `Segment`), so a run costs
O(events), not O(checkpoints). Local.

Semantics: progress is failure-free training time. Checkpoints are taken every `interval` of
progress on a grid that a rollback returns to; each costs `stall` seconds in the foreground plus
any wait for the previous write, and commits `write` seconds after its stall began (a rollback
goes to the newest committed one; a partial recovery drains the one in flight first, as mpickpt
does). Failures during a recovery's downtime find the job down and only replace the node.
`Scenario.failure_clock = 'work'` runs the failure clocks on training work instead of wall time,
and `inflight_commits` drains the checkpoint in flight before a rollback too (both as mpickpt's
in-job failure emulator does, for the cross-check with its benchmark).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from mpickpt.simulate.scenario import Scenario
from mpickpt.simulate.strategies import Strategy

EPS = 1e-9
MAX_WALL = 20.0
"""A run stops at this multiple of the failure-free time (see `RunResult.diverged`)."""


@dataclass
class Segment:
    """Training from wall time 0 at progress `p` on the checkpoint grid `origin + k interval`."""

    p: float
    origin: float
    interval: float
    rate: float
    """Progress per wall second while training (1 / (1 + upkeep))."""
    stall: float
    """Foreground seconds per checkpoint, waits for the previous write included."""
    write: float

    def __post_init__(self):
        k = math.floor((self.p - self.origin) / self.interval + EPS) + 1
        self.q = self.origin + k * self.interval  # progress of the first checkpoint
        self.a1 = (self.q - self.p) / self.rate  # wall time its stall starts
        self.cycle = self.interval / self.rate + self.stall

    def finish(self, total: float) -> float:
        """Wall time at which progress reaches `total`."""
        if total <= self.q + EPS:
            return (total - self.p) / self.rate
        taken = math.ceil((total - self.q) / self.interval - EPS)
        return (total - self.p) / self.rate + taken * self.stall

    def wall_for_work(self, w: float) -> float:
        """Wall seconds into the segment at which `w` seconds of training have been done (stalls
        are not training; a failure due when a stall is due comes before it)."""
        if w <= self.a1:
            return w
        return w + math.ceil((w - self.a1) / (self.interval / self.rate) - EPS) * self.stall

    def at(self, dt: float) -> tuple[float, float | None, float | None, int, float]:
        """(progress, newest committed checkpoint, newest taken one, checkpoints taken, stall
        seconds spent) `dt` wall seconds in."""
        tol = EPS * max(1.0, dt)  # a stall due exactly at `dt` has not begun
        if dt <= self.a1 + tol:
            return self.p + dt * self.rate, None, None, 0, 0.0
        j = math.floor((dt - self.a1 - tol) / self.cycle) + 1
        r = dt - self.a1 - (j - 1) * self.cycle
        base = self.q + (j - 1) * self.interval
        if r < self.stall:
            progress, spent = base, (j - 1) * self.stall + r
        else:
            progress, spent = base + (r - self.stall) * self.rate, j * self.stall
        done = dt - self.a1 - self.write
        committed_n = min(j, math.floor(done / self.cycle) + 1) if done >= 0 else 0
        committed = self.q + (committed_n - 1) * self.interval if committed_n else None
        return progress, committed, base, j, spent


@dataclass
class RunResult:
    wall: float = 0.0
    save: float = 0.0
    lost: float = 0.0
    recovery: float = 0.0
    job: float = 0.0
    upkeep: float = 0.0
    pls: float = 0.0
    failures: int = 0
    kinds: dict = field(default_factory=lambda: {"rollback": 0, "partial": 0, "rebuild": 0})
    job_ends: int = 0
    checkpoints: int = 0
    diverged: bool = False
    """The job had not finished after MAX_WALL x its failure-free time (failures come faster
    than it recovers): its overhead is a lower bound."""


class NodeClocks:
    """Each node's next failure time; a replaced node starts a fresh renewal. Local."""

    def __init__(self, sc: Scenario, rng: np.random.Generator):
        self.sc, self.rng = sc, rng
        self.scale = sc.node_mtbf / sc.shape
        self.next = rng.gamma(sc.shape, self.scale, sc.nodes)
        self.heap = [(float(t), n) for n, t in enumerate(self.next)]
        heapq.heapify(self.heap)

    def peek(self) -> tuple[float, int]:
        while self.heap[0][0] != self.next[self.heap[0][1]]:
            heapq.heappop(self.heap)  # stale entry of a replaced node
        return self.heap[0]

    def renew(self, node: int, now: float) -> None:
        self.next[node] = now + self.rng.gamma(self.sc.shape, self.scale)
        heapq.heappush(self.heap, (float(self.next[node]), node))

    def failed_with(self, node: int) -> list[int]:
        """The nodes one failure takes: `node`, and its neighbours in a multi-node failure."""
        sc = self.sc
        if sc.nodes > 1 and self.rng.random() < sc.multi_prob:
            return [(node + i) % sc.nodes for i in range(min(sc.multi_nodes, sc.nodes))]
        return [node]


def simulate_run(strategy: Strategy, sc: Scenario, rng: np.random.Generator) -> RunResult:
    """One job from start to `sc.train_seconds` of progress. Local."""
    plan, total = strategy.plan, sc.train_seconds
    rate = 1.0 / (1.0 + plan.upkeep)
    wait = max(0.0, plan.write - plan.interval / rate)
    stall = plan.stall + wait
    clocks, res = NodeClocks(sc, rng), RunResult()
    t = p = origin = committed = work = 0.0
    by_work = sc.failure_clock == "work"
    have_ckpt = False  # until a checkpoint commits, a recovery has nothing to read
    limit = sc.time_limit if sc.time_limit > 0 else math.inf
    alloc_end = limit
    preempt = rng.exponential(sc.preempt_mtbf) if sc.preempt_mtbf > 0 else math.inf
    rebuild_until = -math.inf
    while True:
        seg = Segment(p, origin, plan.interval, rate, stall, plan.write)
        f_time, f_node = clocks.peek()
        if by_work:  # the node clock counts training work: its wall time in this segment
            f_time = t + seg.wall_for_work(f_time - work)
        elif f_time < t:  # failed while the job was down: replaced before it restarts
            clocks.renew(f_node, t)
            continue
        job_t = min(alloc_end, preempt)
        done_t = t + seg.finish(total)
        ev = min(f_time, job_t, done_t)
        progress, com, taken, n, spent = seg.at(ev - t)
        res.save += spent
        res.checkpoints += n
        committed = com if com is not None else committed
        have_ckpt = have_ckpt or com is not None
        work += ev - t - spent
        t = ev
        if ev == done_t:
            break
        if t > MAX_WALL * total:
            res.diverged = True
            break
        p = progress
        if ev == job_t:  # emergency checkpoint of the current step, requeue, relaunch, restore
            cost = strategy.job_end()
            res.job += cost
            res.job_ends += 1
            t += cost
            committed = origin = p
            have_ckpt = True
            alloc_end = t + limit
            if ev == preempt:
                preempt = t + rng.exponential(sc.preempt_mtbf)
            continue
        nodes = clocks.failed_with(f_node)
        res.failures += 1
        reaction = strategy.react(nodes, t < rebuild_until)
        res.kinds[reaction.kind] += 1
        if reaction.kind == "partial" or sc.inflight_commits:
            # the checkpoint in flight is drained first (a real failure's rollback loses it)
            committed = taken if taken is not None else committed
            have_ckpt = have_ckpt or taken is not None
        if reaction.kind == "rollback":
            res.lost += (p - committed) / rate
            p = committed
        elif reaction.kind == "partial":
            res.pls += sc.failure_share(len(nodes)) * (p - committed) / total
        wall = reaction.wall if have_ckpt else reaction.wall - reaction.load
        res.recovery += wall
        t += wall
        if reaction.kind == "rebuild":
            rebuild_until = t + reaction.window
        for node in nodes:
            clocks.renew(node, work if by_work else t)
    res.wall = t
    res.upkeep = total * (1.0 / rate - 1.0)
    return res
