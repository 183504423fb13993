"""Packing of 2-, 3-, 4- and 8-bit codes, row by row, for any row dimension. Local.

Codes of one row are laid out little-endian in a bit stream: code j occupies bits
[j*bits, (j+1)*bits) of the row's bytes, so a 3-bit code may straddle two bytes. A packed row takes
ceil(dim * bits / 8) bytes.
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
    # bit j*bits + b of each row is bit b of code j
    planes = (codes[:, :, None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & 1
    stream = planes.reshape(n, dim * bits)
    return np.packbits(stream, axis=1, bitorder="little")


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
    stream = np.unpackbits(packed, axis=1, count=dim * bits, bitorder="little")
    planes = stream.reshape(n, dim, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=2, dtype=np.uint8)
