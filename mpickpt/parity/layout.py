"""Parity groups with rotating (RAID-5 style) parity placement.

Ranks form groups of g = k + r consecutive ranks (the world size must be a multiple of g). Within a
group, stripes are numbered 0, 1, 2, ...; stripe s lies in period s // g at offset o = s % g. Its
r parity units are held by group positions (o + q) % g, q = 0..r-1, and its k data units are one row
each of the other k positions (data index j at position (o + r + j) % g). A position is data at k
offsets of every period and parity at r, so over one period each rank contributes k rows and holds
r parity rows: parity memory is r / k of the shard. Local row i of position p is its data unit at
stripe (i // k) * g + DATA_OFFSETS[p][i % k]; parity row (period * r + q) of holder p belongs to
stripe period * g + (p - q) % g. Members with fewer rows than the largest are padded with rows of
zeros that exist nowhere. All methods are local and pure (numpy in, numpy out).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


def check_parity_shape(k: int, r: int, world: int) -> None:
    """Clear errors for --parity-k / --parity-r against the world size. Local."""
    if k < 1 or r < 1:
        raise ValueError(f"--parity-k and --parity-r must be >= 1, got k={k}, r={r}")
    if k + r > 256:
        raise ValueError(f"--parity-k + --parity-r must be <= 256 (GF(2^8)), got {k + r}")
    if world % (k + r):
        raise ValueError(f"parity groups of k + r = {k + r} ranks need a world size that is a "
                         f"multiple of {k + r}, got {world} ranks (choose --parity-k "
                         f"{world - r} for one group)")


@dataclass(frozen=True)
class GroupLayout:
    """The stripes of one parity group. `rows[p]`: local rows of the rank at position p."""

    k: int
    r: int
    base: int  # first world rank of the group
    rows: tuple[int, ...]

    def __post_init__(self):
        if len(self.rows) != self.k + self.r:
            raise ValueError(f"a group of k={self.k}, r={self.r} has {self.k + self.r} members, "
                             f"got row counts for {len(self.rows)}")

    @property
    def g(self) -> int:
        return self.k + self.r

    @property
    def periods(self) -> int:
        return -(-max(self.rows) // self.k) if max(self.rows) else 0

    @property
    def stripes(self) -> int:
        return self.periods * self.g

    @property
    def parity_rows(self) -> int:
        """Parity rows held by every member."""
        return self.periods * self.r

    def parity_positions(self, offset) -> np.ndarray:
        """(..., r) positions holding the parity units of stripes at `offset`."""
        return (np.asarray(offset)[..., None] + np.arange(self.r)) % self.g

    def data_offsets(self, p: int) -> np.ndarray:
        """The k offsets (ascending) where position p is a data member."""
        return self.offset_table[p]

    @cached_property
    def offset_table(self) -> np.ndarray:
        """(g, k): row p is `data_offsets(p)`."""
        return np.array([[o for o in range(self.g) if (p - o) % self.g >= self.r]
                         for p in range(self.g)], dtype=np.int64).reshape(self.g, self.k)

    @cached_property
    def slot_table(self) -> tuple[tuple[int, ...], ...]:
        """[p][o]: the slot of offset o among `data_offsets(p)` (position p's row
        period * k + slot holds the unit at offset o of each period), -1 where p holds parity
        there."""
        return tuple(tuple(int(np.searchsorted(row, o)) if o in row else -1 for o in range(self.g))
                     for row in self.offset_table.tolist())

    def data_positions(self, offset: int) -> np.ndarray:
        """The k data positions of stripes at `offset`, by data index j: position
        (offset + r + j) % g."""
        return (offset + self.r + np.arange(self.k, dtype=np.int64)) % self.g

    def role(self, p: int, stripe) -> np.ndarray:
        """-1 where position p is a data member of `stripe`, else its parity index q."""
        q = (p - np.asarray(stripe) % self.g) % self.g
        return np.where(q < self.r, q, -1)

    # --- data units ---
    def stripe_of_row(self, p, rows) -> np.ndarray:
        """Stripes of local `rows` of position p (an int, or one position per row)."""
        rows = np.asarray(rows, dtype=np.int64)
        return (rows // self.k) * self.g + self.offset_table[p, rows % self.k]

    def data_index(self, p, rows) -> np.ndarray:
        """Data index j (0..k-1) of position p's rows within their stripes (p: an int, or one
        position per row)."""
        rows = np.asarray(rows, dtype=np.int64)
        return (p - self.offset_table[p, rows % self.k]) % self.g - self.r

    def row_of_stripe(self, p: int, stripe) -> np.ndarray:
        """Local row of position p at data `stripe` (-1 where p is parity there or the row is
        padding)."""
        stripe = np.asarray(stripe, dtype=np.int64)
        slot = np.full(self.g, -1, dtype=np.int64)
        slot[self.data_offsets(p)] = np.arange(self.k)
        u = slot[stripe % self.g]
        row = (stripe // self.g) * self.k + u
        return np.where((u >= 0) & (row < self.rows[p]), row, -1)

    # --- parity units ---
    def parity_row(self, p: int, stripe) -> np.ndarray:
        """Row in position p's parity store for `stripe` (-1 where p is not a holder)."""
        stripe = np.asarray(stripe, dtype=np.int64)
        q = self.role(p, stripe)
        return np.where(q >= 0, (stripe // self.g) * self.r + q, -1)

    def stripe_of_parity(self, p: int, prow) -> np.ndarray:
        prow = np.asarray(prow, dtype=np.int64)
        return (prow // self.r) * self.g + (p - prow % self.r) % self.g


def group_layouts(k: int, r: int, rows_per_rank) -> list[GroupLayout]:
    """The groups of a world whose rank i has rows_per_rank[i] local rows. Local."""
    rows = list(rows_per_rank)
    check_parity_shape(k, r, len(rows))
    g = k + r
    return [GroupLayout(k, r, b, tuple(rows[b:b + g])) for b in range(0, len(rows), g)]
