"""Process topology built from MPI: ranks, devices, the training process group and the control channel.

`Topology.from_mpi` is the one place where the launcher's view (mpiexec, mpirun, srun) becomes the
objects the rest of mpickpt uses. There are no module-level globals: build one `Topology` per job and
pass it to whoever needs it.

Two channels never mix:
- `pg`, a torch.distributed process group (NCCL on GPUs, gloo on CPUs): the training data plane
  (embedding all-to-alls, dense gradient allreduce).
- `control`, a duplicated MPI communicator: checkpoint votes, barriers, failure decisions, gathers for
  metrics and digests.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

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


def _rendezvous_host() -> str:
    """Address other ranks use to reach this host (override with MPICKPT_MASTER_ADDR). Local."""
    override = os.environ.get("MPICKPT_MASTER_ADDR")
    if override:
        return override
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


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
    control: object  # mpi4py.MPI.Intracomm, a Dup of the launcher's communicator
    pg: object = field(repr=False)  # torch.distributed ProcessGroup for the training data plane
    _owns_default_pg: bool = field(default=False, repr=False)
    _side_groups: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_mpi(cls, comm=None, backend: str | None = None, timeout_s: float = 300.0) -> "Topology":
        """Build the topology. Collective over `comm` (default MPI.COMM_WORLD).

        The torch.distributed rendezvous (address and port) is agreed over MPI, so users set no
        environment variables: rank 0 opens a TCPStore on a free port and broadcasts it.
        """
        from mpi4py import MPI

        control = (comm or MPI.COMM_WORLD).Dup()
        rank, world = control.Get_rank(), control.Get_size()
        local_rank, local_size = _local_layout(control)
        backend = choose_backend(backend)
        device = _device_for(backend, local_rank)
        pg, owns = _process_group(control, backend, rank, world, timeout_s)
        topo = cls(rank, world, local_rank, local_size, socket.gethostname(), device, backend,
                   control, pg, owns)
        if owns:
            atexit.register(_release_at_exit)
        return topo

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
            self._side_groups[name] = dist.new_group(backend=self.backend)
        return self._side_groups[name]

    def part_group(self, name: str, parts: list[list[int]]):
        """A process group over the part of `parts` (disjoint lists of ranks covering the world)
        that holds this rank, for traffic among those ranks only (parity groups). Created on the
        first call for `name` (collective then: every rank creates every part, in the same
        order), cached after (local)."""
        if name not in self._side_groups:
            mine = None
            for part in parts:
                group = dist.new_group(ranks=part, backend=self.backend)
                if self.rank in part:
                    mine = group
            if mine is None:
                raise ValueError(f"rank {self.rank} is in none of the parts {parts}")
            self._side_groups[name] = mine
        return self._side_groups[name]

    def barrier(self) -> None:
        """Barrier on the control channel. Collective."""
        self.control.Barrier()

    def close(self) -> None:
        """Release the process group (if this object created it) and the control channel. Collective."""
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


def _process_group(control, backend: str, rank: int, world: int, timeout_s: float):
    """Create the training process group with a rendezvous agreed over MPI. Collective."""
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(
                f"torch.distributed is already initialised with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but MPI says rank {rank} of {world}")
        return dist.group.WORLD, False
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if rank == 0:
        host = _rendezvous_host()
        store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False)
        address = (host, store.port)
    else:
        address = None
    host, port = control.bcast(address, root=0)
    if rank != 0:
        store = dist.TCPStore(host, port, world, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    return dist.group.WORLD, True


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
