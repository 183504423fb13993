"""Where a group member's units of a run of whole periods lie: data slot j of period p is its row
p k + j (rows short of the padding only), parity q its parity row p r + q. Rebuild rounds move a
chunk of periods by these strided slices instead of by stripe numbers. All functions are local
and touch only the tensors they are given."""
from __future__ import annotations

from dataclasses import dataclass

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


def slot_run(layout, pos: int, o: int, p0: int, n: int, base: int, pbase: int
             ) -> tuple[bool, int, int, int]:
    """Position `pos`'s units at offset `o` of periods [p0, p0 + n): (whether they are its
    parity rows, the first one counted from parity row `pbase` or from shard row `base`, how
    many there are (a data slot's real rows only), the step from one to the next)."""
    L = layout
    q = (pos - o) % L.g
    if q < L.r:
        return True, p0 * L.r + q - pbase, n, L.r
    first, real = slot_rows(L, pos, L.slot_table[pos][o], p0, n)
    return False, first - base, real, L.k


def slot_view(layout, pos: int, words, parity: torch.Tensor, pbase: int, o: int, p0: int,
              n: int, segment: tuple[int, int, int]) -> tuple[torch.Tensor, int]:
    """Words [c, c + w) (`segment`) of position `pos`'s units at offset `o` of periods
    [p0, p0 + n): a (rows, w) int32 view of its row tensor i (a data slot; its real rows only)
    or of its parity rows, and how many rows it has."""
    c, w, i = segment
    held, first, real, step = slot_run(layout, pos, o, p0, n, words.base, pbase)
    t = parity[:, c:c + w] if held else words.tensors[i]
    rows = t[first:first + max(real - 1, 0) * step + 1:step] if real else t[:0]
    return (rows if held else rows.reshape(real, w).view(torch.int32)), real


@dataclass(frozen=True)
class RowsAt:
    """Where a member's rows and parity rows of some periods lie in this process's memory: per
    row tensor (address of row `base`, row stride in bytes, end of its memory), and the address
    of parity row `pbase`, the parity row's bytes and the end of the parity memory."""

    tensors: tuple[tuple[int, int, int], ...]
    base: int
    parity: int
    pbase: int
    prow_bytes: int
    parity_end: int


def rows_at(words, parity: torch.Tensor, pbase: int = 0) -> RowsAt | None:
    """`RowsAt` of a RowWords (a shard's, or a span read from a peer) and its parity rows
    ((rows, W) int32; row 0 is parity row `pbase`); None where they are not row-contiguous
    host memory. Each row tensor ends where its own last row does."""
    memory = words.memory()
    if memory is None or parity.device.type != "cpu" or not parity.is_contiguous() or \
            parity.dim() != 2 or parity.dtype != torch.int32:
        return None
    tensors = tuple((a, s, a + (len(t) - 1) * s + b if len(t) else a)
                    for (a, s, b), t in zip(memory, words.tensors))
    return RowsAt(tensors, words.base, parity.data_ptr(), pbase, parity.shape[1] * 4,
                  parity.data_ptr() + parity.numel() * 4)


def slot_extent(layout, pos: int, at: RowsAt, o: int, p0: int, n: int,
                segment: tuple[int, int, int]) -> tuple[int, int, int]:
    """`slot_view` by address: (address, stride in bytes, rows) of the same rows, words
    [c, c + w) of each. ValueError where they would lie outside the memory `at` describes (what
    makes them safe to hand to `xor_rows.xor_many`)."""
    c, w, i = segment
    held, first, rows, step = slot_run(layout, pos, o, p0, n, at.base, at.pbase)
    start, row, end = (at.parity + 4 * c, at.prow_bytes, at.parity_end) if held else \
        at.tensors[i]
    address, stride = start + first * row, step * row
    if rows and (first < 0 or address + (rows - 1) * stride + 4 * w > end):
        raise ValueError(f"slot_extent: {rows} rows of {4 * w} bytes from row {first} of the "
                         f"memory at {start:#x}, {stride} bytes apart, lie outside it (it ends "
                         f"at {end:#x})")
    return address, stride, rows
