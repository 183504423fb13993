"""The exit statuses a trainer ends with, and what `mpickpt-run` and `slurm/train.sbatch` do with
each. One table, so that the trainer, the survivors, the node agents and the relaunch loop read the
same numbers."""
from __future__ import annotations

EXIT_BAD_INPUT = 2
"""Bad flags, files or layout, refused before training (argparse's convention). Final."""
EXIT_SAVE_FAILED = 74
"""Stopped on a signal, but the emergency checkpoint did not commit (EX_IOERR: the writers
failed, the disk was full): the newest valid checkpoint is older than the step reached.
`mpickpt-run` passes it on; the sbatch script requeues from that checkpoint."""
EXIT_SAVED = 75
"""Stopped on a signal after committing a checkpoint: EX_TEMPFAIL, 'try again'; the sbatch script
requeues on it, `mpickpt-run` passes it on."""
EXIT_PEER_LOST = 76
"""A survivor: a peer died, this rank's state is dumped (with --survivor-dumps); relaunch."""
EXIT_STARTUP_FAILED = 77
"""Startup did not finish: a peer died before the first step (in MPI_Init, while the groups were
formed, during the restore), or startup ran past `--startup-timeout`. Nothing was trained, so
the relaunch resumes from the newest checkpoint (a chosen `--resume STEP` or `none` applies to
the first launch only: one that failed before it retired the newer checkpoints leaves them the
newest)."""
