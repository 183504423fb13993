"""Per-row uniform quantization and Check-N-Run's adaptive (greedy) range search. Local.

A row x is stored as codes q in [0, 2**bits) with a per-row scale and offset (float16, as FBGEMM's
fused rows): x ~ scale * q + offset. Every search below evaluates candidate ranges with the
float16-rounded parameters it would store, so the loss it minimises is the loss of the checkpoint.
All functions work on every row of a chunk at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PARAM_DTYPE = np.float16
DEFAULT_BINS = {2: 25, 3: 25, 4: 45}
"""Check-N-Run's defaults (§5.2): 25 bins at 2 and 3 bits, 45 at 4 bits."""
DEFAULT_RATIO = {2: 0.5, 3: 0.2, 4: 0.2}
"""Check-N-Run's defaults: 0.5 at 2 bits, 0.2 at 3 bits; the paper gives none for 4 bits, 0.2 here."""


@dataclass
class Quantized:
    """Codes (n, dim) uint8 and float16 scale/offset (n,) of a chunk of rows."""

    codes: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int

    def dequantize(self) -> np.ndarray:
        return dequantize(self.codes, self.scale, self.offset)


def params(lo: np.ndarray, hi: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 (scale, offset) mapping [lo, hi] onto [0, 2**bits - 1]. Local."""
    levels = (1 << bits) - 1
    scale = ((hi - lo) / levels).astype(PARAM_DTYPE)
    return scale, lo.astype(PARAM_DTYPE)


def encode(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> np.ndarray:
    """Nearest codes of rows `x` for the given parameters. Local."""
    s = scale.astype(np.float32)[:, None]
    safe = np.where(s > 0, s, 1.0)
    q = np.rint((x - offset.astype(np.float32)[:, None]) / safe)
    return np.clip(q, 0, (1 << bits) - 1).astype(np.uint8)


def dequantize(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    return (codes.astype(np.float32) * scale.astype(np.float32)[:, None]
            + offset.astype(np.float32)[:, None])


def row_loss(x: np.ndarray, scale, offset, bits: int) -> np.ndarray:
    """Squared L2 error per row of quantizing `x` with these parameters. Local."""
    err = dequantize(encode(x, scale, offset, bits), scale, offset) - x
    return np.einsum("ij,ij->i", err, err)


def asymmetric(x: np.ndarray, bits: int) -> Quantized:
    """Range [min, max] of each row. Local."""
    return _quantize(x, x.min(axis=1), x.max(axis=1), bits)


def symmetric(x: np.ndarray, bits: int) -> Quantized:
    """Range [-max|x|, max|x|] of each row. Local."""
    a = np.abs(x).max(axis=1)
    return _quantize(x, -a, a, bits)


def greedy(x: np.ndarray, bits: int, num_bins: int | None = None,
           ratio: float | None = None) -> Quantized:
    """Check-N-Run's adaptive asymmetric search: from [min, max], repeatedly move x_min up or
    x_max down by (max - min) / num_bins, whichever quantizes with lower loss, until the range has
    shrunk by `ratio` of the original; keep the best range seen (never worse than asymmetric)."""
    scale, offset = greedy_params(x, bits, num_bins, ratio)
    return Quantized(encode(x, scale, offset, bits), scale, offset, bits)


def greedy_params(x, bits, num_bins=None, ratio=None):
    num_bins = DEFAULT_BINS.get(bits, 25) if num_bins is None else num_bins
    ratio = DEFAULT_RATIO.get(bits, 0.2) if ratio is None else ratio
    if num_bins < 1 or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"num_bins must be >= 1 and ratio in [0, 1], got {num_bins}, {ratio}")
    lo, hi = x.min(axis=1).astype(np.float32), x.max(axis=1).astype(np.float32)
    step = (hi - lo) / num_bins
    best_s, best_o = params(lo, hi, bits)
    best = row_loss(x, best_s, best_o, bits)
    for _ in range(int(num_bins * ratio)):
        up_s, up_o = params(lo + step, hi, bits)
        down_s, down_o = params(lo, hi - step, bits)
        up, down = row_loss(x, up_s, up_o, bits), row_loss(x, down_s, down_o, bits)
        take_up = up < down
        lo, hi = np.where(take_up, lo + step, lo), np.where(take_up, hi, hi - step)
        loss = np.where(take_up, up, down)
        better = loss < best
        best = np.where(better, loss, best)
        best_s = np.where(better, np.where(take_up, up_s, down_s), best_s)
        best_o = np.where(better, np.where(take_up, up_o, down_o), best_o)
    return best_s, best_o


def refined(x: np.ndarray, bits: int, num_bins: int | None = None, ratio: float | None = None,
            rounds: int = 3) -> Quantized:
    """The greedy range, then least-squares refinement: with the codes fixed, the best scale and
    offset are a per-row linear regression of x on q; re-encode and repeat. A row keeps whichever
    parameters gave its lowest loss, so this is never worse than `greedy`."""
    scale, offset = greedy_params(x, bits, num_bins, ratio)
    best = row_loss(x, scale, offset, bits)
    for _ in range(rounds):
        q = encode(x, scale, offset, bits).astype(np.float32)
        qm, xm = q.mean(axis=1), x.mean(axis=1)
        dq = q - qm[:, None]
        var = np.einsum("ij,ij->i", dq, dq)
        s = np.where(var > 0, np.einsum("ij,ij->i", dq, x - xm[:, None]) / np.maximum(var, 1e-30),
                     0.0)
        s = np.maximum(s, 0.0)
        cand_s, cand_o = s.astype(PARAM_DTYPE), (xm - s * qm).astype(PARAM_DTYPE)
        loss = row_loss(x, cand_s, cand_o, bits)
        better = loss < best
        best = np.where(better, loss, best)
        scale, offset = np.where(better, cand_s, scale), np.where(better, cand_o, offset)
    return Quantized(encode(x, scale, offset, bits), scale, offset, bits)


def _quantize(x, lo, hi, bits) -> Quantized:
    scale, offset = params(lo.astype(np.float32), hi.astype(np.float32), bits)
    return Quantized(encode(x, scale, offset, bits), scale, offset, bits)
