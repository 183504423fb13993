"""The shared-memory segments MPICH leaves behind when a Slurm job step is killed.

MPICH (ch4) names a step's node-local segments `/dev/shm/mpich_shm_<world id>_<node index>` (and
`mpich_vci_...`), where the world id is the 32-bit FNV-1a hash of the PMI job id: `<job>.<step>`
under `srun --mpi=pmi2`. A killed step leaves its segments, and a requeued job keeps its job id and
numbers its steps from 0 again: its first step then finds the old segment and fails in MPI_Init.
`python -m mpickpt.launch.mpich_shm --job ID` (run on every node of the allocation, before a step
starts) deletes the segments of that job's steps. Local.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

SHM_DIR = "/dev/shm"
STEPS = 256
"""Step ids 0..STEPS-1 of a job are looked for."""
_SEGMENT = re.compile(r"^mpich_(shm|vci)_([0-9a-f]+)_\d+$")


def fnv1a32(text: str) -> int:
    """The 32-bit FNV-1a hash of a string's UTF-8 bytes."""
    h = 0x811C9DC5
    for byte in text.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h


def world_id(job_id: int, step_id: int) -> str:
    """The hex world id in the segment names of Slurm step <job_id>.<step_id>."""
    return f"{fnv1a32(f'{job_id}.{step_id}'):x}"


def remove_segments(job_ids, shm_dir: str = SHM_DIR, steps: int = STEPS) -> list[str]:
    """Delete the MPICH segments of steps 0..steps-1 of these jobs; returns the names deleted.
    Call only when no step of these jobs runs on this node. Local."""
    present: dict[str, list[str]] = {}
    for name in os.listdir(shm_dir):
        m = _SEGMENT.match(name)
        if m:
            present.setdefault(m.group(2), []).append(name)
    removed = []
    for job_id in job_ids:
        for step_id in range(steps):
            if not present:
                return removed
            for name in present.pop(world_id(job_id, step_id), []):
                try:
                    os.unlink(os.path.join(shm_dir, name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
    return removed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mpickpt.launch.mpich_shm",
                                description="delete a Slurm job's stale MPICH segments on this "
                                            "node")
    p.add_argument("--job", type=int, default=os.environ.get("SLURM_JOB_ID"),
                   help="the job id (default: $SLURM_JOB_ID)")
    p.add_argument("--shm-dir", default=SHM_DIR)
    args = p.parse_args(argv)
    if args.job is None:
        p.error("--job is needed outside a Slurm job (no SLURM_JOB_ID)")
    removed = remove_segments([int(args.job)], args.shm_dir)
    if removed:
        print(f"mpickpt: removed {len(removed)} stale MPICH segment(s) of job {args.job} from "
              f"{args.shm_dir}: {' '.join(removed)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
