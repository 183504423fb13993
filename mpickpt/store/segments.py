"""Segments: the ordered pieces of files that make up one checkpoint, and reading them.

A Segment is rows [start, stop) of one table group (or every table group, `table=None`) of one
file; a checkpoint kind (`mpickpt.kinds`) lists the segments of a checkpoint in the order to apply
them, later rows overwriting earlier ones (or, within a merged segment, the newest step winning).
`load_rows` applies them for one rank under any shard plan. Local: nothing here uses MPI.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest
from mpickpt.store.row_arrays import open_rows
from mpickpt.store.row_gather import put_rows, take_rows
from mpickpt.store.shard_file import open_shard, read_rows
from mpickpt.store.tables import table_pieces


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
    spans: tuple | None = None
    """[g0, g1) global-id ranges outside which the segment holds no row (a whole shard file: its
    writer's shards under the manifest's plan); None: unknown. A restore skips, without opening
    it, a segment none of whose spans it owns rows of."""

    def row_orders(self, n: int) -> np.ndarray:
        """The order of each of the segment's `n` rows (GAP for rows it does not hold). Local."""
        if not self.runs:
            return np.full(n, self.order, dtype=np.int64)
        return np.repeat([o for _, o in self.runs], [k for k, _ in self.runs]).astype(np.int64)


def whole_files(manifest: Manifest) -> list[Segment]:
    """The shard files a checkpoint wrote itself, as segments ordered by its step, each with the
    global-id spans of its writer's shards where the manifest's plan lists them. Local."""
    spans = writer_spans(manifest.plan)
    return [Segment(rel, order=manifest.step, spans=spans.get(manifest.files[rel].get("rank")))
            for rel in manifest.shard_files()]


def writer_spans(plan: dict) -> dict[int, tuple]:
    """Writer rank -> the [g0, g1) global-id ranges of its shards, from a manifest's plan (its
    `describe()`); empty when the plan does not list its shards. Local."""
    if not isinstance(plan, dict) or "shards" not in plan or "table_sizes" not in plan:
        return {}
    offsets = np.concatenate([[0], np.cumsum(plan["table_sizes"], dtype=np.int64)])
    out: dict[int, list] = {}
    for table, row_start, row_end, rank in plan["shards"]:
        g0 = int(offsets[table]) + int(row_start)
        out.setdefault(int(rank), []).append((g0, g0 + int(row_end) - int(row_start)))
    return {rank: tuple(sorted(v)) for rank, v in out.items()}


def wanted_files(segments: list[Segment], plan, rank: int,
                 rows: tuple[int, int] | None = None) -> set[str]:
    """The files of `segments` that `load_rows` opens for `rank` under `plan`. Local."""
    ranges = owned_ranges(plan, rank, rows)
    return {s.file for s in segments if _wanted(s, ranges)}


def _wanted(seg: Segment, ranges) -> bool:
    """Whether `seg` may hold rows of the owned `ranges` ((table, g0, g1, row) tuples)."""
    return seg.spans is None or any(a < g1 and g0 < b for a, b in seg.spans
                                    for _, g0, g1, _ in ranges)


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
    """Reads segments, opening each file once. Use as a context manager. `opener(path)`, when
    given, supplies open files that it keeps and closes itself (a verification session). Local."""

    def __init__(self, root: str, opener=None):
        self.root, self.files, self.opener = root, {}, opener

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.opener is None:
            for f in self.files.values():
                f.close()
        self.files = {}

    def path(self, seg: Segment) -> str:
        return os.path.join(self.root, seg.file)

    def groups(self, seg: Segment, join=None):
        """(table, group, start, stop, gid_min, gid_max) of every table piece in `seg` (table -1: rows
        of several tables); damaged HDF5 structure raises CheckpointError naming the file.
        `join(pieces)`: whether a whole packed file whose gids ascend across its tables is read
        as one piece (`load_rows`: when the rank owns rows of every table in it); by default
        each table is its own piece. Local."""
        try:
            yield from self._groups(seg, join)
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(f"{self.path(seg)}: cannot be read (corrupted HDF5 structure): "
                                  f"{e}") from None

    def _groups(self, seg: Segment, join=None):
        path = self.path(seg)
        if seg.file not in self.files:
            self.files[seg.file] = (self.opener or open_shard)(path)
        f = self.files[seg.file]
        if seg.group:
            if seg.group not in f:
                raise CheckpointError(f"{path}: has no group /{seg.group}")
            yield seg.table, f[seg.group], seg.start, seg.stop, seg.gid_min, seg.gid_max
            return
        if seg.table is not None:  # a chunk of a per-table column file (format 2)
            if f"tables/{seg.table}" not in f:
                raise CheckpointError(f"{path}: has no group /tables/{seg.table}")
            yield (seg.table, f[f"tables/{seg.table}"], seg.start, seg.stop, seg.gid_min,
                   seg.gid_max)
            return
        pieces = table_pieces(f)
        if join is not None and _ascending(pieces) and join(pieces):  # `_apply_sorted` joins
            p = pieces[0]
            yield -1, p.group, 0, pieces[-1].stop, p.gid_min, pieces[-1].gid_max
            return
        for p in pieces:
            yield (p.table, p.group, p.start, p.stop, 0 if p.gid_min is None else p.gid_min,
                   -1 if p.gid_max is None else p.gid_max)

    def gids(self, seg: Segment, group, start: int, stop: int) -> np.ndarray:
        """Checksum-verified global ids of rows [start, stop) of `group`. Local."""
        return read_rows(group["gids"], start, stop, self.path(seg))

    def rows(self, seg: Segment, group, name: str, start: int, stop: int,
             out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop) of row array `name`, decoded when quantized; into `out` when
        given (see StoredRows.rows). Local."""
        return open_rows(group, name, self.path(seg)).rows(start, stop, out)


def _ascending(pieces) -> bool:
    """Whether the pieces share one packed group and its gids ascend across them (each piece's
    gids ascend, and every piece's come before the next one's), so the whole group reads as one
    sorted segment. Local."""
    return len(pieces) > 0 and all(p.packed and p.rows for p in pieces) and all(
        p.gid_max < q.gid_min for p, q in zip(pieces, pieces[1:]))


def owned_ranges(plan, rank: int, rows: tuple[int, int] | None = None
                 ) -> list[tuple[int, int, int, int]]:
    """(table, first global id, end global id, first row) of each shard of `rank`, the first row
    counted from `rows[0]` when only local rows [rows[0], rows[1]) are wanted. Local."""
    off = plan.table_offsets
    lo, hi = rows if rows is not None else (0, plan.local_rows(rank))
    out = []
    for s in plan.shards_of(rank):
        a, b = max(lo, s.local_start), min(hi, s.local_start + s.rows)
        if a < b:
            g0 = int(off[s.table] + s.row_start) + a - s.local_start
            out.append((s.table, g0, g0 + b - a, a - lo))
    return out


def load_rows(root: str, segments: list[Segment], plan, rank: int, templates: dict,
              step: int, complete: bool = True, rows: tuple[int, int] | None = None,
              with_steps: bool = False, opener=None, into: dict | None = None):
    """This rank's rows under `plan` from `segments` (only local rows [rows[0], rows[1]) when
    given); where several segments hold a row, the highest order (newest step) wins. Local.

    `templates` maps row-array names to (shape tail, dtype). With `complete`, every row must come
    from some segment (benchmarks read an incremental checkpoint's increments alone). With
    `with_steps`, returns (rows, the step that wrote each row) instead. `opener`: as
    `SegmentReader`'s. `into`: writable arrays the rows go straight into instead of new ones
    (one per template, (n, *tail) of its dtype: a model's own row memory; `place` checks them),
    whose rows are undefined after an error."""
    lo, hi = rows if rows is not None else (0, plan.local_rows(rank))
    n = hi - lo
    out = place(templates, n, into)
    newest = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    ranges = owned_ranges(plan, rank, (lo, hi))

    def joinable(pieces) -> bool:  # every table of the file has rows of ours: read it whole
        return all(any(p.gid_max >= g0 and p.gid_min < g1 for _, g0, g1, _ in ranges)
                   for p in pieces)

    with SegmentReader(root, opener) as reader:
        for seg in segments:
            if not _wanted(seg, ranges):  # another rank's file: not even opened
                continue
            for table, group, start, stop, gmin, gmax in reader.groups(seg, joinable):
                mine = [r for r in ranges if table in (r[0], -1) and gmax >= r[1] and gmin < r[2]]
                if not mine or stop <= start:
                    continue
                gids = reader.gids(seg, group, start, stop)
                if seg.runs:
                    _apply_merged(reader, seg, group, start, gids, mine, out, newest)
                else:
                    _apply_sorted(reader, seg, group, start, gids, mine, out, newest)
    if complete and (newest == np.iinfo(np.int64).min).any():
        missing = np.nonzero(newest == np.iinfo(np.int64).min)[0]
        raise CheckpointError(f"checkpoint step {step} lacks {missing.size} rows of rank {rank}, "
                              f"e.g. global ids "
                              f"{plan.local_to_global(rank, lo + missing[:5]).tolist()}")
    return (out, newest) if with_steps else out


def place(templates: dict, n: int, into: dict | None) -> dict[str, np.ndarray]:
    """Where `load_rows` puts `n` rows of each template: the arrays of `into` when it has one
    of each template's shape and dtype, writable (ValueError naming the first that is not),
    else new arrays. Local."""
    if into is None:
        return {k: np.empty((n, *tail), dtype=dt) for k, (tail, dt) in templates.items()}
    for k, (tail, dt) in templates.items():
        a = into.get(k)
        if a is None or a.shape != (n, *tail) or a.dtype != np.dtype(dt) \
                or not a.flags.writeable:
            raise ValueError(f"rows cannot be loaded into {k!r}: it is "
                             f"{None if a is None else (a.shape, str(a.dtype))}, expected a "
                             f"writable {(n, *tail)} array of {np.dtype(dt)}")
    return {k: into[k] for k in templates}


def _apply_sorted(reader, seg, group, start, gids, mine, out, newest) -> None:
    """A segment with ascending gids: read only the owned ranges, each run of ranges that are
    consecutive both in the file and in local rows in one read (a whole packed shard: the
    rank's rows in one go, straight into place where the blocks allow). Local."""
    for i0, i1, where, keep in _owned_reads(seg, gids, mine, newest):
        for name in out:
            if keep is None:  # into place, no copy where the blocks allow
                reader.rows(seg, group, name, start + i0, start + i1, out[name][where])
            else:
                put_rows(out[name], where,
                         take_rows(reader.rows(seg, group, name, start + i0, start + i1), keep))
        newest[where] = seg.order


def _owned_reads(seg, gids, mine, newest) -> list:
    """(i0, i1, where, keep) per read of segment rows [i0, i1): `where` a slice of local rows
    and `keep` None where every row is taken and they are consecutive, else the local rows of
    the kept ones and the mask. Local."""
    reads: list = []
    for _, g0, g1, local0 in mine:
        i0, i1 = (int(i) for i in np.searchsorted(gids, [g0, g1]))
        if i1 <= i0:
            continue
        local = local0 + gids[i0:i1] - g0
        keep = seg.order >= newest[local]
        if not keep.any():
            continue
        if not keep.all() or int(local[-1]) - int(local[0]) + 1 != len(local):
            reads.append((i0, i1, local[keep], keep))
            continue
        where = slice(int(local[0]), int(local[-1]) + 1)
        last = reads[-1] if reads else None
        if last is not None and last[3] is None and last[1] == i0 and last[2].stop == where.start:
            reads[-1] = (last[0], i1, slice(last[2].start, where.stop), None)
        else:
            reads.append((i0, i1, where, None))
    return reads


def _apply_merged(reader, seg, group, start, gids, mine, out, newest) -> None:
    """Adjacent chunks read in one go: select owned rows, newest value per row. Local."""
    orders = seg.row_orders(len(gids))
    local = np.full(len(gids), -1, dtype=np.int64)
    for _, g0, g1, local0 in mine:
        inside = (gids >= g0) & (gids < g1)
        local[inside] = local0 + gids[inside] - g0
    pos = np.nonzero((local >= 0) & (orders != GAP))[0]
    pos = pos[newest_rows(gids[pos], orders[pos])]
    pos = pos[orders[pos] >= newest[local[pos]]]
    if pos.size == 0:
        return
    where = local[pos]
    for name in out:
        put_rows(out[name], where,
                 take_rows(reader.rows(seg, group, name, start, start + len(gids)), pos))
    newest[where] = orders[pos]
