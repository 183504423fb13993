"""Where a group member's units of a run of whole periods lie: data slot j of period p is its row
p k + j (rows short of the padding only), parity q its parity row p r + q. Rebuild rounds move a
chunk of periods by these strided slices instead of by stripe numbers. All functions are local
and touch only the tensors they are given."""
from __future__ import annotations

import numpy as np
import torch


def slot_rows(layout, pos: int, j: int, p0: int, n: int) -> tuple[int, int]:
    """(first row, how many are real) of data slot j of position `pos` over periods
    [p0, p0 + n): rows first, first + k, ... short of the padding."""
    first = p0 * layout.k + j
    return first, min(n, max(0, -(-(layout.rows[pos] - first) // layout.k)))


def move_range(layout, pos: int, words, parity: torch.Tensor, pbase: int, p0: int,
               units: torch.Tensor, to_units: bool, xor: bool = False) -> None:
    """Copy between a member's rows (`words`: a RowWords, or a span of one) and parity rows
    (`parity`, whose row 0 is parity row `pbase`) of the periods [p0, p0 + n) and `units`
    ((n, g, W), stripe order within a period), in the direction `to_units` (`xor`: XOR into
    `units` instead of copying; padding contributes zeros)."""
    L, n = layout, len(units)
    for j, o in enumerate(L.data_offsets(pos)):
        first, real = slot_rows(L, pos, j, p0, n)
        if xor:
            words.xor_every(first, L.k, units[:real, o])
        elif to_units:
            words.read_every(first, L.k, units[:real, o])
            units[real:, o] = 0
        else:
            words.write_every(first, L.k, units[:real, o])
    for q in range(L.r):
        o = (pos - q) % L.g
        held = parity[p0 * L.r + q - pbase:(p0 + n) * L.r - pbase:L.r]
        if xor:
            units[:, o].bitwise_xor_(held)
        elif to_units:
            units[:, o] = held
        else:
            held.copy_(units[:, o])


def segments(widths: list[int]) -> list[tuple[int, int, int]]:
    """(first word, width, row tensor) of each row tensor's part of a unit."""
    return [(sum(widths[:i]), w, i) for i, w in enumerate(widths)]


def slot_view(layout, pos: int, words, parity: torch.Tensor, pbase: int, o: int, p0: int,
              n: int, segment: tuple[int, int, int]) -> tuple[torch.Tensor, int]:
    """Words [c, c + w) (`segment`) of position `pos`'s units at offset `o` of periods
    [p0, p0 + n): a (rows, w) int32 view of its row tensor i (a data slot; its real rows only)
    or of its parity rows, and how many rows it has."""
    L, (c, w, i) = layout, segment
    q = (pos - o) % L.g
    if q < L.r:
        return parity[p0 * L.r + q - pbase:(p0 + n) * L.r - pbase:L.r, c:c + w], n
    j = int(np.flatnonzero(L.data_offsets(pos) == o)[0])
    first, real = slot_rows(L, pos, j, p0, n)
    t = words.tensors[i]
    a = first - words.base
    rows = t[a:a + max(real - 1, 0) * L.k + 1:L.k] if real else t[:0]
    return rows.reshape(real, w).view(torch.int32), real
