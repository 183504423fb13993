"""The command that starts one run of the trainer under a launcher, set up so that a rank's death
leaves the others alive long enough to dump their state.

- MPICH's `mpiexec` (hydra) kills every rank at once when one dies; with `-disable-auto-cleanup`
  the survivors only receive SIGUSR1 and go on (they then see the death on their own ring and exit
  in order, see `mpickpt.survivors.survival`), unless a signal ended the dead rank: then its node's
  proxy SIGKILLs them at its next event, so each rank runs under `mpickpt.launch.rank_wrapper`,
  which turns a death by signal into an exit status.
- `srun` keeps the other tasks alive by default (`--kill-on-bad-exit=0`); it needs the MPI plugin
  the MPI library speaks (`--mpi=pmi2` for MPICH, the pip wheel included).
- Open MPI's `mpirun` kills the job when a rank dies whatever is asked; the survivors' dumps then
  race its SIGTERM/SIGKILL, and the relaunch falls back to the checkpoint for any that lost.
Local.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

from mpickpt.mpiexec import mpiexec

LAUNCHERS = ("mpiexec", "srun")


def mpi_flavour(program: str) -> str:
    """'hydra' (MPICH), 'openmpi' or 'unknown', from `program --version`. Local."""
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "HYDRA" in text or "hydra" in text.lower():
        return "hydra"
    if "Open MPI" in text or "OpenRTE" in text or "prterun" in text:
        return "openmpi"
    return "unknown"


def trainer_command(flags: list[str]) -> list[str]:
    """The trainer as every rank runs it. Local."""
    return [sys.executable, "-m", "mpickpt.train", *flags]


def launch_command(launcher: str, ranks: int | None, flags: list[str],
                   extra: list[str] = (), srun_mpi: str = "pmi2",
                   program: str | None = None) -> list[str]:
    """The command line of one run: `launcher` is 'mpiexec' or 'srun'; `extra` goes to the
    launcher; `program` overrides the launcher's path. Local."""
    if launcher == "srun":
        cmd = [program or "srun", f"--mpi={srun_mpi}", "--kill-on-bad-exit=0"]
        if ranks is not None:
            cmd += ["-n", str(ranks)]
        return cmd + list(extra) + trainer_command(flags)
    if launcher != "mpiexec":
        raise ValueError(f"launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    program = program or mpiexec()
    if ranks is None:
        raise ValueError("mpiexec needs the number of ranks (-n)")
    if mpi_flavour(program) != "hydra":
        return [program, "-n", str(ranks), *extra, *trainer_command(flags)]
    wrapped = [sys.executable, "-m", "mpickpt.launch.rank_wrapper", *trainer_command(flags)]
    return [program, "-disable-auto-cleanup", "-n", str(ranks), *extra, *wrapped]


def cleanup_command(launcher: str, nodes: str | None) -> list[str] | None:
    """What deletes a killed step's MPICH segments on every node before the next step (Slurm
    only: a requeued job's steps reuse the ids whose segments are left), or None. Local."""
    if launcher != "srun" or shutil.which("srun") is None:
        return None
    per_node = ["--ntasks-per-node=1"] + ([f"--nodes={nodes}"] if nodes else [])
    return ["srun", "--mpi=none", *per_node, sys.executable, "-m", "mpickpt.launch.mpich_shm"]
