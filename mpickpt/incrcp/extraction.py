"""Ingest one checkpoint's chunk into the 2-D lists: selective extraction, bundles, GC. Local.

For every table, the new chunk's keys are compared with each older row-0 chunk through IncrCP's
three filters (§4.3): key-range overlap (new keys in the older chunk's key range, at least R of
its rows: no more can be duplicates), Bloom-filter hit ratio >= R (where it pays:
`bloom_stage.BloomStage`), actual duplicate ratio >= R (ratios relative to the older chunk's
rows; a chunk an earlier filter skips, a later one would skip too). Chunks that pass are split:
the rows the new chunk repeats go to a new row-1 chunk of their column (``until`` = the new step),
the rest become that column's new row 0. All chunks produced by one extraction are concatenated
into two bundle files (§4.4), one for the new row-0 chunks and one for the new row-1 chunks,
addressed by (offset, length) per table; a file's reference count is the number of index entries
naming it and it is deleted once that reaches zero, *after* the index generation that drops it is
committed.
"""
from __future__ import annotations

import bisect
import errno
import os
import time
from dataclasses import dataclass, field

import numpy as np

from mpickpt.incrcp.bloom import BloomFilter, key_hashes
from mpickpt.incrcp.bloom_stage import BloomStage
from mpickpt.incrcp.held_bundle import HOLD_BYTES, HeldBundle, check_hold
from mpickpt.incrcp.sorted_members import ascending, members
from mpickpt.store.attr_digest import AttrRecord
from mpickpt.store.block_cache import BlockCache
from mpickpt.store.chunk_index import ChunkIndex, ChunkRef, commit_index, index_dir
from mpickpt.store.row_arrays import EncodedRows, open_rows, write_raw
from mpickpt.store.direct_io import direct_file
from mpickpt.store.file_spec import bundle_relpath
from mpickpt.store.open_files import VerifiedFiles
from mpickpt.store.reservation import Reservation
from mpickpt.store.row_arena import KEEP_BYTES, RowArena
from mpickpt.store.durable import fsync_path
from mpickpt.store.shard_file import (FORMAT_VERSION, alignment, open_hdf5,
                                      read_rows, seal_attributes, write_dataset)


@dataclass
class ExtractionStats:
    """What one ingestion did (reported to the trainer's log and kept in the index)."""

    step: int
    compared: int = 0
    skipped_range: int = 0
    skipped_bloom: int = 0
    bloom: bool = True
    """Whether stage 2 ran (`BloomStage`)."""
    skipped_ratio: int = 0
    extracted_chunks: int = 0
    extracted_rows: int = 0
    bundle_bytes: int = 0
    dropped_refs: int = 0
    deleted_files: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class BundleBuilder:
    """Rows destined for one bundle file: every table's chunks back to back in one group, ``rows``
    (one read per array restores a run of them); hands out ChunkRefs as rows arrive. Each
    chunk's rows are gathered straight into the builder's `RowArena` (one copy per row, into
    memory kept from the last bundle), and stored arrays are copied as they are: quantized rows
    are never re-quantized."""

    GROUP = "rows"

    def __init__(self, relpath: str, arena: RowArena | None = None):
        self.relpath = relpath
        self.arena = arena if arena is not None else RowArena(keep_bytes=0)
        self.arena.reset()
        self.kinds: dict[str, tuple | None] = {}
        """name -> (codec, tail, dtype) of the stored arrays under it; None for plain keys."""
        self.parts: dict[str, tuple] = {}
        """name -> the names of its arrays ('' for plain keys), each a buffer of the arena."""
        self.length = 0

    def add(self, table: int, column: int, rows: dict, until: int | None,
            which: np.ndarray | None = None) -> ChunkRef | None:
        """Append rows `which` (an index array; None: all) of one chunk's `rows` (``gids`` and
        `EncodedRows` by name); their ChunkRef in this bundle, None when no row is picked."""
        n = len(rows["gids"]) if which is None else len(which)
        if n == 0:
            return None
        start, self.length = self.length, self.length + n
        for name, value in rows.items():
            self._append(name, value, which)
        gids = self.keys(start, self.length)
        return ChunkRef(self.relpath, table, start, self.length, int(gids[0]), int(gids[-1]),
                        column, until, self.GROUP)

    def keys(self, start: int, stop: int) -> np.ndarray:
        """The keys of rows [start, stop) added so far (a view, valid until this builder's
        arena is reset)."""
        return self.arena.buffers["gids", ""].rows()[start:stop]

    def _append(self, name: str, value, which) -> None:
        kind = None if isinstance(value, np.ndarray) else (value.codec, value.tail, value.dtype)
        if self.kinds.setdefault(name, kind) != kind:
            raise ValueError(f"{self.relpath}: cannot bundle rows of {name} stored with "
                             f"different codecs or shapes")
        arrays = {"": value} if kind is None else value.arrays
        if self.parts.setdefault(name, tuple(arrays)) != tuple(arrays):
            raise ValueError(f"{self.relpath}: cannot bundle rows of {name} stored in "
                             f"different arrays ({', '.join(arrays)})")
        for part, array in arrays.items():
            self.arena.buffer((name, part), array.shape[1:], array.dtype).append(array, which)

    def hold(self) -> HeldBundle:
        """The written bundle's rows, kept in this builder's arena for the next ingestion (the
        caller must not reset the arena, or build in it, while it holds them). Local."""
        return HeldBundle(self.relpath, self.arena, self.kinds, self.parts, self.length)

    def _stored(self, name: str):
        buffers = {part: self.arena.buffers[name, part].rows() for part in self.parts[name]}
        if self.kinds[name] is None:
            return buffers[""]
        return EncodedRows(*self.kinds[name], buffers)

    def write(self, root: str, step: int, align: int = 0, direct: bool = False) -> int:
        """Write the bundle atomically and durably; returns bytes. Nothing when empty. Datasets of
        at least `align` bytes start at a multiple of it, as in checkpoint files (0: packed);
        `direct`: the large ones are written with O_DIRECT (`store.direct_io`). Local."""
        if not self.length:
            return 0
        path = os.path.join(root, self.relpath)
        tmp = path + ".tmp"
        try:
            reservation = Reservation(path, sum(self._payload(align)))  # a full disk: here
            try:
                self._write(tmp, step, align, direct, reservation)
            finally:
                reservation.close()
        except (OSError, RuntimeError) as e:  # h5py's on a full disk may be RuntimeErrors
            if os.path.exists(tmp):
                os.remove(tmp)
            if os.path.basename(path) in str(e) or getattr(e, "filename", None):
                raise
            raise OSError(getattr(e, "errno", None) or errno.EIO,
                          f"{path}: {getattr(e, 'strerror', None) or e}") from e
        fsync_path(tmp)
        os.replace(tmp, path)
        return os.path.getsize(path)

    def _payload(self, align: int) -> tuple[int, int]:
        """(the bundle's bytes, at most how much padding `align` adds before its arrays), for
        its `Reservation`. Local."""
        sizes = [b.rows().nbytes for b in self.arena.buffers.values()]
        return sum(sizes), sum(align for n in sizes if 0 < align <= n)

    def _write(self, tmp: str, step: int, align: int, direct: bool, reservation) -> None:
        """The bundle's HDF5 file at `tmp`, its blocks' room handed over by `reservation`,
        which gives the rest back before HDF5's close writes the metadata. Local."""
        before_block = reservation.release
        with open_hdf5(tmp, "w", **alignment(align)) as f, direct_file(tmp, direct) as sink:
            record = AttrRecord()  # sealed from what is set here, not read back
            record.set(f, {"format_version": FORMAT_VERSION, "step": step, "kind": "bundle"})
            group = f.require_group(self.GROUP)
            for name in self.kinds:
                folder, leaf = os.path.split(name)
                parent = group.require_group(folder) if folder else group
                stored = self._stored(name)
                if isinstance(stored, np.ndarray):
                    write_dataset(parent, leaf, stored, before_block, direct=sink)
                else:
                    write_raw(parent, leaf, stored, sink, before_block)
            seal_attributes(f, record)
            reservation.close()  # the rest covers HDF5's metadata, written at close


@dataclass
class ChunkReader:
    """Files and verified blocks of one ingestion. Files come from `opened` (the extractor's
    `VerifiedFiles`, kept open across ingestions; without one, the reader's own, closed with
    it), each checked by its identity once per ingestion. Local."""

    root: str
    opened: VerifiedFiles | None = None
    cache: BlockCache = field(default_factory=BlockCache)
    """Verified blocks: neighbouring chunks of a bundle share them (the extractor's outlive
    the ingestion, dropped with their file)."""
    held: dict = field(default_factory=dict)
    """rel -> `HeldBundle`: bundles whose chunks are read from memory, not from their file."""
    seen: dict = field(default_factory=dict)
    """rel -> (file, lookups) for the files this ingestion visited: each a (group, name) ->
    dataset (gids) or StoredRows map, looked up once while the file stays open (a bundle or
    a packed column file holds every table's chunks in one group)."""

    def __post_init__(self):
        self.owns = self.opened is None
        if self.owns:
            self.opened = VerifiedFiles(self.root, limit=0)

    def file(self, rel: str):
        """The file at `rel` (under the root), opened with its attributes checked, unless the
        same file is open already. Local."""
        return self._visit(rel)[0]

    def _visit(self, rel: str):
        if rel not in self.seen:
            self.seen[rel] = self.opened.get(rel)
        return self.seen[rel]

    def _array(self, ref: ChunkRef, name: str):
        f, lookups = self._visit(ref.file)
        key = (ref.where, name)
        if key not in lookups:
            group = f[ref.where]
            lookups[key] = group[name] if name == "gids" else open_rows(group, name, ref.file)
        return lookups[key]

    def gids(self, ref: ChunkRef) -> np.ndarray:
        """A chunk's keys, read for its filters. Local."""
        return self._gids(ref)

    def split_keys(self, ref: ChunkRef) -> np.ndarray:
        """A chunk's keys, read to count and split its duplicates (stage 3). Local."""
        return self._gids(ref)

    def _gids(self, ref: ChunkRef, held: HeldBundle | None = None) -> np.ndarray:
        """`held`: the chunk's held bundle, when the caller looked it up already."""
        held = held or self.held.get(ref.file)
        if held is not None:
            return held.keys(ref.start, ref.stop)
        return read_rows(self._array(ref, "gids"), ref.start, ref.stop, ref.file,
                         cache=self.cache)

    def rows(self, ref: ChunkRef, names: list[str], gids: np.ndarray | None = None
             ) -> dict[str, np.ndarray]:
        """A chunk's keys (`gids`, when the caller read them already) and row arrays. Local."""
        held = self.held.get(ref.file)
        rows = {"gids": self._gids(ref, held) if gids is None else gids}
        if held is not None and held.has(names):
            rows.update({n: held.raw(n, ref.start, ref.stop) for n in names})
            return rows
        rows.update({n: self._array(ref, n).raw(ref.start, ref.stop, self.cache) for n in names})
        return rows

    def close(self) -> None:
        """End the ingestion: close the files and drop their blocks when they are the reader's
        own (a shared `VerifiedFiles` keeps them, closing only those past its limit). Local."""
        self.seen = {}
        if self.owns:
            self.opened.close()
            self.cache.clear()
        else:
            self.opened.trim()


class Extractor:
    """Runs ingestions for one rank; keeps Bloom filters of row-0 chunks in memory. Local."""

    def __init__(self, root: str, ratio: float = 0.02, bits_per_key: int = 10,
                 bloom_stage: BloomStage | None = None, hold_bytes: int = HOLD_BYTES):
        """`hold_bytes`: `--incrcp-hold`, see `limit_held`."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"extraction ratio R must lie in [0, 1], got {ratio!r}")
        self.root, self.ratio, self.bits_per_key = root, ratio, bits_per_key
        self.blooms: dict[tuple, BloomFilter] = {}
        self.bloom_stage = bloom_stage or BloomStage()
        # chunk files stay open between ingestions, and their verified blocks in memory
        self.blocks = BlockCache()
        self.opened = VerifiedFiles(root, blocks=self.blocks)
        self.arenas = (RowArena(), RowArena(), RowArena())
        """The rows of the bundles: row 0 in the first two in turn (the other may hold the
        last row-0 bundle, `held`), row 1 in the third."""
        self.held: HeldBundle | None = None
        """The row-0 bundle the last ingestion wrote, read from memory by the next."""
        self.hold_bytes = 0
        self.limit_held(hold_bytes)

    def limit_held(self, nbytes: int) -> None:
        """Hold a written row-0 bundle in memory for the next ingestion when its buffers take
        at most `nbytes` (0: never), and keep each row-0 arena's buffers up to
        max(`nbytes`, `KEEP_BYTES`) between ingestions (`held_bundle`). ValueError when `nbytes`
        is negative. Local."""
        check_hold(nbytes)
        self.hold_bytes = nbytes
        for arena in self.arenas[:2]:
            arena.keep_bytes = max(nbytes, KEEP_BYTES)

    def reader(self) -> ChunkReader:
        """A reader for one ingestion, on the files and blocks this extractor keeps, and on
        the bundle it holds. Local."""
        held = {} if self.held is None else {self.held.relpath: self.held}
        return ChunkReader(self.root, self.opened, self.blocks, held)

    def forget_files(self) -> None:
        """Close every file kept open, drop their blocks and the held bundle (after a failed
        ingestion: the next opens, checks and reads them again). Local."""
        self.opened.close()
        self.blocks.clear()
        self._release()

    def _release(self, keep: RowArena | None = None) -> None:
        """Reset every arena but `keep` (keep no more than each one's limit), holding
        nothing. Local."""
        self.held = None
        for arena in self.arenas:
            if arena is not keep:
                arena.reset()

    def _row0_arena(self) -> RowArena:
        """The row-0 arena the held bundle is not in. Local."""
        first, second = self.arenas[:2]
        return second if self.held is not None and self.held.arena is first else first

    def ingest(self, index: ChunkIndex, step: int, new_refs: list[ChunkRef], row_names: list[str],
               retained: list[int] | None = None, before_commit=None,
               align: int = 0, direct: bool = False,
               reader: ChunkReader | None = None) -> ExtractionStats:
        """Add checkpoint `step`'s chunks, extract duplicates, commit the next index generation,
        then delete files no longer referenced. `before_commit()` is a fault-injection point;
        `align` is the checkpoint's `--ckpt-align` (bundle datasets start at multiples of it);
        `reader`: this extractor's `reader()`, holding files the caller opened already (the new
        columns, see `extractor_process.column_refs`), closed here. A failure anywhere forgets
        the files kept open (`forget_files`)."""
        try:
            return self._ingest(index, step, new_refs, row_names, retained, before_commit, align,
                                direct, reader or self.reader())
        except BaseException:
            self.forget_files()
            raise

    def _ingest(self, index, step, new_refs, row_names, retained, before_commit, align, direct,
                reader) -> ExtractionStats:
        start = time.perf_counter()
        stats = ExtractionStats(step, bloom=self.bloom_stage.runs())
        if step in index.columns:
            reader.close()
            return stats
        old_files = set(index.refcounts())
        row0 = BundleBuilder(bundle_relpath(index.chain, index.rank, step, 0), self._row0_arena())
        row1 = BundleBuilder(bundle_relpath(index.chain, index.rank, step, 1), self.arenas[2])
        learned = {} if stats.bloom else None  # no filters are built while stage 2 is off
        try:
            for table in sorted({r.table for r in new_refs} | set(index.cells)):
                keys = self._keys(reader, [r for r in new_refs if r.table == table], learned)
                # hashed once, tested against many filters
                keys = (keys, key_hashes(keys) if stats.bloom else None)
                for column in sorted(index.cells.get(table, {})):
                    kept, moved = self._extract_cell(reader, index.row0(table, column), keys,
                                                     step, row_names, row0, row1, stats, learned)
                    index.push_row1(table, column, kept, moved)
            index.add_column(step, new_refs)
            stats.bundle_bytes = (row0.write(self.root, step, align, direct) +
                                  row1.write(self.root, step, align, direct))
            if stats.bundle_bytes:
                fsync_path(index_dir(self.root, index.chain, index.rank))
            self._remember_blooms(index, learned or {})
        finally:
            reader.close()
            # written (or failed): the last bundle's rows come from its file again, and only the
            # new row-0 bundle's may stay in memory (`ingest` resets its arena on a failure)
            self._release(keep=row0.arena)
        self.bloom_stage.record(stats.bloom, stats.compared - stats.skipped_range,
                                stats.skipped_bloom)
        if retained is not None:
            steps = sorted(retained)
            stats.dropped_refs = index.drop(lambda r: keeps(r, steps))
        if before_commit is not None:
            before_commit()
        index.stats = {"last": stats.as_dict()}
        commit_index(self.root, index)
        live = set(index.refcounts())
        self.opened.keep_only(live)  # closed before they are deleted
        if row0.relpath in live and row0.arena.nbytes <= self.hold_bytes:
            self.held = row0.hold()  # committed: the next ingestion reads it from memory
        else:
            row0.arena.reset()
        stats.deleted_files = self._delete_unreferenced(old_files - live)
        stats.seconds = time.perf_counter() - start
        return stats

    def _keys(self, reader: ChunkReader, refs: list[ChunkRef], learned: dict | None
              ) -> np.ndarray:
        """The new chunks' keys, strictly ascending (sorted and unique where they were not);
        their Bloom filters go to `learned` (built from the keys at hand, so that a later
        ingestion need not read them back; none where `learned` is None: stage 2 is off)."""
        if not refs:
            return np.zeros(0, dtype=np.int64)
        pieces = []
        for ref in sorted(refs, key=lambda r: r.gid_min):
            pieces.append(reader.gids(ref))
            if learned is not None:
                learned[_bloom_key(ref)] = BloomFilter.of(pieces[-1], self.bits_per_key)
        return ascending(np.concatenate(pieces))  # checked once; every chunk is tested on trust

    def _extract_cell(self, reader, refs, hashed_keys, step, names, row0, row1, stats, learned):
        """One cell's row-0 chunks through the three stages. `hashed_keys`: (the new keys,
        their `key_hashes` or None where stage 2 does not run); `learned`: the filters of the
        chunks made, None where it does not."""
        (keys, hashed), kept, moved = hashed_keys, [], []
        for ref in refs:
            stats.compared += 1
            lo, hi = np.searchsorted(keys, [ref.gid_min, ref.gid_max + 1])
            if hi - lo < max(1.0, self.ratio * ref.rows):  # stage 1: too few new keys in range
                stats.skipped_range += 1
                kept.append(ref)
                continue
            if hashed is not None and self._bloom_skips(reader, ref, keys, hashed, lo, hi):  # 2
                stats.skipped_bloom += 1
                kept.append(ref)
                continue
            gids = reader.split_keys(ref)
            dup = members(gids, keys[lo:hi], checked=True)
            ndup = int(np.count_nonzero(dup))
            if ndup < self.ratio * ref.rows or ndup == 0:  # stage 3: actual duplicate ratio below R
                stats.skipped_ratio += 1
                kept.append(ref)
                continue
            rows = reader.rows(ref, names, gids)
            stats.extracted_chunks += 1
            stats.extracted_rows += ndup
            stay = row0.add(ref.table, ref.column, rows, None, np.flatnonzero(~dup))
            if stay is not None:
                kept.append(stay)
                if learned is not None:
                    learned[_bloom_key(stay)] = BloomFilter.of(row0.keys(stay.start, stay.stop),
                                                               self.bits_per_key)
            moved.append(row1.add(ref.table, ref.column, rows, step, np.flatnonzero(dup)))
        return kept, moved

    def _bloom_skips(self, reader, ref, keys, hashed, lo, hi) -> bool:
        """Stage 2: the Bloom hit ratio of the new keys in the chunk's range is below R."""
        h1, h2 = hashed
        hits = self._bloom(reader, ref).count(keys[lo:hi], (h1[lo:hi], h2[lo:hi]))
        return hits < self.ratio * ref.rows or hits == 0

    def _bloom(self, reader: ChunkReader, ref: ChunkRef) -> BloomFilter:
        key = _bloom_key(ref)
        if key not in self.blooms:  # e.g. after a restart: rebuild from the chunk's keys
            self.blooms[key] = BloomFilter.of(reader.gids(ref), self.bits_per_key)
        return self.blooms[key]

    def _remember_blooms(self, index: ChunkIndex, learned: dict) -> None:
        """Keep the filters of the row-0 chunks the new index generation names, those learned
        by this ingestion included."""
        live = {_bloom_key(r) for t in index.cells for c in index.cells[t]
                for r in index.row0(t, c)}
        self.blooms = {k: v for k, v in {**self.blooms, **learned}.items() if k in live}

    def _delete_unreferenced(self, files: set[str]) -> int:
        deleted = 0
        for rel in files:
            if rel.startswith("chains/"):
                try:
                    os.remove(os.path.join(self.root, rel))
                    deleted += 1
                except FileNotFoundError:
                    pass
        return deleted


def _bloom_key(ref: ChunkRef) -> tuple:
    return ref.file, ref.table, ref.start


def keeps(ref: ChunkRef, retained: list[int]) -> bool:
    """Garbage-collection rule: a chunk stays while some retained checkpoint needs it, i.e. one
    lies in [column, until). `retained`: ascending steps. Local."""
    if ref.until is None:
        return True
    at = bisect.bisect_left(retained, ref.column)
    return at < len(retained) and retained[at] < ref.until


def remove_orphans(root: str, index: ChunkIndex) -> int:
    """Delete the extractor's own debris the committed index does not name: bundles and bundle or
    index temporaries left by a crash in the middle of an extraction. Column files, finished or
    still being written by a checkpoint writer (`col-*.h5.tmp`), are never touched: they belong
    to checkpoints, and may await ingestion. Local."""
    folder = index_dir(root, index.chain, index.rank)
    if not os.path.isdir(folder):
        return 0
    live = {os.path.basename(f) for f in index.refcounts()}
    removed = 0
    for name in os.listdir(folder):
        ours = name.startswith(("bundle-", "index-"))
        if ours and (".tmp" in name or (name.startswith("bundle-") and name not in live)):
            os.remove(os.path.join(folder, name))
            removed += 1
    return removed
