"""Checks of how the job was launched, before anything else runs. Local.

The commonest silent failure of an MPI job under Slurm: `srun` without the MPI plugin that the MPI
library speaks (`MpiDefault=none` is the default of many clusters) starts N independent processes
that each initialise MPI as a world of one, and N 1-rank trainings run side by side and exit 0. The
same happens under the `mpiexec`/`mpirun` of another MPI than the one mpi4py was built against. The
launcher says how many tasks it started; MPI says how many it sees.
"""
from __future__ import annotations

import os

TASK_COUNTS = (
    ("SLURM_STEP_NUM_TASKS", "srun"),  # not SLURM_NTASKS: a batch script sees the job's count
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMI_SIZE", "a PMI launcher (MPICH's mpiexec, srun --mpi=pmi2)"),
    ("PMIX_SIZE", "a PMIx launcher"),
)


def launched_tasks(environ=None) -> tuple[int, str] | None:
    """(tasks, launcher) the launcher says it started, when more than one. Local."""
    env = os.environ if environ is None else environ
    for name, launcher in TASK_COUNTS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) > 1:
            return int(value), f"{launcher} ({name}={value})"
    return None


def launch_error(world_size: int, environ=None) -> str | None:
    """Why this launch cannot train as one job, or None. Local."""
    tasks = launched_tasks(environ)
    if world_size != 1 or tasks is None:
        return None
    n, launcher = tasks
    return (f"launched as {n} separate 1-rank jobs: {launcher} started {n} tasks but MPI sees a "
            f"world of 1 in each. Under srun, pass the MPI plugin your MPI speaks: "
            f"srun --mpi=pmi2 for MPICH (the pip mpich wheel included), --mpi=pmix for Open "
            f"MPI (srun --mpi=list shows what the cluster offers; slurm/train.sbatch takes it "
            f"from SRUN_MPI). With mpiexec/mpirun, use the launcher of the MPI that mpi4py was "
            f"built against: python -c 'import mpi4py; print(mpi4py.get_config())'")
