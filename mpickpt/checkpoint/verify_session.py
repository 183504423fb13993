"""VerifySession: what verifying many checkpoints of one directory shares, so that each file is
opened once and its checksums are read once however many checkpoints use it.

Incremental checkpoints share files: a consecutive chain's baseline is a layer of every later
checkpoint, an IncrCP bundle serves many rectangles. The session keeps the files it opened (up to
`MAX_OPEN`, least recently used closed first), remembers each file's checksum problems, and keeps
the global ids it read per group (up to `GIDS_BUDGET` bytes) for the coverage checks. With
`jobs` > 1 the checksums of the files to check are read by a pool of spawned processes first
(HDF5 reads serialise within one process; a forked child would share the parent's open HDF5
files). It counts files, bytes and time, for the MB/s `mpickpt verify`
reports. Local: nothing here uses MPI.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor

import numpy as np

from mpickpt.store.durable import file_crc32
from mpickpt.store.shard_file import open_shard, read_rows, verify_file

MAX_OPEN = 256
"""Files kept open at once (each holds a file descriptor)."""
GIDS_BUDGET = 1 << 30
"""Bytes of global ids kept for coverage checks; beyond it the oldest are read again."""


class VerifySession:
    """Shared state of one verification run over one checkpoint root. Local."""

    def __init__(self, jobs: int = 1):
        self.jobs = max(1, int(jobs))
        self._open: OrderedDict[str, object] = OrderedDict()
        self._checked: dict[str, list[str]] = {}
        self._gids: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self._gid_bytes = 0
        self._pool: ProcessPoolExecutor | None = None
        self._intact: set[str] = set()
        """Files whose bytes equal their sealed manifest's whole-file CRC32: their attribute
        digest and block checksums cannot tell more, so reads from them skip both."""
        self.opens: dict[str, int] = {}
        """How often each path was opened (1 each unless more than MAX_OPEN were in use)."""
        self.bytes_checked = 0
        self.seconds = 0.0

    # ---- files --------------------------------------------------------------------------------
    def open(self, path: str):
        """The open shard file at `path` (checked attributes); CheckpointError as `open_shard`.
        The session closes it. Local."""
        f = self._open.get(path)
        if f is not None:
            self._open.move_to_end(path)
            return f
        f = open_shard(path, check_attrs=path not in self._intact)
        self.opens[path] = self.opens.get(path, 0) + 1
        self._open[path] = f
        while len(self._open) > MAX_OPEN:
            _, old = self._open.popitem(last=False)
            old.close()
        return f

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- checksums ----------------------------------------------------------------------------
    def checksums(self, path: str, crc: int | None = None) -> list[str]:
        """Problems of `path`'s bytes, checked once per session: against `crc`, the whole-file
        CRC32 its manifest records, in one sequential read; where there is none (IncrCP bundles,
        files written before manifests kept it), or it does not match (to name the damaged
        dataset), every dataset's block checksums. Local."""
        if path not in self._checked:
            start = time.perf_counter()
            self._record(path, crc, check_file(path, crc, self.open))
            self._count(path, time.perf_counter() - start)
        return self._checked[path]

    def _record(self, path: str, crc: int | None, problems: list[str]) -> None:
        self._checked[path] = problems
        if crc is not None and not problems:
            self._intact.add(path)

    def prefetch(self, paths: list[str], crcs: dict | None = None) -> None:
        """Check the files of `paths` not checked yet, `jobs` processes at a time. Local."""
        todo = [p for p in dict.fromkeys(paths) if p not in self._checked]
        if self.jobs == 1 or len(todo) < 2:
            return
        start = time.perf_counter()
        wanted = [(crcs or {}).get(p) for p in todo]
        if self._pool is None:  # one pool for the session: spawning costs more than a small file
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=mp.get_context("spawn"))
        for path, crc, problems in zip(todo, wanted, self._pool.map(check_file, todo, wanted)):
            self._record(path, crc, problems)
        elapsed = time.perf_counter() - start
        for path in todo:
            self._count(path, elapsed / len(todo))

    def _count(self, path: str, seconds: float) -> None:
        try:
            self.bytes_checked += os.path.getsize(path)
        except OSError:
            pass
        self.seconds += seconds

    # ---- global ids ---------------------------------------------------------------------------
    def gids(self, path: str, group, start: int, stop: int) -> np.ndarray:
        """Checksum-verified global ids of rows [start, stop) of `group` of `path` (the block
        checksums are skipped for an intact file: its whole-file CRC32 covered them). Local."""
        key = (path, group.name, start, stop)
        got = self._gids.get(key)
        if got is not None:
            self._gids.move_to_end(key)
            return got
        if path in self._intact:
            return self._keep(key, np.asarray(group["gids"][start:stop]))
        return self._keep(key, read_rows(group["gids"], start, stop, path))

    def memo(self, key, compute) -> np.ndarray:
        """`compute()`, remembered under `key` within the global-id budget. Local."""
        got = self._gids.get(key)
        if got is not None:
            self._gids.move_to_end(key)
            return got
        return self._keep(key, compute())

    def _keep(self, key, array: np.ndarray) -> np.ndarray:
        self._gids[key] = array
        self._gid_bytes += array.nbytes
        while self._gid_bytes > GIDS_BUDGET and len(self._gids) > 1:
            _, old = self._gids.popitem(last=False)
            self._gid_bytes -= old.nbytes
        return array

    def rate(self) -> str:
        """'N files, X MB in Y s (Z MB/s)' of the checksums read so far. Local."""
        mb = self.bytes_checked / 1e6
        return (f"{len(self._checked)} files, {mb:.1f} MB in {self.seconds:.2f} s "
                f"({mb / max(self.seconds, 1e-9):.0f} MB/s)")


def check_file(path: str, crc: int | None, opener=None) -> list[str]:
    """The problems of one file's bytes (see `VerifySession.checksums`). Local."""
    if crc is not None:
        try:
            if file_crc32(path) == crc:
                return []
        except OSError as e:
            return [f"{path}: cannot be read: {e}"]
    problems = verify_file(path, opener=opener)
    if crc is not None and not problems:
        problems = [f"{path}: whole-file CRC32 differs from the one its manifest records (the "
                    f"file changed after it was committed, outside any dataset)"]
    return problems
