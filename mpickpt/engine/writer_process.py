"""Background checkpoint writer: a spawned process that turns staged arrays into HDF5 files.

This module must never import mpi4py (a spawned child that initialises MPI can hang the job) nor
torch (start-up time). It receives jobs over a pipe, writes each file to a temporary name block by
block, fsyncs it, renames it into place, fsyncs the directory, and answers with the sizes or with an
error naming the path. It dies with its parent (PR_SET_PDEATHSIG), so a killed rank leaves no
writer behind that could finish a stale file later.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

from mpickpt.background import die_with_parent, error_line, ignore_job_signals, serve
from mpickpt.engine.staging import map_arrays
from mpickpt.store.dense_file import pack
from mpickpt.store.direct_io import direct_file
from mpickpt.store.reservation import Reservation
from mpickpt.store.attr_digest import AttrRecord
from mpickpt.store.row_gather import take_rows
from mpickpt.store.shard_file import FORMAT_VERSION, alignment, open_hdf5, seal_attributes


def writer_main(conn, parent_pid: int) -> None:
    """Serve write jobs until a None job or a closed pipe. Runs in the writer process."""
    die_with_parent(parent_pid)
    ignore_job_signals()
    import h5py  # noqa: F401  (import now, not during the first checkpoint)

    sys.unraisablehook = lambda _: None  # h5py's dealloc noise after a failed write; reported below
    attached: dict[str, tuple] = {}
    serve(conn, lambda job: run_job(job, attached))


def run_job(job: dict, attached: dict) -> dict:
    """Write every file of `job`; {'ok': True, 'files': ..., 'bytes', 'seconds'} or an error. Local."""
    start, cpu = time.perf_counter(), time.process_time()
    written: dict[str, dict] = {}
    current = None
    try:
        arrays = _attach(job["staging"], attached)
        total = 0
        for spec in job["files"]:
            current = spec.path
            size, payload, crc = write_file(spec, arrays, job.get("align", 0),
                                            job.get("codec_threads", 1),
                                            job.get("io", "buffered") == "direct")
            written[spec.relpath] = {**spec.meta, "size": size, "crc32": crc}
            total += payload
        return {"ok": True, "files": written, "bytes": total,
                "seconds": time.perf_counter() - start, "step": job["step"],
                "cpu_seconds": time.process_time() - cpu}
    except Exception as e:  # reported to the trainer, never raised there
        for spec in job["files"]:
            _remove_quietly(spec.path + ".tmp")
        detail = error_line(e)
        return {"ok": False, "error": f"{current or job.get('dir')}: {detail}", "step": job["step"]}


def _attach(staging: dict, attached: dict) -> dict:
    path = staging["path"]
    if path not in attached:
        attached.clear()
        attached[path] = map_arrays(path, staging["layout"], writable=False)
    return attached[path][1]


DIRECT_ROLES = ("shard", "dense", "extra")
"""Files whose large datasets `direct` writes bypass the page cache. An IncrCP column ('chunk')
is read back by the extractor right away, from the page cache."""


def write_file(spec, arrays: dict, align: int = 0, codec_threads: int = 1,
               direct: bool = False) -> tuple[int, int, int]:
    """Write one shard or dense file atomically and durably; returns (file size, payload, CRC32
    of the whole file, which the manifest keeps so that `mpickpt verify` can check the file at
    the speed of a sequential read). Datasets of at least `align` bytes start at a multiple of
    `align` (0: packed); quantized ones are encoded on `codec_threads` threads. `direct`: the
    large datasets of a file of `DIRECT_ROLES` are written with O_DIRECT (`store.direct_io`).
    Local."""
    from mpickpt.store.crc_combine import BlockLog, file_crc32_from_regions
    from mpickpt.store.durable import fsync_path

    os.makedirs(os.path.dirname(spec.path), exist_ok=True)
    tmp = spec.path + ".tmp"
    payload, padding = _payload_bytes(spec, arrays, align)
    reservation = Reservation(spec.path, payload + padding)
    log = BlockLog()
    try:
        payload = _write_hdf5(tmp, spec, arrays, reservation, align, log, codec_threads,
                              direct and spec.role in DIRECT_ROLES)
    finally:
        reservation.close()
    fsync_path(tmp)
    # the blocks' CRCs are known: read back only the bytes between them (HDF5's metadata)
    crc = file_crc32_from_regions(tmp, log.regions)
    os.replace(tmp, spec.path)
    fsync_path(os.path.dirname(spec.path))
    return os.path.getsize(spec.path), payload, crc


def _write_hdf5(tmp: str, spec, arrays: dict, reservation: Reservation, align: int,
                log=None, codec_threads: int = 1, direct: bool = False) -> int:
    payload = 0
    with open_hdf5(tmp, "w", **alignment(align)) as f, direct_file(tmp, direct) as sink:
        record = AttrRecord()
        record.set(f, {"format_version": FORMAT_VERSION, **spec.attrs})
        codecs, groups = spec.codecs, GroupCache(f, sink)
        for group, attrs in spec.group_attrs.items():
            record.set(groups.group(group), attrs)
        for name, source, ranges in spec.datasets:
            data = _gather(arrays[source], ranges)
            if source in codecs:  # quantized here, block by block, in the background
                payload += _write_encoded(groups, name, data, codecs[source],
                                          reservation.release, log, codec_threads)
            else:
                payload += _write(groups, name, data, reservation.release, log)
        for name, raw in spec.blobs.items():
            _write(groups, name, np.frombuffer(raw, dtype=np.uint8), reservation.release, log)
        for name, (entries, size, prefix) in spec.packs.items():
            payload += _write(groups, name, pack(entries, size, arrays, prefix),
                              reservation.release, log)
        seal_attributes(f, record)
        reservation.close()  # the rest covers HDF5's metadata, written at close
    return payload


def _payload_bytes(spec, arrays: dict, align: int = 0) -> tuple[int, int]:
    """(bytes of the file's datasets, as stored: a quantized one's encoded size; at most how
    much alignment padding they add: less than `align` before each array of a dataset of at
    least `align` bytes). Local."""
    total = sum(len(raw) for raw in spec.blobs.values())
    total += sum(size for _, size, _ in spec.packs.values())
    padding = sum(align for _, size, _ in spec.packs.values() if 0 < align <= size)
    for _, source, ranges in spec.datasets:
        a = arrays[source]
        if ranges is None and source not in spec.codecs:
            parts = [a.nbytes]  # any shape: a dense array, a scalar
        else:
            parts = _row_parts(spec, source, a, ranges)
        total += sum(parts)
        padding += sum(align for size in parts if 0 < align <= size)
    return total, padding


def _row_parts(spec, source: str, a: np.ndarray, ranges) -> list[int]:
    """Stored bytes of the rows `ranges` of the row array `a`, per array that holds them: one
    plain array, or a quantized one's codes and each row's range (scale and offset, or
    centroids). Local."""
    rows = a.shape[0] if ranges is None else len(ranges) \
        if isinstance(ranges, np.ndarray) else sum(b - lo for lo, b in ranges)
    if source not in spec.codecs:
        return [rows * (a.nbytes // max(a.shape[0], 1))]
    from mpickpt.quant.codecs import Codec
    from mpickpt.quant.packing import packed_bytes

    codec = Codec(**spec.codecs[source])
    dim = int(np.prod(a.shape[1:]))  # as encoded, (n, -1); a row-wise state: 1 a row
    if codec.name in ("fp32", "fp16"):
        return [rows * codec.bytes_per_row(dim)]
    codes = rows * packed_bytes(dim, codec.bits)
    if codec.name == "kmeans":
        return [codes, rows * 2 * (1 << codec.bits)]
    return [codes, rows * 2, rows * 2]


class GroupCache:
    """The groups of one file being written, opened or created once each (h5py's
    require_group is two lookups per call, and a shard file has a few datasets per group), and
    the file's `DirectFile` (or None) for its datasets' blocks. Local."""

    def __init__(self, f, direct=None):
        self.f, self.open, self.direct = f, {}, direct

    def group(self, folder: str):
        """The group `folder` (a path under the file's root), created if it does not exist."""
        if folder not in self.open:
            from mpickpt.store.h5_lowlevel import create_group

            try:
                self.open[folder] = create_group(self.f, folder)
            except ValueError:  # exists already (made as an intermediate group)
                self.open[folder] = self.f[folder]
        return self.open[folder]

    def parent(self, name: str):
        """(group holding dataset `name`, the dataset's leaf name)."""
        folder, leaf = os.path.split(name)
        return (self.group(folder) if folder else self.f), leaf


def _write(groups: GroupCache, name: str, data: np.ndarray, before_block, log=None) -> int:
    from mpickpt.store.shard_file import write_dataset

    parent, leaf = groups.parent(name)
    return write_dataset(parent, leaf, data, before_block, log, groups.direct)


def _write_encoded(groups: GroupCache, name: str, data: np.ndarray, codec: dict, before_block,
                   log=None, threads: int = 1) -> int:
    from mpickpt.quant.codecs import Codec
    from mpickpt.store.row_arrays import write_encoded

    parent, leaf = groups.parent(name)
    return write_encoded(parent, leaf, data, Codec(**{**codec, "threads": threads}), before_block,
                         log, groups.direct)


def _gather(array: np.ndarray, ranges) -> np.ndarray:
    """Rows of `array` in the given [a, b) ranges (no copy for a single range). Local."""
    if ranges is None:
        return array
    if isinstance(ranges, np.ndarray):  # selected rows of an incremental checkpoint
        return take_rows(array, ranges)
    if len(ranges) == 1:
        a, b = ranges[0]
        return array[a:b]
    return np.concatenate([array[a:b] for a, b in ranges])


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
