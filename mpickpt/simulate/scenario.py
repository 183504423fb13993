"""Scenario: the job and its failure environment, in seconds (all fields have a source).

Failures are per node (a node holds `ranks_per_node` ranks, all lost together): each node's times
between failures are gamma(shape, node MTBF / shape), renewed when the node is replaced (shape 1 =
exponential). With probability `multi_prob` a failure takes `multi_nodes` neighbouring nodes with
it (a switch or a rack). Job-level events: the allocation's time limit, and preemption as a Poisson
process; both end the job with a warning (Slurm's signal before the kill), so the job writes an
emergency checkpoint and is requeued. Local.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

HOUR = 3600.0

CPR_NODE_MTBF_H = 28.0 * 32
"""CPR §3.1: production jobs' MTBF is 14-30 h (28 h in its evaluation, §5.1); its evaluated jobs
have 16 trainers + 18 embedding servers (§5.1), i.e. about 32 nodes: a node MTBF of 28 h x 32."""
LLAMA3_NODE_MTBF_H = 54 * 24 / 419 * (16384 / 8)
"""Llama 3 (Meta, 2024, §3.3.4): 419 unexpected interruptions in 54 days on 16,384 H100s, i.e. a
job MTBF of 3.1 h over 2,048 nodes of 8: a node MTBF of about 6,300 h."""
MTBF_PRESETS = {"cpr": CPR_NODE_MTBF_H, "llama3": LLAMA3_NODE_MTBF_H}


@dataclass(frozen=True)
class Scenario:
    """One job: its size, length and failure environment. Times in seconds."""

    ranks: int
    train_seconds: float = 7 * 24 * HOUR
    """Failure-free training time of the job (a week by default)."""
    ranks_per_node: int = 8
    node_mtbf: float = CPR_NODE_MTBF_H * HOUR
    shape: float = 0.68
    """Gamma shape of a node's times between failures (CPR's fitted 0.68; 1 = exponential)."""
    multi_prob: float = 0.05
    """Share of failures that also take neighbouring nodes (assumed: switch or rack faults)."""
    multi_nodes: int = 4
    """Nodes a multi-node failure takes in all (assumed: a rack of 4 nodes)."""
    time_limit: float = 48 * HOUR
    """Wall time of one allocation before Slurm ends it (0: none); a common site maximum."""
    preempt_mtbf: float = 0.0
    """Mean time between preemptions of the job (0: none)."""
    lost_share: float = 0.0
    """Share of the embedding rows every failure loses when it is fixed (the partial-recovery
    benchmark's --failure-fraction); 0: the share of the nodes the failure takes."""
    failure_clock: str = "wall"
    """'wall': failures come in wall-clock time (real failures); 'work': in time spent training,
    replays included, checkpoint stalls and recoveries not (mpickpt's in-job failure emulator)."""
    inflight_commits: bool = False
    """A failure lets the checkpoint being written commit before the rollback (failures emulated
    inside a running job: the writers survive); a real failure loses it."""
    spare_nodes: int = 0
    """Nodes of hot spares standing by (`--spares`): a failure of at most this many nodes is
    replaced in place by warm spares (EventCosts.in_place) instead of waiting `reschedule` for a
    node; the pool is assumed refilled before the next failure (the scheduler hands a node back
    within a job MTBF)."""
    target_pls: float = 0.02
    """PLS a partial-recovery strategy may reach (CPR §6: 0.02 keeps AUC within 0.0003); also the
    accuracy bound under which strategies are ranked."""

    def __post_init__(self):
        if self.ranks < 1 or self.ranks_per_node < 1:
            raise ValueError(f"ranks and ranks per node must be >= 1, got {self.ranks}, "
                             f"{self.ranks_per_node}")
        if not (self.train_seconds > 0 and self.node_mtbf > 0 and self.shape > 0):
            raise ValueError("training time, node MTBF and shape must be > 0")
        if not 0 <= self.multi_prob <= 1:
            raise ValueError(f"multi_prob must lie in [0, 1], got {self.multi_prob}")
        if self.failure_clock not in ("wall", "work"):
            raise ValueError(f"failure_clock must be 'wall' or 'work', got "
                             f"{self.failure_clock!r}")
        if self.spare_nodes < 0:
            raise ValueError(f"spare_nodes must be >= 0, got {self.spare_nodes}")
        if not 0 <= self.lost_share <= 1:
            raise ValueError(f"lost_share must lie in [0, 1], got {self.lost_share}")

    @property
    def nodes(self) -> int:
        return math.ceil(self.ranks / self.ranks_per_node)

    @property
    def job_mtbf(self) -> float:
        """Mean time between failures of the whole job (superposed renewal processes)."""
        return self.node_mtbf / self.nodes

    @property
    def node_share(self) -> float:
        """Share of the embedding rows one node holds."""
        return min(1.0, self.ranks_per_node / self.ranks)

    def failure_share(self, nodes: int) -> float:
        """Share of the rows a failure of `nodes` nodes loses."""
        return self.lost_share or min(1.0, nodes * self.node_share)

    def expected_lost_share(self) -> float:
        """Mean share of the rows one failure loses (multi-node failures included)."""
        if self.lost_share:
            return self.lost_share
        nodes = (1 - self.multi_prob) + self.multi_prob * min(self.multi_nodes, self.nodes)
        return min(1.0, nodes * self.node_share)

    def with_(self, **kw) -> "Scenario":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)
