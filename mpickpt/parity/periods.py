"""A member's units of whole periods of stripes, moved by slices (no index, no temporary).

Periods [p0, p0 + n) of a group hold every member's units as consecutive rows: data slot j of a
period is local row period * k + j (every k-th row from p0 * k + j), parity q is parity row
period * r + q. A block of units is (n, g, W) int32 in stripe order within each period; the slots
a member does not hold in it are its other members' (zeros where this member copies out). The
copies run near memory speed: a C loop of one memcpy per run measured no faster."""
from __future__ import annotations

import torch


def read_periods(store, p0: int, units: torch.Tensor) -> None:
    """Copy this member's data rows and parity rows of periods [p0, p0 + len(units)) into
    `units` ((n, g, W), any strides); padding rows past the shard's end are zeros. Local."""
    L, n = store.layout, len(units)
    for j, o in enumerate(L.data_offsets(store.pos)):
        real = _real_rows(store, p0, n, j)
        store.words.read_every(p0 * L.k + j, L.k, units[:real, o])
        units[real:, o] = 0
    for q, held in _parity_slices(store, p0, n):
        units[:, (store.pos - q) % L.g] = held


@torch.no_grad()
def write_periods(store, p0: int, units: torch.Tensor, xor_parity: bool = False) -> None:
    """Write this member's units of periods [p0, p0 + len(units)) from `units` ((n, g, W)) into
    its rows (padding dropped) and its parity store: copied, or XORed into the parity rows
    (`xor_parity`: they hold the folds since the units were taken, from zero). Local."""
    L, n = store.layout, len(units)
    for j, o in enumerate(L.data_offsets(store.pos)):
        store.words.write_every(p0 * L.k + j, L.k, units[:_real_rows(store, p0, n, j), o])
    for q, held in _parity_slices(store, p0, n):
        part = units[:, (store.pos - q) % L.g]
        held.bitwise_xor_(part) if xor_parity else held.copy_(part)


def zero_parity(store, p0: int, p1: int) -> None:
    """Zero this member's parity rows of periods [p0, p1). Local."""
    for _, held in _parity_slices(store, p0, p1 - p0):
        held.zero_()


def _real_rows(store, p0: int, n: int, j: int) -> int:
    """Rows of data slot j among n periods from p0 that exist (the rest is padding)."""
    L = store.layout
    first = p0 * L.k + j
    return min(n, max(0, -(-(L.rows[store.pos] - first) // L.k)))


def _parity_slices(store, p0: int, n: int):
    """(q, view of parity rows q of periods [p0, p0 + n)) for each parity unit q."""
    r = store.layout.r
    return [(q, store.parity[p0 * r + q:(p0 + n) * r:r]) for q in range(r)]
