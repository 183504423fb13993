"""The record of a chosen start under way: a run that starts at `--resume STEP` (or `none`) under
newer committed checkpoints replaces them, but only retires them once its restore has succeeded
(`manifest.retire_after`). A launch that dies in between (during the restore of a large state,
say) would leave them the newest, and its relaunch, which resumes the newest checkpoint, would
then continue the timeline the user chose to leave.

Rank 0 writes ``<root>/.mpickpt-replacing`` (a sealed JSON record: the `--resume` value and the
step) durably as soon as the launch's flags are agreed (`settle`: before the groups, the model
and the writers, whose start can fail too), settles it again at the restore, and removes it once
the newer checkpoints are retired. A relaunch of the same command that finds it carries the
chosen start out instead of resuming the newest checkpoint (`CheckpointConfig.resume_in_force`).
Local: nothing here uses MPI.
"""
from __future__ import annotations

import os

from mpickpt.store.durable import fsync_path
from mpickpt.store.sealed_json import DamagedRecord, dumps_sealed, read_sealed

NAME = ".mpickpt-replacing"


def path_of(root: str) -> str:
    return os.path.join(root, NAME)


def begin(root: str, resume: str, start: int) -> None:
    """Record durably that a run starting at `start` (`--resume resume`) is replacing the newer
    checkpoints of `root`. OSError when it cannot. Local (rank 0)."""
    path = path_of(root)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(dumps_sealed({"resume": str(resume), "start": int(start)}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_path(root)


def pending(root: str) -> str | None:
    """The `--resume` value of a replacement under way in `root`, or None. DamagedRecord naming
    the file when it cannot be read. Local."""
    path = path_of(root)
    if not os.path.exists(path):
        return None
    record = read_sealed(path, "version", 1)
    if not isinstance(record.get("resume"), str):
        raise DamagedRecord(path, "no --resume value in it")
    return record["resume"]


def end(root: str) -> None:
    """The replacement is carried out (or no longer wanted): remove the record durably. Local
    (rank 0); OSError when it cannot."""
    try:
        os.remove(path_of(root))
    except FileNotFoundError:
        return
    fsync_path(root)


def settle(root: str, resume: str, train_until: int | None) -> str | None:
    """Rank 0, before a chosen start's restore (at the launch's start, and again at the
    restore): `begin` where `--resume resume` (a step or 'none') replaces newer checkpoints of
    `root` (named by their manifest files, readable or not; the chosen step's must be there)
    in a run that trains to `train_until` (None: past any step), else `end` a stale record; a
    run that trains nothing past its start leaves the record as it is. A launch that resumes
    the newest checkpoint ('latest') and trains past it ends any record, damaged or not: it is
    another job than the one whose relaunch the record was for, and its checkpoints are the
    newest now (one that trains nothing past the newest, a look at it, leaves it). Returns a
    warning when the record cannot be written or removed, else None. Local."""
    from mpickpt.store.manifest import manifest_steps

    if resume == "latest":
        try:
            if train_until is None or train_until > max(manifest_steps(root), default=-1):
                end(root)
        except OSError as e:
            return f"could not remove {path_of(root)} ({e}), a record of an earlier job's start"
        return None
    start = 0 if resume == "none" else int(resume)
    if train_until is not None and start >= train_until:
        return None
    try:
        steps = manifest_steps(root)
        if (resume == "none" or start in steps) and max(steps, default=-1) > start:
            begin(root, resume, start)
        else:
            end(root)
    except OSError as e:
        return (f"could not write {path_of(root)} ({e}): a relaunch after a failure before "
                f"the newer checkpoints are retired would resume them")
    return None
