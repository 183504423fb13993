"""The committed chunk index of one rank's 2-D chunk list (one list per embedding table).

Column c of a table's list belongs to the incremental checkpoint at step c; its row 0 starts as the
rows that checkpoint wrote. When a newer checkpoint n is ingested, the keys it repeats are extracted
from older row-0 chunks into a new row-1 chunk of their column and every deeper row moves down one
(an empty placeholder where nothing was extracted keeps the rows aligned). A chunk extracted by n
records ``until = n``: its values were current for checkpoints c .. n-1. Checkpoint i is therefore
the "rectangle" of chunks with column <= i and (until is None or until > i), applied in column
order; no deduplication pass is needed (with selective extraction, a key skipped by the filters is
simply overwritten by its newer column).

The index is JSON, published atomically as ``index-<generation>.json`` (temp, fsync, rename,
directory fsync), like a manifest: a crash in the middle of an extraction leaves the previous
generation, and every file it references, in place. Like a manifest it carries a checksum of its
content (`store.sealed_json`); a damaged newest generation is an error naming the file, never a
silent fall back to an older one (whose files the newer one may have collected). Local: nothing
here uses MPI.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from mpickpt.store.errors import CheckpointCorruptError
from mpickpt.store.file_spec import BUNDLE_RE, chain_relpath
from mpickpt.store.sealed_json import dumps_sealed, read_sealed
from mpickpt.store.durable import fsync_path

INDEX_RE = re.compile(r"^index-(\d{8})\.json$")
INDEX_VERSION = 2
FIRST_SEALED_VERSION = 2
"""Indexes from version 2 on carry a checksum of their content."""


@dataclass(frozen=True)
class ChunkRef:
    """Rows [start, stop) of table `table`'s datasets in `file` (relative to the checkpoint root)."""

    file: str
    table: int
    start: int
    stop: int
    gid_min: int
    gid_max: int
    column: int
    until: int | None = None
    group: str = ""
    """HDF5 group holding the rows: '' means ``tables/<table>`` (a column file); bundles keep all
    tables' chunks back to back in one group, ``rows``, so a restore reads them in one go."""

    @property
    def where(self) -> str:
        return self.group or f"tables/{self.table}"

    @property
    def rows(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict:
        """The reference as a JSON object (what `dataclasses.asdict` gives, at a fraction of its
        cost: an index of thousands of chunks is written at every ingestion). Local."""
        return dict(self.__dict__)

    def needed_by(self, step: int) -> bool:
        """Part of the rectangle of checkpoint `step`. Local."""
        return self.column <= step and (self.until is None or self.until > step)


@dataclass
class ChunkIndex:
    """One rank's chunk lists of one chain: ``cells[table][column]`` is a list of rows, each row a
    list of ChunkRefs (an empty list is a placeholder)."""

    chain: str
    rank: int
    generation: int = 0
    columns: list[int] = field(default_factory=list)
    cells: dict[int, dict[int, list[list[ChunkRef]]]] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    # ---- queries ---------------------------------------------------------------------------
    def refs(self):
        """Every chunk reference in the index. Local."""
        for table in self.cells.values():
            for rows in table.values():
                for row in rows:
                    yield from row

    def rectangle(self, step: int) -> list[ChunkRef]:
        """Chunks that make up checkpoint `step`, oldest column first. Local."""
        return sorted((r for r in self.refs() if r.needed_by(step)),
                      key=lambda r: (r.column, r.table, r.start))

    def refcounts(self) -> dict[str, int]:
        """Live chunks per file (a bundle file is deleted when its count reaches 0). Local."""
        counts: dict[str, int] = {}
        for r in self.refs():
            counts[r.file] = counts.get(r.file, 0) + 1
        return counts

    def depth(self, table: int) -> int:
        """Rows of the table's 2-D list. Local."""
        return max((len(rows) for rows in self.cells.get(table, {}).values()), default=0)

    def row0(self, table: int, column: int) -> list[ChunkRef]:
        rows = self.cells.get(table, {}).get(column)
        return rows[0] if rows else []

    # ---- updates -----------------------------------------------------------------------------
    def add_column(self, column: int, refs: list[ChunkRef]) -> None:
        """Append column `column` with `refs` in its row 0 (every table gets the column). Local."""
        self.columns.append(column)
        for table in {r.table for r in refs} | set(self.cells):
            self.cells.setdefault(table, {})[column] = [[r for r in refs if r.table == table]]

    def push_row1(self, table: int, column: int, row0: list[ChunkRef], row1: list[ChunkRef]) -> None:
        """After an extraction round: new row 0, new row 1 (maybe empty), older rows move down."""
        rows = self.cells[table][column]
        rows[:] = [row0, row1, *rows[1:]]

    def drop(self, keep) -> int:
        """Remove chunk references for which `keep(ref)` is False. Empty rows stay as
        placeholders below the last that holds a chunk; those after it go (a column's list
        grows by a row at every extraction round, and rows run empty as retention drops
        their chunks: kept, they made every pass over the index, and the index file, grow
        with the square of the chain's length). Local."""
        dropped = 0
        for table in self.cells.values():
            for rows in table.values():
                for k, row in enumerate(rows):
                    if row:
                        kept = [r for r in row if keep(r)]
                        dropped += len(row) - len(kept)
                        rows[k] = kept
                while len(rows) > 1 and not rows[-1]:
                    rows.pop()
        return dropped

    # ---- persistence -------------------------------------------------------------------------
    def to_json(self) -> dict:
        cells = {str(t): {str(c): [[r.to_json() for r in row] for row in rows]
                          for c, rows in cols.items()} for t, cols in self.cells.items()}
        return {"version": INDEX_VERSION, "chain": self.chain, "rank": self.rank,
                "generation": self.generation, "columns": self.columns, "cells": cells,
                "files": self.refcounts(), "stats": self.stats}

    @classmethod
    def from_json(cls, data: dict) -> "ChunkIndex":
        cells = {int(t): {int(c): [[ChunkRef(**r) for r in row] for row in rows]
                          for c, rows in cols.items()} for t, cols in data["cells"].items()}
        return cls(chain=data["chain"], rank=int(data["rank"]), generation=int(data["generation"]),
                   columns=[int(c) for c in data["columns"]], cells=cells,
                   stats=data.get("stats", {}))


def index_dir(root: str, chain: str, rank: int) -> str:
    """Directory of one rank's chunk files and index generations. Local."""
    return os.path.join(root, chain_relpath(chain, rank))


def commit_index(root: str, index: ChunkIndex, keep_generations: int = 2) -> str:
    """Publish the next generation atomically; remove generations older than the last few. Local."""
    folder = index_dir(root, index.chain, index.rank)
    os.makedirs(folder, exist_ok=True)
    index.generation += 1
    final = os.path.join(folder, f"index-{index.generation:08d}.json")
    tmp = final + f".tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(dumps_sealed(index.to_json()))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full disk: the file it could not write named
        _remove(tmp)
        raise OSError(e.errno, f"{tmp}: {e.strerror or e}") from e
    os.replace(tmp, final)
    fsync_path(folder)
    for gen in generations(folder)[:-keep_generations]:
        _remove(os.path.join(folder, f"index-{gen:08d}.json"))
    return final


def generations(folder: str) -> list[int]:
    """Committed index generations in `folder`, oldest first. Local."""
    if not os.path.isdir(folder):
        return []
    return sorted(int(m.group(1)) for m in map(INDEX_RE.match, os.listdir(folder)) if m)


def load_index(root: str, chain: str, rank: int) -> ChunkIndex:
    """The newest committed generation (an empty index when none exists yet);
    CheckpointCorruptError naming the file when it is damaged. Local."""
    folder = index_dir(root, chain, rank)
    gens = generations(folder)
    if not gens:
        return ChunkIndex(chain=chain, rank=rank)
    path = os.path.join(folder, f"index-{gens[-1]:08d}.json")
    try:
        return ChunkIndex.from_json(read_sealed(path, "version", FIRST_SEALED_VERSION))
    except OSError as e:
        raise CheckpointCorruptError(f"{path}: chunk index cannot be read: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        text = str(e) if str(e).startswith(path) else f"{path}: not a valid chunk index: {e!r}"
        raise CheckpointCorruptError(text) from None


def check_named_files(root: str, index: ChunkIndex, refs) -> None:
    """CheckpointCorruptError when a file that `refs` (chunks of `index`) name is missing,
    naming the index generation that names it; where the folder holds a bundle of a step later
    than every column the generation ingested, a newer generation, which collected the files
    this one names, was committed and is gone. Local."""
    missing = sorted({r.file for r in refs if not os.path.isfile(os.path.join(root, r.file))})
    if not missing:
        return
    folder = index_dir(root, index.chain, index.rank)
    newest = max(index.columns, default=-1)
    later = sorted(name for name in os.listdir(folder)
                   if (m := BUNDLE_RE.match(name)) and int(m.group(1)) > newest)
    why = (f"; the folder holds {later[-1]}, which only an ingestion after step {newest} writes: "
           f"a newer generation of this index, which collected these files, is missing"
           if later else "")
    shown = ", ".join(os.path.join(root, rel) for rel in missing[:3])
    more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
    raise CheckpointCorruptError(
        f"{os.path.join(folder, f'index-{index.generation:08d}.json')}: chunk index generation "
        f"{index.generation} names missing files: {shown}{more}{why}")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
