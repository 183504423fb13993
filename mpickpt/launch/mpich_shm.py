"""The shared-memory segments MPICH leaves behind when a Slurm job step is killed.

MPICH (ch4) names a step's node-local segments `/dev/shm/mpich_shm_<world id>_<node index>` (and
`mpich_vci_...`), where the world id is the 32-bit FNV-1a hash of the PMI job id: `<job>.<step>`
under `srun --mpi=pmi2`. A killed step leaves its segments, and a requeued job keeps its job id and
numbers its steps from 0 again: its first step then finds the old segment and fails in MPI_Init.
`python -m mpickpt.launch.mpich_shm --job ID` (run on every node of the allocation, before a step
starts) deletes the segments of that job's steps.

Outside Slurm the job id is not known, but a node agent knows when its run started:
`remove_orphans(since)` deletes the MPI segments of this user that appeared since then and that
no process of this user maps or holds open any more. What a run killed as a whole left (its
launcher SIGKILLed, or a plain `mpiexec` whose hydra ended every rank) no agent of it removes:
`remove_stale()`, at the start of `mpickpt-run` and of every launch's trainers of local rank 0
(not replacements), deletes this user's MPI
segments that nobody holds and that are older than `GRACE_S` (a job starting beside it holds its
own within milliseconds of creating it), and the staging areas of processes that are gone
(`engine.staging`, GBs per rank at real table sizes). Local.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

SHM_DIR = "/dev/shm"
STEPS = 256
"""Step ids 0..STEPS-1 of a job are looked for."""
_SEGMENT = re.compile(r"^mpich_(shm|vci)_([0-9a-f]+)_\d+$")
_ANY_MPI_SEGMENT = re.compile(r"^(mpich_(shm|vci)_[0-9a-f]+_\d+|vader_segment\..+|sm_segment\..+)$")


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


GRACE_S = 60.0
"""`remove_stale` leaves segments changed more recently: a starting job's, not mapped yet."""


def remove_orphans(since: float, shm_dir: str = SHM_DIR) -> list[str]:
    """Delete this user's MPI segments in `shm_dir` created at or after `since` (a time.time())
    that no process of this user maps or holds open; returns the names deleted. Local."""
    return _remove_unheld(shm_dir, lambda mtime: mtime >= since - 1.0)


def remove_stale(shm_dir: str = SHM_DIR, grace_s: float = GRACE_S) -> list[str]:
    """Delete this user's MPI segments in `shm_dir` that no process of this user maps or holds
    open and that nobody changed for `grace_s` seconds (whatever run left them); returns the
    names deleted. Local."""
    oldest = time.time() - grace_s
    return _remove_unheld(shm_dir, lambda mtime: mtime < oldest)


def remove_stale_saying(say) -> None:
    """`remove_stale()` and the staging areas of processes that are gone, one line through
    `say` for what went. Local."""
    from mpickpt.engine.staging import remove_stale_areas

    segments, areas = remove_stale(), remove_stale_areas()
    if segments or areas:
        say("removed what killed runs left in /dev/shm that no process holds any more: "
            + ", ".join(part for part in (
                f"{len(segments)} MPI segment(s) ({' '.join(segments)})" if segments else "",
                f"{len(areas)} staging area(s) ({' '.join(areas)})" if areas else "") if part))


def _remove_unheld(shm_dir: str, wanted) -> list[str]:
    """Delete this user's MPI segments in `shm_dir` whose modification time `wanted(mtime)`
    accepts and that no process of this user maps or holds open. Local."""
    uid, candidates = os.getuid(), {}
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    for name in names:
        if not _ANY_MPI_SEGMENT.match(name):
            continue
        try:
            st = os.stat(os.path.join(shm_dir, name))
        except OSError:
            continue
        if st.st_uid == uid and wanted(st.st_mtime):
            candidates[os.path.join(shm_dir, name)] = name
    if not candidates:
        return []
    held = _held_paths(uid, os.path.join(shm_dir, ""))
    removed = []
    for path, name in candidates.items():
        if path in held:
            continue
        try:
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass
    return sorted(removed)


def remove_orphans_saying(since: float, say, areas: bool = False) -> list[str]:
    """`remove_orphans(since)` in /dev/shm, and one line through `say` if any went; `areas`:
    also the staging areas of processes that are gone (killed trainers'). Local."""
    removed = remove_orphans(since)
    if removed:
        say(f"removed {len(removed)} shared-memory segment(s) no process holds any more: "
            f"{' '.join(removed)}")
    if areas:
        from mpickpt.engine.staging import remove_stale_areas

        gone = remove_stale_areas()
        if gone:
            say(f"removed {len(gone)} staging area(s) of trainers that are gone: "
                f"{' '.join(gone)}")
    return removed


def _held_paths(uid: int, prefix: str) -> set[str]:
    """Files under `prefix` (a folder, with its slash) that this user's processes map or hold
    open."""
    held: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        held.add(line[at:].split(" (deleted)")[0].strip())
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(prefix):
                    held.add(target)
        except OSError:  # the process ended meanwhile
            continue
    return held


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
