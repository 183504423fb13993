"""Growable, page-aligned row buffers that one writer reuses from one file to the next.

IncrCP's extractor splits each chunk it extracts into the rows that stay and the rows that move,
and writes each side's rows, all tables back to back, into one bundle. It used to copy every row
twice, into a new array per side when splitting and into the bundle's array when writing, both
times into fresh memory, which costs the kernel a fault and a zeroed page per 4 KB on top of the
copy. Gathered straight into a `RowBuffer`, each row is copied once, and into memory that the
last ingestion already faulted in. A buffer starts on a page boundary when it is large enough
for O_DIRECT (`direct_io.empty_like_file`), so its dataset goes out without the bounce copy.

A `RowArena` keeps a writer's buffers by name between files, up to `keep_bytes` of them: its
owner resets it once it no longer needs the rows, which empties every buffer and drops the
largest while more is held, so what is kept after is bounded. (The extractor resets a row-1
bundle's arena once it is written, and a row-0 bundle's once the next ingestion, which reads
that bundle from it, is over: `incrcp.held_bundle`.) A dropped buffer's capacity is
remembered: the next buffer of that name and shape starts there instead of doubling up to it
again (its pages are faulted in only as rows arrive). Local: nothing here uses MPI.
"""
from __future__ import annotations

import numpy as np

from mpickpt.store.direct_io import empty_like_file
from mpickpt.store.row_gather import picked, take_rows

KEEP_BYTES = 64 << 20
"""Buffer memory an arena keeps between files (the extractor has three: two for row-0 bundles
in turn, one for row 1)."""

MIN_ROWS = 1024
"""A buffer's first capacity, in rows."""


class RowBuffer:
    """Rows of one shape and dtype appended by gathering, in one array that grows by doubling
    (its rows so far copied over when it does). Local."""

    def __init__(self, row_shape: tuple, dtype, first_rows: int = MIN_ROWS):
        self.row_shape, self.dtype = tuple(row_shape), np.dtype(dtype)
        self.first_rows = max(int(first_rows), MIN_ROWS)
        """The capacity of its first allocation (at least the rows it then needs)."""
        self.data: np.ndarray | None = None
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes held (its capacity, not its length)."""
        return 0 if self.data is None else self.data.nbytes

    def append(self, source: np.ndarray, which: np.ndarray | None = None) -> np.ndarray:
        """Append `source`'s rows `which` (an index array or mask as `take_rows` takes; None:
        all of them); returns the appended rows (a view, valid until the buffer is reset or
        dropped). ValueError when the rows' shape or dtype is not the buffer's. Local."""
        if source.shape[1:] != self.row_shape or source.dtype != self.dtype:
            raise ValueError(f"rows of {source.dtype} {source.shape[1:]} appended to a buffer "
                             f"of {self.dtype} {self.row_shape} rows")
        n = len(source) if which is None else picked(which)
        self._reserve(self.length + n)
        out = self.data[self.length:self.length + n]
        if which is None:
            np.copyto(out, source)
        else:
            take_rows(source, which, out=out)
        self.length += n
        return out

    def rows(self) -> np.ndarray:
        """Every row appended since the last reset (a view). Local."""
        if self.data is None:
            return np.empty((0, *self.row_shape), self.dtype)
        return self.data[:self.length]

    def _reserve(self, rows: int) -> None:
        capacity = 0 if self.data is None else len(self.data)
        if rows <= capacity:
            return
        grown = empty_like_file((max(rows, 2 * capacity, self.first_rows), *self.row_shape),
                                self.dtype)
        if self.length:
            grown[:self.length] = self.data[:self.length]
        self.data = grown


class RowArena:
    """A writer's `RowBuffer`s by name, kept between files up to `keep_bytes`. Local."""

    def __init__(self, keep_bytes: int = KEEP_BYTES):
        self.keep_bytes = keep_bytes
        self.buffers: dict = {}
        """name (any hashable) -> RowBuffer"""
        self.dropped: dict = {}
        """name -> (row shape, dtype, capacity in rows) of the buffer `reset` last dropped."""

    def buffer(self, name, row_shape: tuple, dtype) -> RowBuffer:
        """The buffer `name` (any hashable), empty or holding what was appended to it since the
        last `reset`; a new one when the rows asked for are of another shape or dtype than those
        it held (only an empty buffer may change them), or when `reset` dropped it (then
        starting at the dropped one's capacity, for rows of its shape). Local."""
        buf = self.buffers.get(name)
        if buf is None or (buf.length == 0 and (buf.row_shape != tuple(row_shape)
                                                or buf.dtype != np.dtype(dtype))):
            shape, kind, rows = self.dropped.pop(name, (None, None, MIN_ROWS))
            same = shape == tuple(row_shape) and kind == np.dtype(dtype)
            buf = self.buffers[name] = RowBuffer(row_shape, dtype, rows if same else MIN_ROWS)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def reset(self) -> None:
        """Empty every buffer for the next file, and drop the largest ones while more than
        `keep_bytes` are held (remembering their capacity). Local."""
        for buf in self.buffers.values():
            buf.length = 0
        held = self.nbytes
        for name, buf in sorted(self.buffers.items(), key=lambda kv: -kv[1].nbytes):
            if held <= self.keep_bytes:
                break
            held -= buf.nbytes
            self.dropped[name] = (buf.row_shape, buf.dtype, len(buf.data))
            del self.buffers[name]
