"""Rows of an array picked by an index array or a mask, and rows put at given places, at the speed
of a memcpy per row.

The writers of incremental checkpoints gather the rows a save selected out of the staging
memory, IncrCP's extractor splits chunks into the rows that stay and those that move, and the
restore of an incremental chain puts each increment's rows in place. numpy's
fancy indexing copies a row of 16 floats element by element (~35x a memcpy of the same bytes
here); `np.take` halves that. The C kernel (`kernels/rows_cpu.c`, `mpickpt._rows_cpu`) copies
each row with one memcpy; without it `take_rows` is `np.take` and `put_rows` numpy's indexed
assignment. Same values either way. Local.
"""
from __future__ import annotations

import numpy as np

try:
    from mpickpt import _rows_cpu as KERNEL
except ImportError:  # built without a C compiler
    KERNEL = None


def take_rows(array: np.ndarray, which: np.ndarray) -> np.ndarray:
    """`array[which]` along the first axis, as a new array: `which` is an integer index array
    (indices in [0, len(array)); negative ones are refused) or a boolean mask of len(array).
    Local."""
    which = _index(which, array)
    if KERNEL is None or array.ndim == 0 or not array.flags.c_contiguous:
        return np.take(array, which, axis=0)
    out = np.empty((len(which),) + array.shape[1:], dtype=array.dtype)
    if out.size:
        KERNEL.gather(_bytes_of(array), which, _bytes_of(out), _row_bytes(array))
    return out


def put_rows(out: np.ndarray, which: np.ndarray, rows) -> None:
    """`out[which] = rows` along the first axis, in place: `which` as for `take_rows`. Rows of
    `out`'s dtype and row shape, one per index, go through the kernel; anything else (a cast, a
    broadcast, a scalar) through numpy's assignment. Repeated indices: the last row wins; rows
    that overlap `out` are copied first, as numpy does. Local."""
    which = _index(which, out)
    rows = np.asarray(rows)
    if (KERNEL is None or out.ndim == 0 or not (out.flags.c_contiguous and out.flags.writeable)
            or rows.dtype != out.dtype or rows.shape != (len(which),) + out.shape[1:]):
        out[which] = rows
        return
    if rows.size:
        if np.may_share_memory(rows, out):
            rows = rows.copy()
        KERNEL.scatter(_bytes_of(np.ascontiguousarray(rows)), which, _bytes_of(out),
                       _row_bytes(out))


def _index(which, array: np.ndarray) -> np.ndarray:
    """`which` as a new contiguous int64 array of row indices of `array` (the kernels run
    without the GIL, so they get an array nobody else holds): IndexError for a mask of another
    length, an index outside [0, len(array)), or anything but a 1-d integer index or boolean
    mask."""
    which = np.asarray(which)
    if which.dtype == np.bool_:
        if which.shape != array.shape[:1]:
            raise IndexError(f"a row mask of shape {which.shape} for an array of "
                             f"{len(array)} rows")
        return np.flatnonzero(which)
    if which.ndim != 1 or not (np.issubdtype(which.dtype, np.integer) or which.size == 0):
        raise IndexError(f"rows must be picked by a 1-d integer index or a boolean mask, "
                         f"got {which.dtype} of shape {which.shape}")
    if len(which) == 0:
        return np.empty(0, dtype=np.int64)
    low, high = int(which.min()), int(which.max())
    if low < 0 or high >= len(array):
        bad = low if low < 0 else high
        raise IndexError(f"row index {bad} is outside the {len(array)} rows of the array")
    return np.array(which, dtype=np.int64, copy=True)


def _row_bytes(array: np.ndarray) -> int:
    return array.dtype.itemsize * int(np.prod(array.shape[1:], dtype=np.int64))


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (any dtype, read-only ones included)."""
    return array.reshape(-1).view(np.uint8)
