"""The rows of a bit-vector's set bits on the CPU: bit b of 64-bit word i is row 64 i + b.

`RowBitVector.extract` runs in a checkpoint's stall, on the training thread, for every kind that
tracks rows. Vectorized in torch, it expanded each non-zero word into 64 lanes: with ~300k changed
rows spread over a rank's 17M (the Criteo Kaggle tables on 2 ranks) that is a temporary of 100+ MB
and most of the ~170 ms an incremental save blocked training for, against 8.5 ms for copying the
rows. The kernel (`kernels/row_bits_cpu.c`, `mpickpt._row_bits_cpu`) walks the words once and each
set bit once; without it, numpy unpacks only the non-zero bytes. The same rows, ascending, either
way. Local: nothing here uses MPI.
"""
from __future__ import annotations

import numpy as np

try:
    from mpickpt import _row_bits_cpu as KERNEL
except ImportError:  # built without a C compiler
    KERNEL = None


def set_rows(words: np.ndarray) -> np.ndarray:
    """Ascending positions of the set bits of `words` (64-bit words, int64 or uint64; ValueError
    for other item sizes). Local."""
    words = _words(words)
    if KERNEL is None:
        return _unpacked(words)
    out = np.empty(KERNEL.count(words), dtype=np.int64)
    if KERNEL.rows(words, out) != len(out):  # more bits: the kernel raised already
        raise ValueError(f"the bit-vector's words changed while their {len(out)} set bits "
                         f"were read")
    return out


def _words(words: np.ndarray) -> np.ndarray:
    """`words` as aligned, C-contiguous native uint64 (copied only where they are not);
    ValueError for items that are not 64-bit integers. Local."""
    words = np.asarray(words)
    if words.dtype.itemsize != 8 or words.dtype.kind not in "iu":
        raise ValueError(f"bit-vector words must be 64-bit integers, got {words.dtype}")
    if not words.dtype.isnative:
        words = words.astype(words.dtype.newbyteorder("="))
    return np.require(words, requirements="CA").view(np.uint64)


def unpacked(words: np.ndarray) -> np.ndarray:
    """`set_rows` by numpy: the non-zero bytes of the words (in little-endian order, on any host)
    unpacked into bits. Local."""
    return _unpacked(_words(words))


def _unpacked(words: np.ndarray) -> np.ndarray:
    """`unpacked` of words `_words` gave already."""
    data = np.ascontiguousarray(words, dtype="<u8").view(np.uint8)
    nonzero = np.flatnonzero(data)
    byte, bit = np.nonzero(np.unpackbits(data[nonzero][:, None], axis=1, bitorder="little"))
    return nonzero[byte].astype(np.int64) * 8 + bit
