"""Durability helpers without HDF5: whole-file CRC32 and fsync by path (used by the shard files,
the manifests, the chunk index and the survivor dumps, which must not import h5py). Local."""
from __future__ import annotations

import os

from mpickpt.store.crc import crc32


def file_crc32(path: str, block: int = 1 << 22) -> int:
    """CRC32 of a whole file, read sequentially (the rate the disk and the CRC allow). Local."""
    with open(path, "rb") as f:
        return crc32_read(f, 0, None, block)


def crc32_read(f, crc: int, size: int | None, block: int = 1 << 22) -> int:
    """`crc` continued over the next `size` bytes of the open file `f` (None: to its end);
    ValueError naming the file when it ends first. Local."""
    left = size
    while left is None or left > 0:
        chunk = f.read(block if left is None else min(block, left))
        if not chunk:
            if left is None:
                break
            raise ValueError(f"{f.name}: ended {left} bytes early")
        crc = crc32(chunk, crc)
        if left is not None:
            left -= len(chunk)
    return crc


def fsync_path(path: str) -> None:
    """fsync a file or directory by path. Local."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
