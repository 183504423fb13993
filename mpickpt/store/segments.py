"""Layers: the ordered pieces of files that make up one checkpoint, for every checkpoint kind.

- ``full``: the checkpoint's own shard files.
- ``differential``: its baseline's shard files, then its own (rows changed since the baseline).
- ``consecutive``: its baseline, then every increment of the chain up to itself, oldest first
  (the naive incremental restore: everything is read, newer rows overwrite older ones).
- ``incrcp``: its baseline (its only parent), then the rectangle of the 2-D chunk lists of every writer rank
  (`mpickpt.incrcp.index`), plus the chunk files of chain columns the index has not ingested yet.

A Segment is rows [start, stop) of one table group (or every table group, `table=None`) of one file;
applying segments in order, later rows overwriting earlier ones, gives the checkpoint's rows. Local:
nothing here uses MPI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mpickpt.incrcp.index import column_relpath, load_index
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest
from mpickpt.store.row_arrays import open_rows
from mpickpt.store.shard_file import open_shard, read_rows

INCREMENTAL_KINDS = ("differential", "consecutive", "incrcp")


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of table `table` in `file` (relative path); None means whole groups.

    `order` ranks segments (the step that wrote the rows): where two segments hold a row, the
    higher order wins. A merged segment (adjacent chunks of one bundle read in one go) has `runs`,
    (rows, order) per chunk in file order; its gids are sorted within each run only."""

    file: str
    table: int | None = None
    start: int | None = None
    stop: int | None = None
    gid_min: int | None = None
    gid_max: int | None = None
    order: int = 0
    runs: tuple = ()
    group: str = ""
    """HDF5 group of the rows when not ``tables/<table>`` (bundles); `table` is -1 when a merged
    segment spans several tables."""

    def row_orders(self, n: int) -> np.ndarray:
        """The order of each of the segment's `n` rows (GAP for rows it does not hold). Local."""
        if not self.runs:
            return np.full(n, self.order, dtype=np.int64)
        return np.repeat([o for _, o in self.runs], [k for k, _ in self.runs]).astype(np.int64)


def parent_manifests(manifest: Manifest, by_step: dict[int, Manifest]) -> list[Manifest]:
    """The committed manifests `manifest` builds on, oldest first; CheckpointError if one is gone."""
    out = []
    for step in manifest.parents:
        if step not in by_step:
            raise CheckpointError(f"checkpoint step {manifest.step} ({manifest.kind}) needs step "
                                  f"{step}, which is not committed (retired or deleted)")
        out.append(by_step[step])
    return out


def checkpoint_segments(root: str, manifest: Manifest, by_step: dict[int, Manifest]) -> list[Segment]:
    """Every segment of `manifest`'s checkpoint in the order to apply them. Local."""
    if manifest.kind == "full":
        return whole_files(manifest)
    parents = parent_manifests(manifest, by_step)
    if manifest.kind in ("differential", "consecutive"):
        return [s for m in [*parents, manifest] for s in whole_files(m)]
    if manifest.kind == "incrcp":
        return whole_files(parents[0]) + chunk_segments(root, manifest)
    raise CheckpointError(f"checkpoint step {manifest.step}: unknown kind {manifest.kind!r}")


def whole_files(manifest: Manifest) -> list[Segment]:
    return [Segment(rel, order=manifest.step) for rel in manifest.shard_files()]


def chain_columns(manifest: Manifest) -> list[int]:
    """Steps of the incremental columns up to and including `manifest` (incrcp). Local."""
    return [int(c) for c in manifest.stats.get("columns", [manifest.step])]


def chunk_segments(root: str, manifest: Manifest) -> list[Segment]:
    """The 2-D lists' rectangle of an incrcp checkpoint over all writer ranks, column order. Local."""
    parts = int(manifest.stats.get("parts", 1))
    pieces = []
    for rank in range(manifest.world_size):
        index = load_index(root, manifest.chain, rank)
        pieces += merge_refs(index.rectangle(manifest.step))
        for column in chain_columns(manifest):
            if column not in index.columns:  # not ingested yet: its chunk file is intact
                pieces += [Segment(column_relpath(manifest.chain, rank, column, j), order=column)
                           for j in range(parts)]
    return sorted(pieces, key=lambda s: s.order)


GAP = np.iinfo(np.int64).min
"""Order of rows a merged segment reads only to avoid a seek (chunks outside the rectangle)."""
MAX_GAP_ROWS = 1 << 16


def merge_refs(refs) -> list[Segment]:
    """Chunk references as segments: chunks of one file and group less than MAX_GAP_ROWS apart
    are read in one go (a bundle holds an extraction's chunks back to back; the rows between
    them are read and skipped, which costs less than a seek per chunk on a cold file). Local."""
    out, by_place = [], {}
    for r in refs:
        by_place.setdefault((r.file, r.where), []).append(r)
    for (file, _), group in by_place.items():
        group.sort(key=lambda r: r.start)
        run = [group[0]]
        for r in group[1:] + [None]:
            if r is not None and r.start - run[-1].stop < MAX_GAP_ROWS:
                run.append(r)
                continue
            out.append(_merged(file, run))
            run = [r]
    return out


def _merged(file: str, run: list) -> Segment:
    first = run[0]
    if len(run) == 1:
        return Segment(file, first.table, first.start, first.stop, first.gid_min, first.gid_max,
                       order=first.column, group=first.group)
    runs, end = [], first.start
    for x in run:
        if x.start > end:
            runs.append((x.start - end, int(GAP)))
        runs.append((x.rows, x.column))
        end = x.stop
    tables = {x.table for x in run}
    return Segment(file, tables.pop() if len(tables) == 1 else -1, first.start, run[-1].stop,
                   min(x.gid_min for x in run), max(x.gid_max for x in run),
                   order=min(x.column for x in run), runs=tuple(runs), group=first.group)


def newest_rows(gids: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """Positions that hold each gid's highest-order value (a merged segment may repeat a gid when
    selective extraction skipped a pair of chunks). Local."""
    if len(gids) < 2:
        return np.arange(len(gids))
    by = np.lexsort((orders, gids))  # by gid, then order
    last = np.ones(len(by), dtype=bool)
    last[:-1] = gids[by][1:] != gids[by][:-1]
    return by[last]


def segment_files(segments: list[Segment]) -> list[str]:
    """Distinct files of `segments` in first-use order. Local."""
    return list(dict.fromkeys(s.file for s in segments))


class SegmentReader:
    """Reads segments, opening each file once. Use as a context manager. Local."""

    def __init__(self, root: str):
        self.root, self.files = root, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.files.values():
            f.close()
        self.files = {}

    def path(self, seg: Segment) -> str:
        return os.path.join(self.root, seg.file)

    def groups(self, seg: Segment):
        """(table, group, start, stop, gid_min, gid_max) of every table piece in `seg` (table -1: rows
        of several tables); damaged HDF5 structure raises CheckpointError naming the file. Local."""
        try:
            yield from self._groups(seg)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{self.path(seg)}: cannot be read (corrupted HDF5 structure): "
                                  f"{e}") from None

    def _groups(self, seg: Segment):
        path = self.path(seg)
        if seg.file not in self.files:
            self.files[seg.file] = open_shard(path)
        if seg.group:
            if seg.group not in self.files[seg.file]:
                raise CheckpointError(f"{path}: has no group /{seg.group}")
            yield (seg.table, self.files[seg.file][seg.group], seg.start, seg.stop, seg.gid_min,
                   seg.gid_max)
            return
        tables = self.files[seg.file].get("tables")
        if tables is None:
            return
        names = [str(seg.table)] if seg.table is not None else list(tables)
        for name in names:
            if name not in tables:
                raise CheckpointError(f"{path}: has no group /tables/{name}")
            group = tables[name]
            if seg.table is not None:
                yield seg.table, group, seg.start, seg.stop, seg.gid_min, seg.gid_max
            else:
                n = group["gids"].shape[0]
                yield (int(name), group, 0, n, int(group.attrs.get("gid_min", 0)),
                       int(group.attrs.get("gid_max", -1)))

    def gids(self, seg: Segment, group, start: int, stop: int) -> np.ndarray:
        """Checksum-verified global ids of rows [start, stop) of `group`. Local."""
        return read_rows(group["gids"], start, stop, self.path(seg))

    def rows(self, seg: Segment, group, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of row array `name`, decoded when quantized. Local."""
        return open_rows(group, name, self.path(seg)).rows(start, stop)
