"""Reader for raw Criteo day files (``label \\t I1..I13 \\t C1..C26``, one sample per line).

Dense fields: empty or negative -> 0, then log(1 + x) as float32. Categorical fields (hex ids, up to
16 digits; Criteo's are 8): ``int(hex, 16) % table_sizes[t]``, empty -> 0. Labels must be 0 or 1.

Files are read in binary mode from a byte offset kept in a `TSVPosition`, so a reader restarts
exactly where a checkpoint left it. The source keeps no open file or other state between calls: it
is thread-safe and can be shared by several readers.

Data parallelism: `read_slice` reads one *global* batch of lines on every rank and parses only the
rank's contiguous slice, so every rank returns the same next position. With ``skip_bad_lines`` every
line of the global batch is parsed (a bad line in another rank's slice must shift all slices alike);
without it, a malformed line raises `CriteoFormatError` on the rank whose slice holds it. A last
global batch with fewer than ``global_batch`` lines is dropped: `read_slice` returns None.
"""
from __future__ import annotations

import dataclasses
import os
import re
import zlib
from contextlib import closing
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from mpickpt.data.batch import Batch
from mpickpt.data.position import TSVPosition
from mpickpt.data.source import local_slice

NUM_DENSE = 13
NUM_SPARSE = 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_SPARSE

_LINE = re.compile(rb"[01](?:\t(?:-?[0-9]{1,18})?){13}(?:\t[0-9a-fA-F]{0,16}){26}\r?\n?")
_INT_FIELD = re.compile(rb"(?:-?[0-9]{1,18})?")
_HEX_FIELD = re.compile(rb"[0-9a-fA-F]{0,16}")


COMPRESSED = (b"\x1f\x8b", b"BZ", b"\x28\xb5")
"""The first bytes of gzip, bzip2 and zstd files (xz's are checked whole)."""


class NoTrainingData(ValueError):
    """The training files hold less than one global batch of (valid) lines: nothing to train."""


class CriteoFormatError(ValueError):
    """A malformed line, or data files that no longer fit a saved reader position
    (`CriteoTSVSource.changed_since`): the message names the file, the 1-based line number and
    the problem."""

    def __init__(self, path: str, line_number: int, problem: str):
        super().__init__(f"{path}, line {line_number}: {problem}")
        self.path = path
        self.line_number = line_number
        self.problem = problem


class _BadLine(Exception):
    """Internal: a line failed to parse; ``args[0]`` says why (no path or line number yet)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CriteoTSVConfig:
    """Which day files to read and how to map their categorical ids to table rows."""

    paths: tuple[str, ...]
    """One or more day files, read in this order as one stream."""
    table_sizes: tuple[int, ...]
    """Rows of each of the 26 tables (C1..C26), each >= 1."""
    skip_bad_lines: bool = False
    """Skip malformed lines (counted in the position) instead of raising CriteoFormatError."""

    def __post_init__(self):
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
        if not paths:
            raise ValueError("paths must name at least one Criteo day file, got none")
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        sizes = tuple(self.table_sizes)
        if len(sizes) != NUM_SPARSE or any(isinstance(n, bool) or not isinstance(n, (int, np.integer))
                                           or n < 1 for n in sizes):
            raise ValueError(f"table_sizes must hold {NUM_SPARSE} integers >= 1 (one per C1..C26), "
                             f"got {len(sizes)} entries: {sizes!r}")
        object.__setattr__(self, "table_sizes", tuple(int(n) for n in sizes))

    def check(self) -> None:
        """Raise FileNotFoundError, ValueError or PermissionError naming a bad path. Local."""
        for path in self.paths:
            if not os.path.exists(path):
                raise FileNotFoundError(f"Criteo day file {path} does not exist")
            if not os.path.isfile(path):
                raise ValueError(f"Criteo day file {path} is not a regular file")
            if not os.access(path, os.R_OK):
                raise PermissionError(f"Criteo day file {path} is not readable")
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic[:2] in COMPRESSED or magic == b"\xfd7zX":
                raise ValueError(f"Criteo day file {path} is compressed; expected plain "
                                 f"tab-separated text (decompress it first, e.g. gunzip)")


def _diagnose(fields: list[bytes]) -> str:
    """Say what is wrong with a line split into ``fields`` that failed the fast check. Local."""
    if len(fields) != NUM_FIELDS:
        return f"found {len(fields)} tab-separated fields, expected {NUM_FIELDS}"
    if fields[0] not in (b"0", b"1"):
        return f"label must be 0 or 1, got {fields[0].decode(errors='replace')!r}"
    for k, text in enumerate(fields[1:1 + NUM_DENSE], start=1):
        if not _INT_FIELD.fullmatch(text):
            return f"dense column I{k} is not an integer of at most 18 digits: " \
                   f"{text.decode(errors='replace')!r}"
    for k, text in enumerate(fields[1 + NUM_DENSE:], start=1):
        if not _HEX_FIELD.fullmatch(text):
            return f"categorical column C{k} is not a hex id (up to 16 hex digits): " \
                   f"{text.decode(errors='replace')!r}"
    return "line does not match the Criteo layout"


def _check_line(line: bytes) -> None:
    """Raise _BadLine unless ``line`` has the Criteo layout (one C-level regex match). Local."""
    if _LINE.fullmatch(line) is None:
        raise _BadLine(_diagnose(line.rstrip(b"\r\n").split(b"\t")))


def _parse_line(line: bytes) -> tuple[int, list[int], list[int]]:
    """(label, 13 raw dense ints, 26 raw categorical ids) of one line; raises _BadLine. Local."""
    _check_line(line)
    fields = line.rstrip(b"\r\n").split(b"\t")
    dense = [int(f) if f else 0 for f in fields[1:1 + NUM_DENSE]]
    cats = [int(f, 16) if f else 0 for f in fields[1 + NUM_DENSE:]]
    return int(fields[0]), dense, cats


def rows_to_batch(rows: list[tuple[int, list[int], list[int]]], table_sizes: tuple[int, ...]) -> Batch:
    """Turn parsed lines into a Batch: log(1 + max(x, 0)) dense, ids modulo table sizes. Local."""
    n = len(rows)
    labels = np.fromiter((r[0] for r in rows), dtype=np.float32, count=n)
    dense = np.array([r[1] for r in rows], dtype=np.float64).reshape(n, NUM_DENSE)
    cats = np.array([r[2] for r in rows], dtype=np.uint64).reshape(n, NUM_SPARSE)
    rows_idx = cats % np.array(table_sizes, dtype=np.uint64)
    return Batch(dense=torch.from_numpy(np.log1p(np.maximum(dense, 0.0)).astype(np.float32)),
                 sparse=torch.from_numpy(rows_idx.astype(np.int64).reshape(n, NUM_SPARSE, 1)),
                 labels=torch.from_numpy(labels))


class CriteoTSVSource:
    """Stateless reader of Criteo day files from a `TSVPosition`."""

    def __init__(self, config: CriteoTSVConfig):
        config.check()
        self.config = config

    def _lines(self, start: TSVPosition) -> Iterator[tuple[bytes, int, int, int]]:
        """Yield (line, file index, byte offset, 1-based line number) from ``start`` on. Local."""
        offset, number = start.byte_offset, start.line_number
        for index in range(start.file_index, len(self.config.paths)):
            with open(self.config.paths[index], "rb") as f:
                f.seek(offset)
                for line in f:
                    yield line, index, offset, number
                    offset, number = offset + len(line), number + 1
            offset, number = 0, 1

    def _parse_or_skip(self, line: bytes, index: int, number: int, keep: bool):
        """Parsed line (or True when not kept, only checked); None for a bad line in skip mode,
        else CriteoFormatError. Local."""
        try:
            return _parse_line(line) if keep else _check_line(line) or True
        except _BadLine as bad:
            if self.config.skip_bad_lines:
                return None
            raise CriteoFormatError(self.config.paths[index], number, bad.args[0]) from None

    def _scan(self, start: TSVPosition, count: int, keep: range) -> tuple[list, int, TSVPosition]:
        """Consume up to ``count`` valid lines; parse those whose ordinal is in ``keep``. Local.

        Returns (parsed kept lines, valid lines consumed, position after the last line consumed).
        Every line is checked against the layout (a fast regex), kept lines are also parsed, so
        every rank of a job raises on, or skips, the same lines and ends at the same position.
        """
        if count == 0:
            return [], 0, start
        rows, valid, bad, last = [], 0, start.bad_lines, None
        where = (start.file_index, start.byte_offset, start.line_number)
        with closing(self._lines(start)) as lines:
            for line, index, offset, number in lines:
                where, last = (index, offset + len(line), number + 1), line
                parsed = self._parse_or_skip(line, index, number, valid in keep)
                if parsed is None:
                    bad += 1
                    continue
                if valid in keep:
                    rows.append(parsed)
                valid += 1
                if valid == count:
                    break
        tail = (start.tail_length, start.tail_crc) if last is None else \
            (len(last), zlib.crc32(last))
        end = TSVPosition(file_index=where[0], byte_offset=where[1], line_number=where[2],
                          sample_index=start.sample_index + valid, bad_lines=bad,
                          tail_length=tail[0], tail_crc=tail[1])
        return rows, valid, end

    def changed_since(self, position: TSVPosition) -> CriteoFormatError | None:
        """Whether the files moved under a saved `position`: the error naming the file when
        it no longer exists among the paths, is shorter than the position, or holds another
        line before it than the one read when it was saved (`TSVPosition.tail_crc`); None
        when the position fits (or is from a checkpoint without a tail to check). Local."""
        paths, at = self.config.paths, position
        if at.file_index >= len(paths):
            return CriteoFormatError(paths[-1], at.line_number, (
                f"the checkpoint's reader is in data file {at.file_index + 1}, at line "
                f"{at.line_number}, but {len(paths)} file(s) are given: pass the files the "
                f"run read, in the same order"))
        path, size = paths[at.file_index], os.path.getsize(paths[at.file_index])
        if size < at.byte_offset:
            return CriteoFormatError(path, at.line_number, (
                f"the file has {size} bytes, and the checkpoint's reader is at byte "
                f"{at.byte_offset}: the file changed since the checkpoint"))
        if at.tail_length == 0:
            return None
        if at.tail_length > at.byte_offset:
            raise ValueError(f"reader position {at!r}: its last line cannot be longer than its "
                             f"offset")
        with open(path, "rb") as f:
            f.seek(at.byte_offset - at.tail_length)
            line = f.read(at.tail_length)
        if zlib.crc32(line) != at.tail_crc:
            return CriteoFormatError(path, at.line_number - 1, (
                "this line differs from the one read when the checkpoint was saved: the file "
                "changed since, so its reader position would resume elsewhere in the data; "
                "pass the files the run read, in the same order"))
        return None

    def completed_line(self, position: TSVPosition) -> TSVPosition:
        """`position`, past the line end (``\n`` or ``\r\n``) that now follows its last line
        where that line had none when it was read (the end of a file appended to since): a
        resume would read that line end as an empty line. Local; call after `changed_since`."""
        if position.tail_length == 0:
            return position
        with open(self.config.paths[position.file_index], "rb") as f:
            f.seek(position.byte_offset - 1)
            around = f.read(3)
        ending = next((e for e in (b"\r\n", b"\n") if around[1:].startswith(e)), b"")
        if around[:1] == b"\n" or not ending:
            return position
        return dataclasses.replace(position, byte_offset=position.byte_offset + len(ending),
                                   tail_length=position.tail_length + len(ending),
                                   tail_crc=zlib.crc32(ending, position.tail_crc))

    def read(self, position: TSVPosition, count: int) -> tuple[Batch, TSVPosition]:
        """The next ``count`` valid lines as a Batch (fewer at the end of the last file). Local."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        rows, _, end = self._scan(position, count, range(count))
        return rows_to_batch(rows, self.config.table_sizes), end

    def check(self, position: TSVPosition, count: int) -> TSVPosition:
        """Parse the next ``count`` lines as `read` would, keeping none: CriteoFormatError
        naming the first malformed one (unless skipped); the position after them. Local."""
        return self._scan(position, count, range(0))[2]

    def leftover(self, state: TSVPosition, global_batch: int) -> tuple[int, int]:
        """(valid, malformed) lines from `state` to the end of the data, where fewer than
        `global_batch` valid ones remain (the end of training: `read_slice` drops them, and its
        position does not count their malformed lines); the valid count stops at a global
        batch. Local; malformed lines raise CriteoFormatError unless ``skip_bad_lines``."""
        _, valid, end = self._scan(state, global_batch, range(0))
        return valid, end.bad_lines - state.bad_lines

    def read_slice(self, state: TSVPosition, global_batch: int, rank: int,
                   world: int) -> tuple[Batch | None, TSVPosition]:
        """This rank's slice of the next global batch, or (None, state) if fewer lines remain. Local."""
        part = local_slice(global_batch, rank, world)
        rows, valid, end = self._scan(state, global_batch, part)
        if valid < global_batch:
            return None, state
        return rows_to_batch(rows, self.config.table_sizes), end

