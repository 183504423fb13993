"""Disk space held for a file before HDF5 writes it, handed over block by block.

HDF5 fails a full disk deep in its I/O (and h5py may not survive closing a file whose write
failed), so a file's writer first holds the room it needs in a sibling ``<file>.reserve``
(fallocate): a full disk fails there, cleanly, naming the path, before HDF5 starts; the space
then goes back to the filesystem just ahead of each block the file writes. Checkpoint writers
(`engine.writer_process`) and the IncrCP extractor's bundles (`incrcp.extraction`) use it.
Local: nothing here uses MPI.
"""
from __future__ import annotations

import os

from mpickpt.store.direct_io import PAGE

RESERVE_SLACK = 1.05  # HDF5 metadata and checksum datasets
RESERVE_EXTRA = 64 << 10
RELEASE_QUANTUM = 16 << 20  # reserved space goes back ahead of the writes at most this far
RELEASE_SHARE = 8  # ... and at most 1/8 of the file: a small file's space stays held meanwhile
SMALL_FILE = RELEASE_QUANTUM
"""Files up to this size (payload and slack) go without a reservation where the filesystem has
`AMPLE_BYTES` more room than they need."""
AMPLE_BYTES = 1 << 30


class Reservation:
    """Disk space held in a sibling file and handed to the HDF5 file block by block.

    Fails fast and cleanly (ENOSPC naming the path) when the filesystem cannot hold the file, before
    HDF5 is half way through it, and keeps the space held against other writers meanwhile.

    A small file (`SMALL_FILE`) on a filesystem with ample room (`AMPLE_BYTES` beyond what it
    needs, by statvfs) gets none: holding and giving back its space (fallocate, a truncation per
    eighth, an unlink) cost a fifth of an incremental checkpoint's writer CPU, and other writers
    would have to fill a gigabyte in the milliseconds it is written to make it fail; if they do,
    HDF5's ENOSPC names the file as well, and the checkpoint is abandoned as with any full
    disk (statvfs does not see user or project quotas: under one, a small file past it fails in
    HDF5 with EDQUOT, which the job's error names the same way). `held` says whether space is
    held. Local."""

    def __init__(self, path: str, payload: int):
        self.path = path + ".reserve"
        self.left = int(payload * RESERVE_SLACK) + RESERVE_EXTRA
        self.ahead = 0  # released, not yet written
        self.quantum = min(RELEASE_QUANTUM, max(PAGE, self.left // RELEASE_SHARE))
        self.fd = None
        if self.left <= SMALL_FILE and _free_bytes(path) >= self.left + AMPLE_BYTES:
            self.left = 0
            return
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(self.fd, 0, self.left)
        except OSError as e:
            self.close()
            raise OSError(e.errno, f"no room for {self.left / 1e6:.1f} MB: "
                                   f"{os.strerror(e.errno)}") from None

    def release(self, nbytes: int) -> None:
        """Make sure `nbytes` are back with the filesystem before HDF5 writes them. Local.

        Space goes back ahead of need, `quantum` at a time, so that a file of many small blocks
        does not pay one ftruncate (and the filesystem's extent work) per block, while the rest
        stays held: a writer beside this one (another rank on the same filesystem) cannot take
        the space this file is about to write into. The last 1/8 (and the metadata slack,
        released just before HDF5's close) can still be lost to such a race; HDF5's error then
        names the file, and the checkpoint is abandoned as with any full disk. Nothing to do
        where nothing is held."""
        if self.fd is None:
            return
        if self.ahead >= nbytes:
            self.ahead -= nbytes
            return
        amount = min(self.left, max(nbytes - self.ahead, self.quantum))
        self.left -= amount
        self.ahead = max(0, self.ahead + amount - nbytes)
        os.ftruncate(self.fd, self.left)

    @property
    def held(self) -> bool:
        return self.fd is not None

    def close(self) -> None:
        """Release everything and remove the reservation file. Safe twice. Local."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            _remove_quietly(self.path)


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path`'s directory (0
    when statvfs fails: then space is reserved). Local."""
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize




def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
