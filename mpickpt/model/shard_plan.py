"""Shard plan: which rank owns which rows of which embedding table.

A plan is a pure function of (table sizes, world size, options): every rank computes the same plan
without communicating, and a checkpoint can record the options and rebuild it. Tables are placed whole
(table-wise sharding, largest first onto the least-loaded rank); a table larger than the row-wise
threshold is split into `world_size` contiguous row blocks, one per rank (row-wise sharding).

Rows are named three ways:
- (table, row): the user's view;
- global id: ``table_offset[table] + row``, one int64 per row of the whole model; checkpoints,
  exports and digests are keyed by it, which makes them independent of the world size;
- (rank, local row): where the row lives; a rank's local rows are its shards concatenated in
  (table, first row) order (`ShardPlan.from_shards` takes another framework's placement and
  local order as they are).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardPlanOptions:
    """Options of the placement; part of the plan's identity."""

    row_wise_threshold: int | None = None
    """Tables with more rows than this are split row-wise over all ranks. None: the fair share,
    ceil(total rows / world size)."""
    max_rows_per_rank: int | None = None
    """Capacity of one rank in rows; None means unlimited."""

    def __post_init__(self):
        for name in ("row_wise_threshold", "max_rows_per_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")


@dataclass(frozen=True, slots=True)
class Shard:
    """Rows [row_start, row_end) of `table`, held by `rank` starting at its local row `local_start`."""

    table: int
    row_start: int
    row_end: int
    rank: int
    local_start: int

    @property
    def rows(self) -> int:
        return self.row_end - self.row_start


@dataclass(frozen=True)
class ShardPlan:
    """The placement of every embedding row. Build with `ShardPlan.build` (local, deterministic)."""

    table_sizes: tuple[int, ...]
    world_size: int
    options: ShardPlanOptions
    shards: tuple[Shard, ...]
    table_offsets: np.ndarray = field(repr=False)
    _starts: np.ndarray = field(repr=False)  # global id of each shard's first row, sorted
    _owner: np.ndarray = field(repr=False)
    _local_base: np.ndarray = field(repr=False)

    @classmethod
    def build(cls, table_sizes, world_size: int, options: ShardPlanOptions | None = None):
        """Compute the plan. Local and pure: equal inputs give equal plans on every rank."""
        sizes = _check_inputs(table_sizes, world_size)
        options = options or ShardPlanOptions()
        pieces = _place(sizes, world_size, options)
        shards = _assign_local_offsets(pieces, world_size)
        _check_capacity(shards, world_size, options)
        return cls.from_shards(sizes, world_size, shards, options)

    @classmethod
    def from_shards(cls, table_sizes, world_size: int, shards,
                    options: ShardPlanOptions | None = None):
        """A plan made elsewhere (another framework's sharding): `shards` must cover every row
        of every table exactly once, and each rank's shards must tile its local rows from 0 in
        `local_start` order (any order of tables: e.g. the order of a fused embedding module's
        flat weights). ValueError naming the first problem. Local and pure."""
        sizes = _check_inputs(table_sizes, world_size)
        shards = tuple(sorted(shards, key=lambda s: (s.table, s.row_start)))
        _check_cover(sizes, world_size, shards)
        offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        starts = np.array([offsets[s.table] + s.row_start for s in shards], dtype=np.int64)
        owner = np.array([s.rank for s in shards], dtype=np.int64)
        base = np.array([s.local_start for s in shards], dtype=np.int64)
        return cls(sizes, world_size, options or ShardPlanOptions(), shards, offsets, starts,
                   owner, base)

    @property
    def num_tables(self) -> int:
        return len(self.table_sizes)

    @property
    def total_rows(self) -> int:
        return int(self.table_offsets[-1])

    def shards_of(self, rank: int) -> list[Shard]:
        """Shards held by `rank`, in local-row order. Local."""
        return sorted((s for s in self.shards if s.rank == rank), key=lambda s: s.local_start)

    def local_rows(self, rank: int) -> int:
        """Number of embedding rows held by `rank`. Local."""
        return sum(s.rows for s in self.shards_of(rank))

    def global_ids(self, table, row):
        """Global ids of (table, row) pairs (broadcastable numpy or torch integers). Local."""
        offsets = _like(self.table_offsets, table)
        return offsets[table] + row

    def split_global(self, gid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inverse of `global_ids`: (table, row) of each global id. Local."""
        gid = np.asarray(gid, dtype=np.int64)
        table = np.searchsorted(self.table_offsets, gid, side="right") - 1
        return table, gid - self.table_offsets[table]

    def owner_of(self, gid):
        """(owning rank, local row) of each global id; numpy or torch in, same kind out. Local."""
        starts = _like(self._starts, gid)
        s = _searchsorted(starts, gid)
        return _like(self._owner, gid)[s], _like(self._local_base, gid)[s] + gid - starts[s]

    def local_to_global(self, rank: int, local_rows) -> np.ndarray:
        """Global ids of `rank`'s local rows (numpy int64). Local."""
        mine = self.shards_of(rank)
        local_rows = np.asarray(local_rows, dtype=np.int64)
        if not mine:
            if local_rows.size:
                raise ValueError(f"rank {rank} holds no rows, got local rows {local_rows[:5]}")
            return local_rows
        lstart = np.array([s.local_start for s in mine], dtype=np.int64)
        gstart = np.array([self.table_offsets[s.table] + s.row_start for s in mine], dtype=np.int64)
        s = np.searchsorted(lstart, local_rows, side="right") - 1
        return gstart[s] + local_rows - lstart[s]

    def rank_global_ids(self, rank: int) -> np.ndarray:
        """Global ids of all of `rank`'s local rows, in local order. Local."""
        return self.local_to_global(rank, np.arange(self.local_rows(rank)))

    def describe(self) -> dict:
        """JSON-friendly description (stored in checkpoints). Local."""
        return {"table_sizes": list(self.table_sizes), "world_size": self.world_size,
                "row_wise_threshold": self.options.row_wise_threshold,
                "max_rows_per_rank": self.options.max_rows_per_rank,
                "shards": [[s.table, s.row_start, s.row_end, s.rank] for s in self.shards]}


def _check_inputs(table_sizes, world_size) -> tuple[int, ...]:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    sizes = tuple(int(n) for n in table_sizes)
    if not sizes:
        raise ValueError("at least one embedding table is needed, got none")
    bad = [(t, n) for t, n in enumerate(sizes) if n < 1]
    if bad:
        raise ValueError(f"embedding table sizes must be >= 1 row, got {bad} as (table, rows)")
    return sizes


def _place(sizes, world, options) -> list[tuple[int, int, int, int]]:
    """(table, row_start, row_end, rank) pieces: row-wise splits first, then LPT table-wise."""
    threshold = options.row_wise_threshold or math.ceil(sum(sizes) / world)
    load = [0] * world
    pieces = []
    for t, n in enumerate(sizes):
        if n > threshold and world > 1:
            if n < world:
                raise ValueError(
                    f"table {t} has {n} rows, more than the row-wise threshold {threshold} but fewer "
                    f"than the world size {world}: it cannot be split into one block per rank")
            bounds = [n * r // world for r in range(world + 1)]
            for r in range(world):
                pieces.append((t, bounds[r], bounds[r + 1], r))
                load[r] += bounds[r + 1] - bounds[r]
    whole = sorted((t for t, n in enumerate(sizes) if not (n > threshold and world > 1)),
                   key=lambda t: (-sizes[t], t))
    for t in whole:
        r = min(range(world), key=lambda q: (load[q], q))
        pieces.append((t, 0, sizes[t], r))
        load[r] += sizes[t]
    return pieces


def _assign_local_offsets(pieces, world) -> list[Shard]:
    shards = []
    for r in range(world):
        local = 0
        for t, a, b, _ in sorted(p for p in pieces if p[3] == r):
            shards.append(Shard(t, a, b, r, local))
            local += b - a
    return sorted(shards, key=lambda s: (s.table, s.row_start))


def _check_cover(sizes, world, shards) -> None:
    """Every row of every table in exactly one shard; each rank's local rows tiled from 0."""
    for s in shards:
        if not (0 <= s.table < len(sizes) and 0 <= s.row_start < s.row_end <= sizes[s.table]
                and 0 <= s.rank < world and s.local_start >= 0):
            raise ValueError(f"shard {s} does not fit tables of {list(sizes)} rows over "
                             f"{world} ranks")
    for t, n in enumerate(sizes):
        mine = [s for s in shards if s.table == t]  # sorted by row_start
        edges = [0] + [x for s in mine for x in (s.row_start, s.row_end)] + [n]
        if any(edges[i] != edges[i + 1] for i in range(0, len(edges), 2)):
            spans = [(s.row_start, s.row_end) for s in mine]
            raise ValueError(f"table {t} ({n} rows): its shards {spans} do not cover rows "
                             f"[0, {n}) exactly once")
    for r in range(world):
        local = 0
        for s in sorted((s for s in shards if s.rank == r), key=lambda s: s.local_start):
            if s.local_start != local:
                raise ValueError(f"rank {r}: shard {s} starts at local row {s.local_start}, "
                                 f"expected {local} (local rows must be tiled from 0)")
            local += s.rows


def _check_capacity(shards, world, options) -> None:
    cap = options.max_rows_per_rank
    if cap is None:
        return
    for r in range(world):
        held = sum(s.rows for s in shards if s.rank == r)
        if held > cap:
            raise ValueError(
                f"rank {r} of {world} would hold {held} embedding rows, more than "
                f"max_rows_per_rank={cap}: use more ranks, smaller tables or a larger capacity")


def _like(array: np.ndarray, ref):
    """`array` as a torch tensor on `ref`'s device when `ref` is a tensor, else numpy. Local."""
    if isinstance(ref, torch.Tensor):
        return torch.as_tensor(array, device=ref.device)
    return array


def _searchsorted(starts, values):
    if isinstance(values, torch.Tensor):
        return torch.searchsorted(starts, values, right=True) - 1
    return np.searchsorted(starts, values, side="right") - 1
