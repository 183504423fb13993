"""EventCosts: what each event of a simulated job costs at its size (seconds; bytes), as predicted
by `mpickpt.costmodel` for a machine preset, or given directly (cross-checks, tests). Local."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class EventCosts:
    """Per-event costs of one job size. Times in seconds of wall clock."""

    stall: float
    """Foreground cost of a full checkpoint (the snapshot), every rank at once."""
    write: float
    """Background write of a full checkpoint until it commits."""
    load: float
    """Restore of the whole model by every rank (full rollback)."""
    load_node: float
    """Reload of one node's shards while the others keep going (partial recovery)."""
    rebuild_node: float
    """Parity rebuild work for one node's ranks (runs inside training steps)."""
    parity_upkeep: float = 0.0
    """Share of a step parity upkeep adds (difference propagation)."""
    priority_upkeep: dict = field(default_factory=dict)
    """Share of a step each prioritized-save tracker adds ('mfu', 'ssu'; absent: 0)."""
    dump: float = 0.0
    """A survivor's dump of its state to node-local memory when a peer dies."""
    dump_load: float = 0.0
    """The relaunched survivor's read of its dump."""
    reschedule: float = 120.0
    """Replacing a failed node inside the job (CPR's O_res): a warm spare joins."""
    relaunch: float = 180.0
    """Relaunching the job after a process died (srun step, imports, process groups)."""
    spare_join: float = 0.5
    """A warm hot spare takes a dead rank's place in the running job (`--spares`): the next
    generation's rendezvous and groups and the state handed over; measured 0.48 s at 4 ranks
    (bench/real_failures.py, parity-spare)."""
    rendezvous_per_rank: float = 1.5 / 16384
    """The part of forming a generation that grows with the ranks (registration at the store and
    its barrier): NVIDIA's in-process restart reports about 1.5 s at 16,384 ranks."""
    requeue: float = 0.0
    """Time in the queue after a time limit or preemption (not counted by default)."""
    full_bytes: float = 0.0
    """Bytes of one full checkpoint, whole job."""
    incr_share: float = 0.25
    """Bytes of a lossless increment / a full checkpoint at the strategies' intervals."""
    quant_ratio: float = 0.15
    """Bytes of a 4-bit quantized checkpoint / a full one (weights with scale and offset)."""
    baseline_every: int = 10
    """Check-N-Run and IncrCP: a full baseline every this many checkpoints."""
    priority_fraction: float = 0.125
    """CPR-MFU/SSU: the share r of each table a prioritized save writes (CPR §6.1)."""

    def in_place(self, ranks: int) -> float:
        """Seconds the survivors wait while warm spares take the dead ranks' places. Local."""
        return self.spare_join + self.rendezvous_per_rank * ranks

    def with_(self, **kw) -> "EventCosts":
        return replace(self, **kw)

    def as_dict(self) -> dict:
        return asdict(self)


def event_costs(constants, machine, workload, ranks: int,
                ranks_per_node: int = 8):
    """The simulator's per-event costs at `ranks` (seconds; bytes). Local."""
    p = workload.point(ranks, ranks_per_node)
    theta = constants.theta
    if workload.compute_s_per_sample is not None:
        # the measured rate includes the per-step fixed costs: the fitted one is not added
        theta = {**theta, "step_s": [workload.compute_s_per_sample, *theta["step_s"][1:-1], 0.0]}
    c = replace(constants, theta=theta)
    node = min(ranks_per_node, ranks)
    one = workload.point(node, ranks_per_node)  # one node's ranks reading alone
    step = c.predict("step_s", machine, p)
    return EventCosts(
        stall=c.predict("stall_s", machine, p),
        write=c.predict("commit_s", machine, p) - c.predict("stall_s", machine, p),
        load=c.predict("restore_s", machine, p),
        load_node=c.predict("partial_s", machine, replace(one, ranks=ranks, nodes=p.nodes)),
        rebuild_node=c.predict("rebuild_s", machine, p),
        parity_upkeep=c.predict("parity_upkeep_s", machine, p) / step,
        dump=p.shard_bytes / machine.memcpy_Bps, dump_load=p.shard_bytes / machine.memcpy_Bps,
        full_bytes=p.shard_bytes * ranks)
