"""Arithmetic in GF(2^8) (polynomial x^8 + x^4 + x^3 + x^2 + 1, 0x11d) with vectorized tables, and
the systematic Cauchy code used for r >= 2 parity rows.

Why own tables instead of a library: the code needs only "multiply a byte array by a constant",
"add (XOR)" and the inverse of an r x r matrix. With a 256 x 256 product table that is one gather
per byte in torch (so the same code runs on CPU tensors and CUDA tensors), with no native build
(pyeclib needs liberasurecode from the system) and no JIT (galois pulls in numba, which takes seconds
to import on every rank). All functions are local and pure.
"""
from __future__ import annotations

import numpy as np

POLY = 0x11D


def _tables() -> tuple[np.ndarray, np.ndarray]:
    exp = np.zeros(512, dtype=np.uint8)
    log = np.zeros(256, dtype=np.int32)
    v = 1
    for i in range(255):
        exp[i] = v
        log[v] = i
        v <<= 1
        if v & 0x100:
            v ^= POLY
    exp[255:510] = exp[0:255]
    return exp, log


EXP, LOG = _tables()


def _mul_table() -> np.ndarray:
    a = np.arange(256)
    out = EXP[(LOG[a][:, None] + LOG[a][None, :]) % 255].astype(np.uint8)
    out[0, :] = 0
    out[:, 0] = 0
    return out


MUL = _mul_table()
"""MUL[a, b] = a * b in GF(2^8), uint8 (256, 256)."""


def mul(a: int, b: int) -> int:
    return int(MUL[a, b])


def inv(a: int) -> int:
    if a == 0:
        raise ZeroDivisionError("0 has no inverse in GF(2^8)")
    return int(EXP[(255 - LOG[a]) % 255])


def mat_inv(m: np.ndarray) -> np.ndarray:
    """Inverse of a square uint8 matrix over GF(2^8) by Gauss-Jordan; ValueError if singular."""
    n = len(m)
    a = np.concatenate([np.asarray(m, dtype=np.uint8), np.eye(n, dtype=np.uint8)], axis=1)
    for col in range(n):
        pivot = next((r for r in range(col, n) if a[r, col]), None)
        if pivot is None:
            raise ValueError("matrix is singular over GF(2^8)")
        a[[col, pivot]] = a[[pivot, col]]
        a[col] = MUL[inv(int(a[col, col])), a[col]]
        for r in range(n):
            if r != col and a[r, col]:
                a[r] ^= MUL[int(a[r, col]), a[col]]
    return a[:, n:].copy()


def cauchy(r: int, k: int) -> np.ndarray:
    """(r, k) coding matrix: Cauchy 1 / (x_i + y_j) with x_i = i, y_j = r + j, rows and columns
    scaled so that row 0 and column 0 are all ones. Scaling keeps every square submatrix
    non-singular, so [I; C] is MDS (any k of the k + r units recover the rest), and row 0 is
    plain XOR: r = 1 parity is exactly the XOR of the data."""
    if r + k > 256:
        raise ValueError(f"k + r must be at most 256 for GF(2^8), got k={k}, r={r}")
    c = np.array([[inv(i ^ (r + j)) for j in range(k)] for i in range(r)], dtype=np.uint8)
    col = np.array([inv(int(v)) for v in c[0]], dtype=np.uint8)
    c = MUL[c, col[None, :]]
    row = np.array([inv(int(v)) for v in c[:, 0]], dtype=np.uint8)
    return MUL[row[:, None], c]
