"""Background checkpoint writer: a spawned process that turns staged arrays into HDF5 files.

This module must never import mpi4py (a spawned child that initialises MPI can hang the job) nor
torch (start-up time). It receives jobs over a pipe, writes each file to a temporary name block by
block, fsyncs it, renames it into place, fsyncs the directory, and answers with the sizes or with an
error naming the path. It dies with its parent (PR_SET_PDEATHSIG), so a killed rank leaves no
writer behind that could finish a stale file later.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback

import numpy as np

from mpickpt.engine.staging import map_arrays

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


def writer_main(conn, parent_pid: int) -> None:
    """Serve write jobs until a None job or a closed pipe. Runs in the writer process."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import h5py  # noqa: F401  (import now, not during the first checkpoint)
    attached: dict[str, tuple] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(run_job(job, attached))


def run_job(job: dict, attached: dict) -> dict:
    """Write every file of `job`; {'ok': True, 'files': ..., 'bytes', 'seconds'} or an error. Local."""
    start = time.perf_counter()
    written: dict[str, dict] = {}
    current = None
    try:
        arrays = _attach(job["staging"], attached)
        total = 0
        for spec in job["files"]:
            current = spec["path"]
            size, payload = write_file(spec, arrays)
            written[spec["relpath"]] = {**spec["meta"], "size": size}
            total += payload
        return {"ok": True, "files": written, "bytes": total,
                "seconds": time.perf_counter() - start, "step": job["step"]}
    except Exception as e:  # reported to the trainer, never raised there
        for spec in job["files"]:
            _remove_quietly(spec["path"] + ".tmp")
        detail = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"ok": False, "error": f"{current or job.get('dir')}: {detail}", "step": job["step"]}


def _attach(staging: dict, attached: dict) -> dict:
    path = staging["path"]
    if path not in attached:
        attached.clear()
        attached[path] = map_arrays(path, staging["layout"], writable=False)
    return attached[path][1]


def write_file(spec: dict, arrays: dict) -> tuple[int, int]:
    """Write one shard or dense file atomically and durably; returns (file size, payload). Local."""
    import h5py

    from mpickpt.store.shard_file import FORMAT_VERSION, fsync_path

    os.makedirs(os.path.dirname(spec["path"]), exist_ok=True)
    tmp = spec["path"] + ".tmp"
    payload = 0
    with h5py.File(tmp, "w") as f:
        f.attrs["format_version"] = FORMAT_VERSION
        for key, value in spec["attrs"].items():
            f.attrs[key] = value
        for group, attrs in spec.get("group_attrs", {}).items():
            f.require_group(group).attrs.update(attrs)
        for name, source, ranges in spec["datasets"]:
            payload += _write(f, name, _gather(arrays[source], ranges))
        for name, raw in spec.get("blobs", {}).items():
            _write(f, name, np.frombuffer(raw, dtype=np.uint8))
    fsync_path(tmp)
    os.replace(tmp, spec["path"])
    fsync_path(os.path.dirname(spec["path"]))
    return os.path.getsize(spec["path"]), payload


def _write(f, name: str, data: np.ndarray) -> int:
    from mpickpt.store.shard_file import write_dataset

    folder, leaf = os.path.split(name)
    return write_dataset(f.require_group(folder) if folder else f, leaf, data)


def _gather(array: np.ndarray, ranges) -> np.ndarray:
    """Rows of `array` in the given [a, b) ranges (no copy for a single range). Local."""
    if ranges is None:
        return array
    if len(ranges) == 1:
        a, b = ranges[0]
        return array[a:b]
    return np.concatenate([array[a:b] for a, b in ranges])


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
