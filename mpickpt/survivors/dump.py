"""Survivor dumps: one rank's state at a step boundary, written when a peer died and read by the
relaunch.

A dump is a directory of `.npy` arrays and a `header.json` (written last) that records the step,
the reader position, the PLS, the job's shape and, per array, its size and CRC32. It goes to
node-local shared memory (`/dev/shm/mpickpt-survivors-<job key>/rank-<r>`), where a relaunch on
the same nodes finds it at memory speed, and, with `--survivor-dumps ckpt`, also to
`<checkpoint dir>/survivors/rank-<r>` (fsynced), where a relaunch on other nodes finds it. Each is
written under a temporary name and renamed into place, so a dump is whole or absent. The job key is
a hash of the checkpoint directory: the same directory is the same job. Local.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np

from mpickpt.store.durable import file_crc32, fsync_path
from mpickpt.store.leftovers import LINEAGE_FILE, SURVIVORS, tree_bytes

DUMP_VERSION = 1
SHM_ROOT = "/dev/shm"


class DumpError(ValueError):
    """A dump that is missing, damaged, or of another job."""


@dataclass
class DumpHeader:
    """What a dump holds besides its arrays."""

    rank: int
    world_size: int
    plan_id: str
    step: int
    reader_state: dict
    pls: dict
    undo_step: int | None = None
    """The dump can also go back to the step before (`undo/*` arrays) to `undo_step`."""
    undo_reader_state: dict | None = None
    incomplete: bool = False
    """Its rows are not whole (it was being rebuilt from parity): it counts as lost."""
    dead: list = field(default_factory=list)
    lineage: str = ""
    """The checkpoint directory's lineage id (`lineage`): a dump left by an earlier job whose
    directory was since removed and made anew is not this job's."""
    files: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    version: int = DUMP_VERSION


def job_key(root: str) -> str:
    """The job a checkpoint directory stands for. Local."""
    return hashlib.sha256(os.path.abspath(root).encode()).hexdigest()[:16]



def lineage(root: str) -> str:
    """The id of the run lineage a checkpoint directory belongs to, made at its first use (a
    random id, written once under a temporary name). Local; call on one rank."""
    path = os.path.join(root, LINEAGE_FILE)
    os.makedirs(root, exist_ok=True)
    if not os.path.exists(path):
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(uuid.uuid4().hex)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces one another job wrote meanwhile
        except FileExistsError:
            pass
        os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()


def plan_id(plan) -> str:
    """A short hash of the shard plan (a dump loads only onto the same layout). Local."""
    return hashlib.sha256(json.dumps(plan.describe(), sort_keys=True).encode()).hexdigest()[:16]


def shm_folder(key: str) -> str:
    """The shared-memory folder of job `key`'s dumps on this node. Local."""
    return os.path.join(SHM_ROOT, f"mpickpt-survivors-{key}")


def held_here(root: str) -> tuple[str, int, int, int]:
    """(folder, whole dumps, dumps cut short while written, bytes of both) of the survivor
    dumps of checkpoint directory `root` that this node's shared memory holds. Local."""
    folder = shm_folder(job_key(root))
    names = [n for n in (os.listdir(folder) if os.path.isdir(folder) else [])
             if n.startswith("rank-")]
    partial = sum(".tmp-" in n for n in names)
    return folder, len(names) - partial, partial, tree_bytes(folder)


def dump_dirs(key: str, rank: int, root: str | None) -> list[str]:
    """Where rank `rank`'s dump goes: shared memory, and the checkpoint directory if given."""
    out = [os.path.join(shm_folder(key), f"rank-{rank:05d}")]
    if root is not None:
        out.append(os.path.join(root, SURVIVORS, f"rank-{rank:05d}"))
    return out


def write_dump(directory: str, header: DumpHeader, arrays: dict[str, np.ndarray],
               durable: bool) -> int:
    """Write the dump under a temporary name, then rename it into place; returns its bytes.
    `durable` fsyncs the files and the directories (the checkpoint directory copy). Local."""
    tmp = f"{directory}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    total = 0
    for name, array in arrays.items():
        path = os.path.join(tmp, _file(name))
        with open(path, "wb") as f:
            np.save(f, np.asarray(array, order="C"), allow_pickle=False)  # keeps 0-d arrays 0-d
            if durable:
                f.flush()
                os.fsync(f.fileno())
        header.files[name] = {"size": os.path.getsize(path), "crc": file_crc32(path)}
        total += header.files[name]["size"]
    with open(os.path.join(tmp, "header.json"), "w") as f:
        json.dump(asdict(header), f)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    if durable:
        fsync_path(os.path.dirname(directory))
    return total


def read_header(directory: str) -> DumpHeader:
    """The header of a dump, its files checked by size and CRC; DumpError naming the problem."""
    path = os.path.join(directory, "header.json")
    if not os.path.exists(path):
        raise DumpError(f"{directory}: no survivor dump")
    try:
        with open(path) as f:
            header = DumpHeader(**json.load(f))
    except (OSError, ValueError, TypeError) as e:
        raise DumpError(f"{path}: not a survivor dump header: {e}") from None
    if header.version != DUMP_VERSION:
        raise DumpError(f"{path}: dump version {header.version}, expected {DUMP_VERSION}")
    for name, meta in header.files.items():
        file = os.path.join(directory, _file(name))
        if not os.path.exists(file) or os.path.getsize(file) != meta["size"]:
            raise DumpError(f"{file}: missing or truncated")
        if file_crc32(file) != meta["crc"]:
            raise DumpError(f"{file}: fails its CRC32 (damaged)")
    return header


def read_array(directory: str, name: str) -> np.ndarray:
    """One array of a dump (its CRC was checked by `read_header`). Local."""
    return np.load(os.path.join(directory, _file(name)), allow_pickle=False)


def remove_dumps(key: str, rank: int, root: str | None) -> None:
    """Delete this rank's dumps, the halves of any whose writing was cut short (a launcher that
    kills survivors soon after a death can stop one mid-write), and the shared-memory folder once
    empty. Local."""
    for directory in dump_dirs(key, rank, root):
        shutil.rmtree(directory, ignore_errors=True)
        for partial in glob.glob(glob.escape(directory) + ".tmp-*"):
            shutil.rmtree(partial, ignore_errors=True)
        try:
            os.rmdir(os.path.dirname(directory))
        except OSError:
            pass


def _file(name: str) -> str:
    return name.replace("/", "__") + ".npy"
