"""Durability helpers without HDF5: whole-file CRC32 and fsync by path (used by the shard files,
the manifests, the chunk index and the survivor dumps, which must not import h5py). Local."""
from __future__ import annotations

import os

from mpickpt.store.crc import crc32


def file_crc32(path: str) -> int:
    """CRC32 of a whole file, read sequentially (the rate the disk and the CRC allow). Local."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return crc32_pread(fd, path, 0, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def crc32_pread(fd: int, path: str, crc: int, start: int, stop: int,
                block: int = 1 << 22) -> int:
    """`crc` continued over bytes [start, stop) of the open file `fd`; ValueError naming `path`
    when it ends first. Local."""
    while start < stop:
        chunk = os.pread(fd, min(block, stop - start), start)
        if not chunk:
            raise ValueError(f"{path}: ended {stop - start} bytes early")
        crc = crc32(chunk, crc)
        start += len(chunk)
    return crc


def fsync_path(path: str) -> None:
    """fsync a file or directory by path. Local."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
