"""Packing of 2-, 3-, 4- and 8-bit codes, row by row, for any row dimension. Local.

Codes of one row are laid out little-endian in a bit stream: code j occupies bits
[j*bits, (j+1)*bits) of the row's bytes, so a 3-bit code may straddle two bytes. A packed row takes
ceil(dim * bits / 8) bytes. Packing works on whole-byte groups of codes (4 per byte at 2 bits, 2 at
4 bits, 8 codes in 3 bytes at 3 bits) with shifts over every row at once.
"""
from __future__ import annotations

import numpy as np

WIDTHS = (2, 3, 4, 8)


def packed_bytes(dim: int, bits: int) -> int:
    """Bytes of one packed row. Local."""
    check_width(bits)
    return -(-dim * bits // 8)


def check_width(bits: int) -> None:
    if bits not in WIDTHS:
        raise ValueError(f"bit width must be one of {WIDTHS}, got {bits!r}")


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """(n, dim) integer codes in [0, 2**bits) -> (n, packed_bytes) uint8. Local."""
    check_width(bits)
    codes = np.asarray(codes)
    n, dim = codes.shape
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(f"codes must lie in [0, {1 << bits}), got {codes.min()}..{codes.max()}")
    if bits == 8:
        return codes.astype(np.uint8)
    return _pack_groups(codes.astype(np.uint32, copy=False), bits, n, dim)


def _group(bits: int) -> tuple[int, int]:
    """(codes, bytes) of the smallest whole-byte group: 4 codes in 1 byte at 2 bits, 2 in 1 at 4,
    8 codes in 3 bytes at 3 bits."""
    return {2: (4, 1), 4: (2, 1), 3: (8, 3)}[bits]


def _pack_groups(codes: np.ndarray, bits: int, n: int, dim: int) -> np.ndarray:
    per, nbytes = _group(bits)
    padded = -(-dim // per) * per
    if padded != dim:
        codes = np.concatenate([codes, np.zeros((n, padded - dim), np.uint32)], axis=1)
    groups = codes.reshape(n, padded // per, per)
    word = groups[:, :, 0].copy()
    for k in range(1, per):
        word |= groups[:, :, k] << np.uint32(k * bits)
    out = np.empty((n, padded // per, nbytes), np.uint8)
    for b in range(nbytes):
        out[:, :, b] = word >> np.uint32(8 * b)
    return out.reshape(n, padded // per * nbytes)[:, :packed_bytes(dim, bits)]


def unpack(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Inverse of `pack`: (n, packed_bytes) uint8 -> (n, dim) uint8 codes. Local."""
    check_width(bits)
    packed = np.asarray(packed, dtype=np.uint8)
    if packed.shape[1] != packed_bytes(dim, bits):
        raise ValueError(f"packed rows of {packed.shape[1]} bytes, expected "
                         f"{packed_bytes(dim, bits)} for dim {dim} at {bits} bits")
    if bits == 8:
        return packed.copy()
    n = packed.shape[0]
    per, nbytes = _group(bits)
    ngroups = -(-dim // per)
    full = np.zeros((n, ngroups * nbytes), np.uint8)
    full[:, :packed.shape[1]] = packed
    word = np.zeros((n, ngroups), np.uint32)
    for b, byte in enumerate(np.moveaxis(full.reshape(n, ngroups, nbytes), 2, 0)):
        word |= byte.astype(np.uint32) << np.uint32(8 * b)
    mask = np.uint32((1 << bits) - 1)
    codes = np.empty((n, ngroups, per), np.uint8)
    for k in range(per):
        codes[:, :, k] = (word >> np.uint32(k * bits)) & mask
    return codes.reshape(n, ngroups * per)[:, :dim]
