"""Priority trackers for prioritized partial saves (CPR §4.2, SCAR §4.2): which rows of a shard a
save writes when it may write only a fraction r of each table.

Each tracker lives beside the shard (on its device), is fed at the owner's lookup with the rows a
training step updates and how often each was looked up, and answers `select(ranges, r)`: for each
table shard [lo, hi) of local rows, at most ceil(r x (hi - lo)) rows, the highest priority first.

- `MostFrequentlyUsed` (CPR-MFU): a 4-byte counter per row, the lookups since the row was last
  saved; a save takes the largest counts (ties: the lower row) and clears their counters.
- `SubsampledUsed` (CPR-SSU): each lookup is sampled with probability 1 / `period`; a list of at
  most ceil(r x n) sampled rows per table shard, duplicates ignored (a membership bit per row),
  random eviction when it overflows (so frequently used rows are likelier to stay); a save takes
  the list and empties it.
- `LargestChange` (SCAR): the value of every row when it was last saved (100 % of the weights);
  a save takes the rows whose weights moved furthest (L2) since, among rows updated since (and
  moved), and records their new values.

Local: nothing here uses MPI; every operation is vectorized torch on the shard's device.
"""
from __future__ import annotations

import math

import numpy as np
import torch

SSU_PERIOD = 2
"""CPR §6.1 samples every second data point (a sampling period of 2)."""


def shard_ranges(plan, rank: int) -> list[tuple[int, int]]:
    """The local row ranges [lo, hi) of `rank`'s table shards. Local."""
    return [(s.local_start, s.local_start + s.rows) for s in plan.shards_of(rank)]


def budget(rows: int, fraction: float) -> int:
    """Rows a save may write of a table shard of `rows` rows. Local."""
    return min(rows, max(1, math.ceil(fraction * rows))) if rows else 0


class PriorityTracker:
    """Common interface; `ranges` are the table shards (local row ranges) of this rank."""

    def __init__(self, num_rows: int, ranges: list[tuple[int, int]], device):
        self.num_rows, self.ranges, self.device = num_rows, list(ranges), torch.device(device)

    def observe(self, rows: torch.Tensor, counts: torch.Tensor) -> None:
        """A training step looked up `rows` (sorted unique local rows), `counts` times each."""
        raise NotImplementedError

    def select(self, fraction: float) -> np.ndarray:
        """Sorted local rows the next save writes. Local."""
        raise NotImplementedError

    def saved(self, rows: np.ndarray) -> None:
        """`rows` were written: their priority starts over. Local."""
        raise NotImplementedError

    def reset(self) -> None:
        """A full baseline wrote every row. Local."""
        self.saved(np.arange(self.num_rows))

    @property
    def nbytes(self) -> int:
        """Memory the tracker holds (CPR Table 1). Local."""
        raise NotImplementedError


def _top(keys: torch.Tensor, positive: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest `keys` among `positive` (ties: lower position). Local."""
    idx = torch.nonzero(positive).flatten()
    if len(idx) <= k:
        return idx
    order = torch.argsort(keys[idx], descending=True, stable=True)
    return idx[order[:k]]


class MostFrequentlyUsed(PriorityTracker):
    """CPR-MFU: lookups per row since its last save."""

    def __init__(self, num_rows, ranges, device):
        super().__init__(num_rows, ranges, device)
        self.counts = torch.zeros(num_rows, dtype=torch.int32, device=self.device)

    def observe(self, rows, counts):
        self.counts.index_add_(0, rows, counts.to(torch.int32))

    def select(self, fraction):
        picked = []
        for lo, hi in self.ranges:
            c = self.counts[lo:hi]
            picked.append(_top(c, c > 0, budget(hi - lo, fraction)) + lo)
        return _sorted(picked)

    def saved(self, rows):
        self.counts[torch.as_tensor(rows, device=self.device)] = 0

    def reset(self):
        self.counts.zero_()

    @property
    def nbytes(self):
        return self.counts.numel() * self.counts.element_size()


class RowBits:
    """A set of local rows as one bit per row (32 rows per int64 word, so adding and removing are
    one accumulating scatter on any device). Local."""

    def __init__(self, num_rows: int, device):
        self.words = torch.zeros((num_rows + 31) // 32, dtype=torch.int64, device=device)

    def contains(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(torch.int64)
        return ((self.words[rows >> 5] >> (rows & 31)) & 1).bool()

    def add(self, rows: torch.Tensor) -> None:
        """`rows`: distinct rows not in the set."""
        rows = rows.to(torch.int64)
        self.words.index_put_((rows >> 5,), torch.ones_like(rows) << (rows & 31), accumulate=True)

    def remove(self, rows: torch.Tensor) -> None:
        """`rows`: distinct rows in the set."""
        rows = rows.to(torch.int64)
        self.words.index_put_((rows >> 5,), -(torch.ones_like(rows) << (rows & 31)),
                              accumulate=True)

    def clear(self) -> None:
        self.words.zero_()

    @property
    def nbytes(self) -> int:
        return self.words.numel() * 8


class SubsampledUsed(PriorityTracker):
    """CPR-SSU: a bounded list per table shard of rows seen in subsampled lookups (int32 row
    ids, r x 4 bytes per row, plus a membership bit per row: 0.25 byte). The lists of all table
    shards live in one tensor (row ids are unique across tables), so a step costs one bit lookup
    per sampled row and, when a list overflows, one grouped random eviction (a random
    permutation, then a stable sort by table): no loop over tables."""

    def __init__(self, num_rows, ranges, device, fraction: float, seed: int = 0,
                 period: int = SSU_PERIOD):
        super().__init__(num_rows, ranges, device)
        self.period = period
        self.capacity = [budget(hi - lo, fraction) for lo, hi in self.ranges]
        self._cap = torch.as_tensor(self.capacity, dtype=torch.int64, device=self.device)
        self.ids = torch.empty(0, dtype=torch.int32, device=self.device)
        self.members = RowBits(num_rows, self.device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self._starts = torch.as_tensor([lo for lo, _ in self.ranges], device=self.device)

    def observe(self, rows, counts):
        keep = 1.0 - (1.0 - 1.0 / self.period) ** counts.to(torch.float64)
        drawn = torch.rand(len(rows), generator=self.gen, device=self.device, dtype=torch.float64)
        sampled = rows[drawn < keep].to(torch.int32)
        new = sampled[~self.members.contains(sampled)]
        if len(new) == 0:
            return
        self.members.add(new)
        merged = torch.cat([self.ids, new])
        table = torch.searchsorted(self._starts, merged, right=True) - 1
        sizes = torch.bincount(table, minlength=len(self.capacity))
        if bool((sizes <= self._cap).all()):
            self.ids = merged
            return
        # random eviction: shuffle, group by table (stable), keep each table's first `capacity`
        perm = torch.randperm(len(merged), generator=self.gen, device=self.device)
        order = perm[torch.sort(table[perm], stable=True).indices]
        grouped, table = merged[order], table[order]
        rank = torch.arange(len(merged), device=self.device) - (torch.cumsum(sizes, 0)
                                                               - sizes)[table]
        kept = rank < self._cap[table]
        self.members.remove(grouped[~kept])
        self.ids = grouped[kept]

    def select(self, fraction):
        return _sorted([self.ids])

    def saved(self, rows):
        rows = torch.unique(torch.as_tensor(rows, dtype=torch.int64, device=self.device))
        self.members.remove(rows[self.members.contains(rows)])
        self.ids = self.ids[self.members.contains(self.ids)]

    def reset(self):
        self.ids = self.ids[:0]
        self.members.clear()

    @property
    def nbytes(self):
        return sum(self.capacity) * 4 + self.members.nbytes


class LargestChange(PriorityTracker):
    """SCAR: the L2 change of each row since its last save, over rows updated since."""

    def __init__(self, num_rows, ranges, device, weight: torch.Tensor):
        super().__init__(num_rows, ranges, device)
        self.weight = weight
        self.last_saved = weight.detach().clone()
        self.dirty = torch.zeros(num_rows, dtype=torch.bool, device=self.device)

    def observe(self, rows, counts):
        self.dirty[rows] = True

    def select(self, fraction):
        picked = []
        for lo, hi in self.ranges:
            change = torch.linalg.vector_norm(self.weight[lo:hi] - self.last_saved[lo:hi], dim=1)
            moved = self.dirty[lo:hi] & (change > 0)
            picked.append(_top(change, moved, budget(hi - lo, fraction)) + lo)
        return _sorted(picked)

    def saved(self, rows):
        rows = torch.as_tensor(rows, device=self.device)
        self.last_saved[rows] = self.weight[rows].detach()
        self.dirty[rows] = False

    def reset(self):
        self.last_saved.copy_(self.weight.detach())
        self.dirty.zero_()

    @property
    def nbytes(self):
        return self.last_saved.numel() * self.last_saved.element_size() + self.dirty.numel()


def _sorted(pieces: list[torch.Tensor]) -> np.ndarray:
    rows = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)
    return np.sort(rows.cpu().numpy().astype(np.int64))


def make_tracker(rule: str, num_rows: int, ranges, device, fraction: float, weight=None,
                 seed: int = 0) -> PriorityTracker:
    """The tracker of `rule` ('mfu', 'ssu' or 'scar'). Local."""
    if rule == "mfu":
        return MostFrequentlyUsed(num_rows, ranges, device)
    if rule == "ssu":
        return SubsampledUsed(num_rows, ranges, device, fraction, seed)
    if rule == "scar":
        return LargestChange(num_rows, ranges, device, weight)
    raise ValueError(f"--ckpt-priority must be mfu, ssu or scar, got {rule!r}")
