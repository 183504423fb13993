"""Encoding, folding and decoding of parity units on torch tensors (CPU or CUDA).

A unit is one row of a shard seen as W int32 words: the bit patterns of its fp32 weights followed
by its optimizer state, so decoding is bitwise exact. Parity q of a stripe is
P_q = XOR_j C[q, j] * D_j over GF(2^8), bytewise (C from `gf256.cauchy`; row 0 is all ones, so
r = 1 is plain XOR). The code is linear, so an update of D_j from old to new changes P_q by
C[q, j] * (old XOR new): that is the difference a holder folds in. All functions are local.
"""
from __future__ import annotations

import numpy as np
import torch

from mpickpt.parity import gf256


class StripeCode:
    """The (k, r) code and its tables on one device."""

    def __init__(self, k: int, r: int, device):
        self.k, self.r = k, r
        self.matrix = gf256.cauchy(r, k)
        self._mul = torch.as_tensor(gf256.MUL, device=device)
        self._mul_np = np.ascontiguousarray(gf256.MUL, dtype=np.uint8)

    def scale(self, coef, words: torch.Tensor) -> torch.Tensor:
        """coef * words bytewise; `coef` an int or a uint8/int tensor with one value per row."""
        if isinstance(coef, (int, np.integer)):
            if coef == 1:
                return words
            table = self._mul[int(coef)]
            return torch.take(table, words.contiguous().view(torch.uint8).long()) \
                .view(torch.int32).view_as(words)
        coef = torch.as_tensor(coef, device=words.device).long()
        if bool((coef == 1).all()):
            return words
        b = words.contiguous().view(torch.uint8).view(len(words), -1).long()
        out = self._mul[coef[:, None], b]
        return out.view(torch.int32).view_as(words)

    @torch.no_grad()
    def fold(self, parity: torch.Tensor, prow: torch.Tensor, coef, delta: torch.Tensor) -> None:
        """parity[prow] ^= coef * delta; `prow` may repeat (every delta lands). In place.

        One call of the compiled CPU kernel (kernels/parity_fold_cpu.c) or of the CUDA kernel
        (kernels/parity_fold.cu) where they are present, else torch indexing."""
        if len(prow) == 0:
            return
        coef = torch.as_tensor(coef).to(torch.uint8).expand(len(prow)).contiguous()
        if parity.is_cuda and _cuda_fold() is not None:  # one launch, CuPy kernel
            _cuda_fold()(parity, prow.to(parity.device), coef.to(parity.device),
                         delta.contiguous())
            return
        if not parity.is_cuda and _cpu_fold() is not None:
            _cpu_fold()(parity.numpy(), parity.shape[1], prow.cpu().to(torch.int64).numpy(),
                        coef.cpu().numpy(), delta.contiguous().cpu().numpy(), self._mul_np)
            return
        prow = prow.to(parity.device)
        for level in _repeat_levels(prow):
            p = prow[level]
            parity.index_copy_(0, p, torch.bitwise_xor(
                parity.index_select(0, p), self.scale(coef[level.cpu()], delta[level])))

    def encode(self, q: int, data: list[torch.Tensor]) -> torch.Tensor:
        """Parity unit q of stripes whose k data units are `data[j]` (n, W) each."""
        out = torch.zeros_like(data[0])
        for j, d in enumerate(data):
            out ^= self.scale(int(self.matrix[q, j]), d)
        return out

    def recover_one(self, others: list[torch.Tensor]) -> torch.Tensor:
        """r = 1 only: the one lost unit of stripes, data or parity alike, from the other k units
        ((n, W) each): their XOR, since the parity is the XOR of the data."""
        if self.r != 1 or len(others) != self.k:
            raise ValueError(f"recover_one needs r = 1 and the other {self.k} units, got r={self.r} "
                             f"and {len(others)} units")
        out = others[0].clone()
        for u in others[1:]:
            out.bitwise_xor_(u)
        return out

    def decode(self, data: dict[int, torch.Tensor], parity: dict[int, torch.Tensor],
               erased: list[int]) -> dict[int, torch.Tensor]:
        """The erased data units of stripes sharing one erasure pattern.

        `data`: available data units by data index j; `parity`: available parity units by q (at
        least len(erased) of them); returns {j: (n, W)} for j in `erased`."""
        if not erased:
            return {}
        qs = sorted(parity)[:len(erased)]
        if len(qs) < len(erased):
            raise ValueError(f"{len(erased)} data units erased but only {len(parity)} parity "
                             f"units survive")
        syndromes = []
        for q in qs:
            s = parity[q].clone()
            for j, d in data.items():
                s ^= self.scale(int(self.matrix[q, j]), d)
            syndromes.append(s)
        minv = gf256.mat_inv(self.matrix[np.ix_(qs, erased)])
        out = {}
        for a, j in enumerate(erased):
            d = torch.zeros_like(syndromes[0])
            for b in range(len(qs)):
                d ^= self.scale(int(minv[a, b]), syndromes[b])
            out[j] = d
        return out


def _repeat_levels(prow: torch.Tensor) -> list[torch.Tensor]:
    """Positions of `prow` split into levels without repeats: the first occurrence of every row,
    then the second, ... Local."""
    order = torch.argsort(prow, stable=True)
    sorted_rows = prow[order]
    new = torch.ones(len(prow), dtype=torch.bool, device=prow.device)
    new[1:] = sorted_rows[1:] != sorted_rows[:-1]
    idx = torch.arange(len(prow), device=prow.device)
    start = torch.cummax(torch.where(new, idx, torch.zeros_like(idx)), 0).values
    level = idx - start
    return [order[level == v] for v in range(int(level.max()) + 1)]


def _cpu_fold():
    """`mpickpt._parity_cpu.fold_rows` where it was built, else None (cached)."""
    global _CPU_FOLD
    if _CPU_FOLD is False:
        try:
            from mpickpt import _parity_cpu

            _CPU_FOLD = _parity_cpu.fold_rows
        except ImportError:
            _CPU_FOLD = None
    return _CPU_FOLD


_CPU_FOLD = False


def _cuda_fold():
    """`cuda_kernels.fold_cuda` when CuPy and a GPU are there, else None (cached)."""
    global _FOLD
    if _FOLD is False:
        from mpickpt.parity import cuda_kernels

        _FOLD = cuda_kernels.fold_cuda if cuda_kernels.available() else None
    return _FOLD


_FOLD = False
