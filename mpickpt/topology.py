"""Process topology built from MPI: ranks, devices, the training process group and the control channel.

`Topology.from_mpi` is the one place where the launcher's view (mpiexec, mpirun, srun) becomes the
objects the rest of mpickpt uses. There are no module-level globals: build one `Topology` per job and
pass it to whoever needs it.

Two channels never mix:
- `pg`, a torch.distributed process group (NCCL on GPUs, gloo on CPUs): the training data plane
  (embedding all-to-alls, dense gradient allreduce).
- `control`, a `StoreControl` (a gloo group of its own plus the rendezvous store, with mpi4py's
  method names): checkpoint votes, barriers, failure decisions, gathers for metrics and digests.

MPI serves only the start: ranks, node layout and the address of the rendezvous store. Both
channels belong to the job's current generation (`mpickpt.generation`): after a rank's death and
its replacement, `advance` builds the next generation's groups and every consumer reads `pg`,
`control` and the side groups from here again, never from a copy of its own.
"""
from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mpickpt.generation import (DEFAULT_JOIN_TIMEOUT, STORE_VARIABLE, Groups, Rendezvous,
                                SlotTaken, connect_store, host_store)
from mpickpt.survivors.formation_watch import FormationWatch

# Launcher variables that carry the node-local rank, in the order they are trusted.
LOCAL_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_RANK",  # Open MPI mpirun
    "MPI_LOCALRANKID",  # MPICH / Hydra mpiexec
    "SLURM_LOCALID",  # Slurm srun
    "PMI_LOCAL_RANK",  # some PMI-2 launchers
    "LOCAL_RANK",  # torchrun-style
)
LOCAL_SIZE_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS_PER_NODE",
    "LOCAL_WORLD_SIZE",
)


def local_rank_from_env(environ: dict | None = None) -> int | None:
    """Return the node-local rank named by a launcher variable, or None if none is set. Local."""
    env = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def choose_backend(requested: str | None = None) -> str:
    """Pick the torch.distributed backend: NCCL when CUDA is usable, gloo otherwise. Local."""
    if requested not in (None, "auto", "nccl", "gloo"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'gloo', got {requested!r}")
    if requested in (None, "auto"):
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False")
    return requested


@dataclass
class Topology:
    """Everything a rank knows about the job's layout. Build with `from_mpi` (collective)."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    hostname: str
    device: torch.device
    backend: str
    control: object  # mpickpt.control.StoreControl of the current generation
    pg: object = field(repr=False)  # torch.distributed ProcessGroup for the training data plane
    _owns_default_pg: bool = field(default=False, repr=False)
    _side_groups: dict = field(default_factory=dict, repr=False)
    rendezvous: Rendezvous | None = field(default=None, repr=False)
    groups: Groups | None = field(default=None, repr=False)
    timeout_s: float = 300.0
    _side_specs: list = field(default_factory=list, repr=False)
    _store_server: object = field(default=None, repr=False)
    _retired: list = field(default_factory=list, repr=False)
    forming: FormationWatch | None = field(default=None, repr=False)
    """Watches the generation `advance` joined until it settles (`formed`)."""
    replacement: bool = False
    """This process was started to replace a dead rank (it joined a later generation)."""

    @property
    def generation(self) -> int:
        """The job's generation this process is in (0 until a membership change). Local."""
        return self.groups.generation if self.groups is not None else 0

    @classmethod
    def from_mpi(cls, comm=None, backend: str | None = None, timeout_s: float = 300.0,
                 spares: int = 0):
        """Build the topology of generation 0. Collective over `comm` (default MPI.COMM_WORLD).

        The rendezvous store is agreed over MPI, so users set no environment variables: rank 0
        uses the store `mpickpt-run` hosts ($MPICKPT_STORE, set by `mpickpt-run`) or opens one
        itself on a free port, and broadcasts the address. Nothing after this uses MPI.
        The last `spares` processes of `comm` do not train: each gets a `mpickpt.spares.Spare`
        instead of a Topology, and the job's world is the others.
        """
        from mpi4py import MPI

        comm = comm or MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size() - spares
        local_rank, local_size = _local_layout(comm)
        backend = choose_backend(backend)
        device = _device_for(backend, local_rank)
        if dist.is_initialized():  # a library user's own group: used as it is, one generation
            return cls._around_user_group(comm, rank, world, local_rank, local_size, device,
                                          backend, timeout_s)
        server, address = None, os.environ.get(STORE_VARIABLE) if rank == 0 else None
        if rank == 0 and not address:
            server, address = host_store(timeout_s)
        address = comm.bcast(address, root=0)
        rendezvous = Rendezvous(server or connect_store(address, timeout_s), address)
        generation = rendezvous.current() if rank == 0 else None
        generation = comm.bcast(generation, root=0)
        if rank >= world:
            from mpickpt.spares import Spare

            return Spare(rendezvous, world, local_rank, local_size, backend, timeout_s)
        return cls._join(rendezvous, generation, rank, world, local_rank, local_size, device,
                         backend, timeout_s, server)

    @classmethod
    def from_store(cls, address: str, rank: int, world: int, local_rank: int = 0,
                   local_size: int = 1, backend: str | None = None, timeout_s: float = 300.0,
                   join_timeout_s: float = DEFAULT_JOIN_TIMEOUT, rendezvous=None,
                   generation: int | None = None, dead: str | None = None) -> "Topology":
        """Build the topology of a process started to replace `rank` (no MPI): claim the slot
        of `rank` in the first generation where it is free (raises SlotTaken if a spare or
        another respawn took it first), or join `generation`, whose slot this process already
        claimed (a spare). `dead`: the process this one replaces ("host:pid"; a slot held by
        another one raises SlotTaken at once). Collective with that generation's members."""
        backend = choose_backend(backend)
        device = _device_for(backend, local_rank)
        rendezvous = rendezvous or Rendezvous(connect_store(address, join_timeout_s), address)
        if generation is None:
            generation = rendezvous.generation_for_replacement(rank, join_timeout_s, dead)
            if not rendezvous.claim(generation, rank):
                raise SlotTaken(f"rank {rank} of generation {generation} was taken by another "
                                f"process")
        topo = cls._join(rendezvous, generation, rank, world, local_rank, local_size, device,
                         backend, timeout_s, None, join_timeout_s, claimed=True)
        topo.replacement = True
        for name, parts in rendezvous.side_groups(generation, join_timeout_s):
            topo._side_specs.append((name, parts))
            topo._make_group(name, parts)
        return topo

    @classmethod
    def _join(cls, rendezvous, generation, rank, world, local_rank, local_size, device, backend,
              timeout_s, server, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT,
              claimed: bool = False) -> "Topology":
        if not claimed:
            rendezvous.register(generation, rank)
        rendezvous.gather(generation, world, join_timeout_s)
        groups = Groups(rendezvous, generation, rank, world, backend, timeout_s)
        topo = cls(rank, world, local_rank, local_size, socket.gethostname(), device, backend,
                   groups.control, groups.pg, True, rendezvous=rendezvous, groups=groups,
                   timeout_s=timeout_s, _store_server=server)
        atexit.register(_release_at_exit)
        return topo

    @classmethod
    def _around_user_group(cls, comm, rank, world, local_rank, local_size, device, backend,
                           timeout_s) -> "Topology":
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is already initialised with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but MPI says rank {rank} of {world}")
        from mpickpt.control import StoreControl

        server, address = (host_store(timeout_s) if rank == 0 else (None, None))
        address = comm.bcast(address, root=0)
        store = server or connect_store(address, timeout_s)
        control = StoreControl(store, "user/ctl/", rank, world, timeout_s)
        return cls(rank, world, local_rank, local_size, socket.gethostname(), device, backend,
                   control, dist.group.WORLD, False, rendezvous=Rendezvous(store, address),
                   timeout_s=timeout_s, _store_server=server)

    @property
    def can_advance(self) -> bool:
        """Whether this topology can move to a next generation (it built its own groups). Local."""
        return self.groups is not None

    def abort(self) -> None:
        """Make every collective of the current generation, running or to come, raise (a peer
        died). Local; any thread; safe twice."""
        if self.groups is not None:
            self.groups.abort()
        elif self.control is not None:
            self.control.abort()

    def wait(self, work) -> None:
        """Wait for a collective started with `async_op=True` on `pg` or a side group. Under gloo
        the wait ends with `GenerationAborted` (a RuntimeError) once `abort` was called, even if a
        live peer never answers (`mpickpt.interruptible`). Local."""
        if self.groups is not None:
            self.groups.wait(work)
        else:
            work.wait()

    def advance(self, dead, join_timeout_s: float = DEFAULT_JOIN_TIMEOUT, more_dead=None) -> int:
        """Leave the current generation (its groups aborted) and join the next one with the
        processes that replace `dead`: new training group, control channel and side groups (in
        the order they were first made). `more_dead()`: deaths learned while waiting (see
        `Rendezvous.gather`). Returns the new generation. Collective with the next generation's
        members; raises `GenerationError` when they do not all come."""
        if self.groups is None:
            raise RuntimeError("this topology runs on a process group it did not create; it "
                               "cannot move to a new generation")
        old = self.groups
        old.abort()
        nxt = self.rendezvous.advance(old.generation, dead)
        self.rendezvous.publish_side_groups(nxt, self._side_specs)
        self.rendezvous.register(nxt, self.rank)
        self.rendezvous.gather(nxt, self.world_size, join_timeout_s, more_dead)
        self.formed()  # a watch of an earlier formation that never settled
        if self.rendezvous.address is not None:  # None: a store without an address (tests)
            self.forming = FormationWatch(self.rendezvous.address, nxt, self.world_size,
                                          lambda: self._abort_generation(nxt))
        old.release()
        self._retired.append(old)
        self.groups = Groups(self.rendezvous, nxt, self.rank, self.world_size, self.backend,
                             self.timeout_s)
        self.pg, self.control = self.groups.pg, self.groups.control
        self._side_groups = {}
        for name, parts in self._side_specs:
            self._make_group(name, parts)
        return nxt

    def _abort_generation(self, generation: int) -> None:
        """`abort` if this process is in `generation` (its groups exist), else nothing: a
        watch of one generation never aborts another's groups, nor a group being built. Local;
        any thread."""
        groups = self.groups
        if groups is not None and groups.generation == generation:
            groups.abort()

    def formed(self) -> None:
        """The generation joined by `advance` settled: its peer watch stands, so its
        `FormationWatch` (a member's death while it formed ends it) stops. Local; safe twice."""
        if self.forming is not None:
            self.forming.stop()
            self.forming = None

    @property
    def is_root(self) -> bool:
        """True on rank 0, which prints and writes manifests. Local."""
        return self.rank == 0

    def side_group(self, name: str):
        """A further process group over all ranks, for traffic that should run beside the
        training data plane instead of queueing behind it (parity upkeep). Created on the first
        call for `name` (collective then; every rank must ask in the same order), cached after
        (local)."""
        if name not in self._side_groups:
            self._side_specs.append((name, None))
            self._make_group(name, None)
        return self._side_groups[name]

    def part_group(self, name: str, parts: list[list[int]]):
        """A process group over the part of `parts` (disjoint lists of ranks covering the world)
        that holds this rank, for traffic among those ranks only (parity groups). Created on the
        first call for `name` (collective then: every rank creates every part, in the same
        order), cached after (local)."""
        if name not in self._side_groups:
            if not any(self.rank in part for part in parts):
                raise ValueError(f"rank {self.rank} is in none of the parts {parts}")
            self._side_specs.append((name, [list(p) for p in parts]))
            self._make_group(name, parts)
        return self._side_groups[name]

    def _make_group(self, name: str, parts) -> None:
        """Create a side group (parts None: over all ranks). Collective."""
        if parts is None:
            group = dist.new_group(backend=self.backend)
        else:
            group = None
            for part in parts:
                made = dist.new_group(ranks=part, backend=self.backend)
                if self.rank in part:
                    group = made
        self._side_groups[name] = group
        if self.groups is not None:
            self.groups.side[name] = group

    def barrier(self) -> None:
        """Barrier on the control channel. Collective."""
        self.control.Barrier()

    def close(self) -> None:
        """Release the process group (if this object created it) and the control channel.
        Local: nothing here waits for a peer."""
        if self.pg is not None and self._owns_default_pg and dist.is_initialized():
            dist.destroy_process_group()
        self.pg = None
        self._side_groups.clear()
        if self.control is not None:
            self.control.Free()
            self.control = None


def _local_layout(control) -> tuple[int, int]:
    """Node-local rank and size: launcher variables first, else a shared-memory split. Collective."""
    from mpi4py import MPI

    node = control.Split_type(MPI.COMM_TYPE_SHARED)
    split_rank, split_size = node.Get_rank(), node.Get_size()
    node.Free()
    env_rank = local_rank_from_env()
    return (env_rank if env_rank is not None else split_rank), split_size


def _device_for(backend: str, local_rank: int) -> torch.device:
    """One GPU per local rank (round-robin over visible GPUs) for NCCL, else the CPU. Local."""
    if backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _release_at_exit() -> None:
    """A script that never called `close()`: destroy the default process group this module
    created before MPI finalizes (atexit runs later-registered hooks first; mpi4py registered its
    own at import), so the interpreter does not abort in the group's destructor at teardown
    ("terminate called without an active exception"). It must not depend on the Topology object:
    a script's main() returns and drops it long before exit, while torch's registry keeps the
    group. Local: no collective at exit, where a peer may be gone.

    Objects of the script caught in reference cycles (a model and its hooks) still hold the group
    until the collector runs; collected here, while the interpreter is whole, instead of during
    its teardown, where a gloo group's worker threads can abort the process (seen once in CI,
    exit status -6 after all work was done)."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
