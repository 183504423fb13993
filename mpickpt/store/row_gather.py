"""Rows of an array picked by an index array or a mask, and rows put at given places, at the speed
of a memcpy per row.

The writers of incremental checkpoints gather the rows a save selected out of the staging
memory where the rows stay in their places (copy-on-update, CUDA; on the CPU the stall stages
them compactly and the writers gather only their keys), IncrCP's extractor gathers the rows
that stay and those that move from the chunks it splits into its bundles, and the
restore of an incremental chain puts each increment's rows in place. numpy's
fancy indexing copies a row of 16 floats element by element (~35x a memcpy of the same bytes
here); `np.take` halves that. The C kernel (`kernels/rows_cpu.c`, `mpickpt._rows_cpu`) copies
each row with one memcpy; without it `take_rows` is `np.take` and `put_rows` numpy's indexed
assignment. Same values either way. Local.
"""
from __future__ import annotations

import math

import numpy as np

try:
    from mpickpt import _rows_cpu as KERNEL
except ImportError:  # built without a C compiler
    KERNEL = None


def take_rows(array: np.ndarray, which: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`array[which]` along the first axis, as a new array, or into `out` (a C-contiguous array
    of `array`'s dtype and one row per pick) when given: `which` is an integer index array
    (indices in [0, len(array)); negative ones are refused) or a boolean mask of len(array).
    Local."""
    if out is not None and np.may_share_memory(array, out):
        array = np.array(array)  # rows the gather overwrites are read first, as numpy does
    if out is not None and _plain(array, which, out):
        try:  # the common call (an extractor's chunk): the kernel checks every index
            KERNEL.gather(array, which, out, out.nbytes // len(which))
            return out
        except (TypeError, ValueError, BufferError):
            pass  # not contiguous, or read-only: the path below says which
    which = _index(which, array)
    if out is not None:
        _check_out(out, array, which)
    if _kernel_takes(array, which):
        if out is None:
            out = np.empty((len(which),) + array.shape[1:], dtype=array.dtype)
        KERNEL.gather(_bytes_of(array), which, _bytes_of(out), _row_bytes(array))
        return out
    if which.dtype.kind == "b":
        if out is None:
            return array[which]
        out[...] = array[which]
        return out
    _check_bounds(which, len(array))
    return np.take(array, which, axis=0, out=out)


def _plain(array, which, out) -> bool:
    """Whether `take_rows(array, which, out)` may try the kernel first: a 1-d int64 index
    array of an array the kernel takes (`_kernel_takes`), into an `out` of its dtype with one
    row per index (the kernel refuses an `out` that is not contiguous or writeable, and checks
    the bounds)."""
    return (type(which) is np.ndarray and which.dtype == INDEX and which.ndim == 1
            and len(which) > 0 and _kernel_takes(array, which) and out.dtype == array.dtype
            and out.shape == (len(which),) + array.shape[1:])


INDEX = np.dtype(np.int64)


def picked(which) -> int:
    """How many rows `which` (an index array or a mask, as `take_rows` takes) picks. Local."""
    which = np.asarray(which)
    return int(which.sum()) if which.dtype.kind == "b" else len(which)


def _check_out(out: np.ndarray, array: np.ndarray, which: np.ndarray) -> None:
    """ValueError unless `out` can take the picked rows as they are."""
    shape = (picked(which),) + array.shape[1:]
    flags = out.flags
    if (out.shape != shape or out.dtype != array.dtype or not flags.c_contiguous
            or not flags.writeable):
        faults = [w for w, bad in (("read-only", not flags.writeable),
                                   ("non-contiguous", not flags.c_contiguous)) if bad]
        raise ValueError(f"rows gathered into an array of {out.dtype} {out.shape}"
                         f"{' (' + ', '.join(faults) + ')' if faults else ''}: expected a "
                         f"writeable, contiguous {array.dtype} array of shape {shape}")


def put_rows(out: np.ndarray, which: np.ndarray, rows) -> None:
    """`out[which] = rows` along the first axis, in place: `which` as for `take_rows`. Rows of
    `out`'s dtype and row shape, one per index, go through the kernel; anything else (a cast, a
    broadcast, a scalar) through numpy's assignment. Repeated indices: the last row wins; rows
    that overlap `out` are copied first, as numpy does. Local."""
    which = _index(which, out)
    rows = np.asarray(rows)
    if (_kernel_takes(out, which) and out.flags.writeable and rows.dtype == out.dtype
            and rows.shape == (len(which),) + out.shape[1:]):
        if np.may_share_memory(rows, out):
            rows = rows.copy()
        KERNEL.scatter(_bytes_of(np.ascontiguousarray(rows)), which, _bytes_of(out),
                       _row_bytes(out))
        return
    if which.dtype.kind != "b":
        _check_bounds(which, len(out))
    out[which] = rows


KERNEL_MIN_ROWS = 512
"""A mask of fewer rows, or of a 1-d array, is numpy's: turning it into indices for the kernel
costs more than the kernel saves there. Index arrays of any length, and of 1-d arrays too, go
through the kernel: one call costs half of numpy's `take` with the bounds check it needs, for a
few rows as for many (rows of 4 and 8 bytes are copied without a memcpy call per row)."""


def _kernel_takes(array: np.ndarray, which: np.ndarray) -> bool:
    """Whether the kernel copies `which` (an index array; a mask is numpy's) of `array`."""
    return (KERNEL is not None and which.dtype.kind != "b" and isinstance(array, np.ndarray)
            and array.ndim >= 1 and not array.dtype.hasobject and array.flags.c_contiguous
            and _row_bytes(array) > 0)


def _index(which, array: np.ndarray) -> np.ndarray:
    """`which` as int64 row indices of `array`, or a mask of its rows when it is one and too few
    rows are picked for the kernel; IndexError for a mask of another length or anything but a
    1-d integer index or boolean mask. The bounds are checked by the kernel or `_check_bounds`.
    """
    which = np.asarray(which)
    kind = which.dtype.kind
    if kind == "b":
        if which.shape != array.shape[:1]:
            raise IndexError(f"a row mask of shape {which.shape} for an array of "
                             f"{len(array)} rows")
        if array.ndim < 2 or len(which) < KERNEL_MIN_ROWS:
            return which
        return np.flatnonzero(which)
    if which.ndim != 1 or (kind not in "iu" and which.size):
        raise IndexError(f"rows must be picked by a 1-d integer index or a boolean mask, "
                         f"got {which.dtype} of shape {which.shape}")
    if kind == "u" and which.size and int(which.max()) >= 1 << 63:
        raise IndexError(f"row index {int(which.max())} is outside the {len(array)} rows of "
                         f"the array")
    return np.ascontiguousarray(which, dtype=np.int64)


def _check_bounds(which: np.ndarray, rows: int) -> None:
    """IndexError naming the first index of `which` outside [0, rows) (numpy's own paths wrap
    negative indices, which these calls refuse)."""
    if len(which):
        low, high = int(which.min()), int(which.max())
        if low < 0 or high >= rows:
            raise IndexError(f"row index {low if low < 0 else high} is outside the {rows} rows "
                             f"of the array")


def _row_bytes(array: np.ndarray) -> int:
    return array.dtype.itemsize * math.prod(array.shape[1:])


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any dtype, read-only ones included)."""
    return array.reshape(-1).view(np.uint8)
