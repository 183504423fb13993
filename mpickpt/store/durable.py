"""Durability helpers without HDF5: whole-file CRC32 and fsync by path (used by the shard files,
the manifests, the chunk index and the survivor dumps, which must not import h5py). Local."""
from __future__ import annotations

import os
import zlib


def file_crc32(path: str, block: int = 1 << 22) -> int:
    """CRC32 of a whole file, read sequentially (the rate the disk and zlib allow). Local."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            crc = zlib.crc32(chunk, crc)
    return crc


def fsync_path(path: str) -> None:
    """fsync a file or directory by path. Local."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
