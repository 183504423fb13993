"""The command that starts one run of the trainer under a launcher, set up so that a rank's death
leaves the others alive long enough to dump their state.

- MPICH's `mpiexec` (hydra) kills every rank at once when one dies; with `-disable-auto-cleanup`
  the survivors only receive SIGUSR1 and go on (they then see the death on their own ring and exit
  in order, see `mpickpt.survivors.survival`), unless a signal ended the dead rank: then its node's
  proxy SIGKILLs them at its next event, so each rank runs under `mpickpt.launch.rank_wrapper`,
  which turns a death by signal into an exit status.
- `srun` keeps the other tasks alive when one ends (`--kill-on-bad-exit=0`); it needs the MPI
  plugin the MPI library speaks (`--mpi=pmi2` for MPICH, the pip wheel included). Each task runs
  under the rank wrapper too, so that a killed trainer is respawned in place inside the step.
- Open MPI's `mpirun` (4.x, ORTE) kills the job when a rank it started dies or exits with a
  status other than 0, whatever is asked. Each rank runs under the rank wrapper there too: a
  trainer's death is then the agent's business (it respawns it in place, or exits with its
  status, and mpirun ends the job), and `orte_allowed_exit_without_sync` lets ranks of a later
  generation end without MPI_Finalize (which would wait for the dead rank), as they do under
  hydra. Open MPI 5 (PRRTE) is run as before (not wrapped, in place off): not tried here.
Local.
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys

from mpickpt.mpiexec import mpiexec

LAUNCHERS = ("mpiexec", "srun")


def mpi_flavour(program: str) -> str:
    """'hydra' (MPICH), 'openmpi' (4.x and older, ORTE), 'prrte' (Open MPI 5 and later) or
    'unknown', from `program --version`. Local."""
    try:
        out = subprocess.run([program, "--version"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout + out.stderr
    if "HYDRA" in text or "hydra" in text.lower():
        return "hydra"
    return open_mpi_flavour(text)


def open_mpi_flavour(version_text: str) -> str:
    """'openmpi' for Open MPI 4.x and older (ORTE), 'prrte' for 5 and later, 'unknown' for
    anything else, from what `mpirun --version` printed. Local and pure."""
    m = re.search(r"\((?:Open ?MPI|OpenRTE)\) (\d+)\.", version_text)
    if m:
        return "openmpi" if int(m.group(1)) < 5 else "prrte"
    return "prrte" if "prterun" in version_text or "PRRTE" in version_text else "unknown"


WRAPPED = ("hydra", "openmpi")
"""The mpiexec flavours whose ranks run under the rank wrapper (node agents that respawn)."""
ORTE_NO_SYNC = ["--mca", "orte_allowed_exit_without_sync", "1"]
"""Open MPI 4: a rank of a later generation ends without MPI_Finalize, which is no abnormal
termination (the job's other ranks are not killed for it)."""
RUN_VARIABLES = ("MPICKPT_IN_PLACE", "MPICKPT_RESTART", "MPICKPT_STORE", "MPICKPT_AGENTS",
                 "MPICKPT_WARM_RESPAWN", "MPICKPT_SIGUSR1_NOTICES")
"""What mpickpt-run sets for every rank of a run: Open MPI's mpirun passes them to other nodes
only when named (`-x`); hydra and srun pass the whole environment."""


def agents_respawn(launcher: str, program: str | None = None) -> bool:
    """Whether `launch_command` runs every rank under a node agent that respawns a killed
    trainer in place (mpickpt-run then asks for in-place recovery). Local."""
    return launcher == "srun" or \
        launcher == "mpiexec" and mpi_flavour(program or mpiexec()) in WRAPPED


def sends_death_notices(launcher: str, program: str | None = None) -> bool:
    """Whether the launcher sends every rank SIGUSR1 when a rank exits (MPICH's hydra); the
    ranks then take a SIGUSR1 around a death for that notice, not for a stop. Local."""
    return launcher == "mpiexec" and mpi_flavour(program or mpiexec()) == "hydra"


def stop_signal_for(launcher: str) -> int | None:
    """The signal a stop (SIGTERM, SIGINT to `mpickpt-run`) goes to `launcher` as, where it
    would not reach the tasks as it is: srun kills the step on SIGTERM and only prints its tasks'
    states on a single SIGINT, but passes SIGUSR1 on, which the trainers take for a stop (srun
    sends no death notices). None: as it is. Local."""
    return signal.SIGUSR1 if launcher == "srun" else None


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
        return cmd + list(extra) + wrapped(flags)
    if launcher != "mpiexec":
        raise ValueError(f"launcher {launcher!r}: expected one of {', '.join(LAUNCHERS)}")
    program = program or mpiexec()
    if ranks is None:
        raise ValueError("mpiexec needs the number of ranks (-n)")
    flavour = mpi_flavour(program)
    if flavour not in WRAPPED:
        return [program, "-n", str(ranks), *extra, *trainer_command(flags)]
    keep_going = ["-disable-auto-cleanup"] if flavour == "hydra" else \
        ORTE_NO_SYNC + [x for name in RUN_VARIABLES for x in ("-x", name)]
    return [program, *keep_going, "-n", str(ranks), *extra, *wrapped(flags)]


def wrapped(flags: list[str]) -> list[str]:
    """The trainer under its node agent (`mpickpt.launch.rank_wrapper`). Local."""
    return [sys.executable, "-m", "mpickpt.launch.rank_wrapper", *trainer_command(flags)]


def cleanup_command(launcher: str, nodes: str | None) -> list[str] | None:
    """What deletes a killed step's MPICH segments on every node before the next step (Slurm
    only: a requeued job's steps reuse the ids whose segments are left), or None. Local."""
    if launcher != "srun" or shutil.which("srun") is None:
        return None
    # one task per node, the count said too: srun would take the job's SLURM_NTASKS otherwise
    # and warn that it cannot honour one per node
    per_node = ["--ntasks-per-node=1"] + ([f"--nodes={nodes}", f"--ntasks={nodes}"]
                                          if nodes else [])
    return ["srun", "--mpi=none", *per_node, sys.executable, "-m", "mpickpt.launch.mpich_shm"]
