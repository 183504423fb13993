"""The last row-0 bundle an extractor wrote, kept in memory for the next ingestion to read.

Each ingestion compares the new chunk with every row-0 chunk, and where a table's rows are updated
often (small tables, long intervals), it extracts nearly all of them: most row-0 chunks then live
in the row-0 bundle that the previous ingestion wrote, and the next ingestion reads that whole
bundle back (from the disk when it went out with O_DIRECT), verifies its checksums and copies its
rows into the next bundle. The rows are still in memory: they were gathered into the extractor's
`RowArena` to be written. A `HeldBundle` keeps that arena, unreset, until the next ingestion is
over, and serves the bundle's chunks from it: keys and stored arrays as the file holds them (the
bundle file is never rewritten: a name is one ingestion's, and a failed ingestion holds nothing).

The extractor builds each row-0 bundle in one of two arenas, the one not held, so rows are never
appended to memory a held bundle's views show. Only a bundle whose arena fits the hold limit
(`--incrcp-hold`, `HOLD_BYTES` by default) is held, and each row-0 arena keeps its buffers up to
that limit (at least `row_arena.KEEP_BYTES`) between ingestions, so that the next bundle is
gathered into memory faulted in already: the memory kept between ingestions is at most the limit
plus max(limit, `KEEP_BYTES`) plus the row-1 arena's `KEEP_BYTES`. The row-0 bundle grows with
the tables: at the Kaggle tables / 5 the bundles of an ingestion are ~58 MB per rank, and the
row-0 one outgrew the 64 MB limit there once its buffers had doubled past it. Every ingestion
then read it back from the file and faulted its buffers in again, a third of the extractor's CPU
(`bench/extractor_hold.py`). Local: nothing here uses MPI.
"""
from __future__ import annotations

import numpy as np

from mpickpt.store.row_arena import RowArena
from mpickpt.store.row_arrays import EncodedRows

HOLD_BYTES = 512 << 20
"""The default `--incrcp-hold`: a row-0 bundle's buffers up to this size are held."""


def check_hold(nbytes) -> None:
    """ValueError unless `nbytes` is a valid `--incrcp-hold` (an int >= 0). Local."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"--incrcp-hold must be a size in bytes >= 0, got {nbytes!r}")


class HeldBundle:
    """A written bundle's rows, read-only, in the arena they were gathered into. Local."""

    def __init__(self, relpath: str, arena: RowArena, kinds: dict, parts: dict, length: int):
        """`kinds` and `parts`: the `BundleBuilder`'s, as it wrote the bundle `relpath`."""
        self.relpath, self.arena, self.length = relpath, arena, length
        self.kinds, self.parts = dict(kinds), dict(parts)
        self.views: dict = {}
        """(name, part) -> the bundle's dataset of that array, a read-only view of the arena."""
        for name, names in self.parts.items():
            for part in names:
                view = arena.buffers[name, part].rows()
                if len(view) != length:
                    raise ValueError(f"{relpath}: {name} holds {len(view)} rows, the bundle "
                                     f"{length}")
                view.flags.writeable = False
                self.views[name, part] = view

    def has(self, names: list[str]) -> bool:
        """Whether every row array of `names` (and the keys) is in the bundle. Local."""
        return "gids" in self.parts and all(n in self.parts for n in names)

    def keys(self, start: int, stop: int) -> np.ndarray:
        """The keys of rows [start, stop) (a read-only view). Local."""
        return self.views["gids", ""][start:stop]

    def raw(self, name: str, start: int, stop: int) -> EncodedRows:
        """The stored arrays of `name`'s rows [start, stop), as `StoredRows.raw` reads them
        from the file (read-only views). Local."""
        arrays = {part: self.views[name, part][start:stop] for part in self.parts[name]}
        return EncodedRows(*self.kinds[name], arrays)
