"""CRC32 (zlib's) of a file from the CRCs of its pieces, without reading the pieces again. Local.

A writer that already knows the CRC32 of each block it wrote (the per-block checksums of the shard
files) gets the whole file's CRC by reading only the bytes between those blocks (HDF5's metadata)
and combining: crc(A + B) = shift(crc(A), len(B)) ^ crc(B), where shift appends len(B) zero bytes
to A's CRC register, a linear map over GF(2) (zlib's crc32_combine, which Python's zlib does not
expose). The maps for 2^k zero bytes are built once per process; shifting a CRC by a length applies
one of them per set bit of the length (a 4 MB block: one), with no map built per length (the blocks
of incremental files end in lengths that never repeat).
"""
from __future__ import annotations

import os
from functools import cache

from mpickpt.store.durable import crc32_pread

POLY = 0xEDB88320  # CRC-32 (IEEE 802.3), reflected


def _apply(mat: tuple[int, ...], vec: int) -> int:
    """The 32x32 GF(2) matrix `mat` (column i: the image of bit i) times the 32-bit `vec`."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The map `a` after `b`."""
    return tuple(_apply(a, col) for col in b)


@cache
def _zero_bytes(k: int) -> tuple[int, ...]:
    """The map that appends 2^k zero bytes to a CRC register."""
    if k == 0:
        bit = (POLY,) + tuple(1 << i for i in range(31))  # one zero bit
        m = bit
        for _ in range(3):  # 2, 4, 8 bits
            m = _compose(m, m)
        return m
    half = _zero_bytes(k - 1)
    return _compose(half, half)


def _shifted(crc: int, length: int) -> int:
    """`crc` with `length` zero bytes appended to its register."""
    k = 0
    while length:
        if length & 1:
            crc = _apply(_zero_bytes(k), crc)
        length >>= 1
        k += 1
    return crc


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32 of A followed by B from crc32(A), crc32(B) and len(B)."""
    if len_b <= 0:
        return crc_a
    return _shifted(crc_a, len_b) ^ crc_b


class BlockLog:
    """Where a writer put blocks of known CRC32: (file offset, [(crc, length), ...]) per dataset,
    for `file_crc32_from_regions`. Local."""

    def __init__(self):
        self.regions: list[tuple[int, list[tuple[int, int]]]] = []

    def add(self, offset: int | None, blocks: list[tuple[int, int]]) -> None:
        """A dataset's contiguous data at `offset` (None: no storage, nothing to add)."""
        if offset is not None and blocks:
            self.regions.append((int(offset), list(blocks)))


def file_crc32_from_regions(path: str, regions: list[tuple[int, list[tuple[int, int]]]]) -> int:
    """CRC32 of the file at `path` whose byte ranges starting at each region's offset are blocks
    of known (crc, length), in order: only the bytes outside the regions are read, without
    readahead (which would pull the blocks' pages, written past the page cache, back into it
    from disk: up to the device's read_ahead_kb, 8 MB here, per read). Regions must not overlap;
    a region past the end of the file is an error. Local."""
    size = os.path.getsize(path)
    crc, pos = 0, 0
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for offset, blocks in sorted(regions):
            end = offset + sum(n for _, n in blocks)
            if offset < pos or end > size:
                raise ValueError(f"{path}: a region [{offset}, {end}) overlaps another or runs "
                                 f"past the end of the file ({size} bytes)")
            crc = crc32_pread(fd, path, crc, pos, offset)
            for block_crc, n in blocks:
                crc = crc32_combine(crc, block_crc, n)
            pos = end
        return crc32_pread(fd, path, crc, pos, size)
    finally:
        os.close(fd)
