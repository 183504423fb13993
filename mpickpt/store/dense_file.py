"""The dense file: the replicated dense state (MLP parameters, dense optimizer state), packed.

Format 3 writes every dense array back to back into one uint8 dataset, ``/dense/packed``, each at
a multiple of `ALIGN` bytes, and lists them in the JSON attribute ``/dense`` ``arrays``: one
``[name, dtype, shape, offset]`` per array, names relative to ``/dense`` (``param/<name>``,
``opt/<i>/<key>``). A DLRM's dense file is then 5 HDF5 objects instead of ~75, each of which
cost the writer and every restoring rank tens of µs. Formats 1 and 2 hold one dataset per array
under ``/dense``, which `dense_arrays` and `dense_listing` still read. Local: no MPI, no torch.
"""
from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass

import h5py
import numpy as np

from mpickpt.store.shard_file import CRC_SUFFIX, is_scalar, read_all

GROUP = "dense"
PACKED = "dense/packed"
INDEX_ATTR = "arrays"
ALIGN = 64


@dataclass(frozen=True)
class DenseEntry:
    """One array of a packed dense file: its bytes at [offset, offset + nbytes) of the pack;
    `dtype` with its byte order (numpy's ``str``, e.g. '<f4'), since the pack's bytes are raw."""

    name: str
    dtype: str
    shape: tuple
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def layout(arrays: dict[str, tuple[tuple, str]]) -> tuple[list[DenseEntry], int]:
    """Entries for `arrays` (name -> (shape, dtype)) in their order, and the pack's size. Local."""
    entries, at = [], 0
    for name, (shape, dtype) in arrays.items():
        entries.append(DenseEntry(name, np.dtype(dtype).str, tuple(int(s) for s in shape), at))
        at += -(-entries[-1].nbytes // ALIGN) * ALIGN
    return entries, at


def index_json(entries: list[DenseEntry]) -> str:
    """The ``arrays`` attribute for `entries`. Local."""
    return json.dumps([[e.name, e.dtype, list(e.shape), e.offset] for e in entries])


def pack(entries: list[DenseEntry], size: int, arrays: dict[str, np.ndarray],
         prefix: str = "") -> np.ndarray:
    """The pack of `arrays` (keyed by `prefix` + entry name) laid out as `entries`, in zeroed,
    page-aligned memory (an O_DIRECT writer takes its pages as they are, `store.direct_io`).
    Local."""
    out = np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=np.uint8)[:size]
    for e in entries:
        data = np.asarray(arrays[prefix + e.name], order="C")
        if data.shape != e.shape or data.dtype != np.dtype(e.dtype):
            raise ValueError(f"dense array {e.name} is {data.dtype} {data.shape}, its entry says "
                             f"{np.dtype(e.dtype)} {e.shape}")
        out[e.offset:e.offset + e.nbytes] = data.reshape(-1).view(np.uint8)
    return out


def entries_of(f: h5py.File, path: str) -> list[DenseEntry] | None:
    """The entries of a packed dense file, None for a per-array one; ValueError naming the file
    for an index that does not fit the pack. Local."""
    group = f.get(GROUP)
    if group is None or INDEX_ATTR not in group.attrs:
        return None
    raw = group.attrs[INDEX_ATTR]
    try:
        entries = [DenseEntry(str(n), np.dtype(d).str, tuple(int(s) for s in shape), int(o))
                   for n, d, shape, o in json.loads(raw)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: attribute /{GROUP} {INDEX_ATTR} is not a list of [name, "
                         f"dtype, shape, offset]: {e}") from None
    size = f[PACKED].shape[0]
    bad = [e.name for e in entries if e.offset < 0 or e.offset + e.nbytes > size]
    if bad:
        raise ValueError(f"{path}: dense arrays {bad} lie outside /{PACKED}'s {size} bytes")
    return entries


def dense_arrays(f: h5py.File, path: str) -> dict[str, np.ndarray]:
    """Name (relative to /dense) -> array of every dense array, checksum-verified. Local."""
    entries = entries_of(f, path)
    if entries is None:
        return _per_array(f, path)
    blob = read_all(f[PACKED], path)
    return {e.name: blob[e.offset:e.offset + e.nbytes].view(e.dtype).reshape(e.shape).copy()
            for e in entries}


def dense_listing(f: h5py.File, path: str) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of every dense array, without reading the data. Local."""
    entries = entries_of(f, path)
    if entries is not None:
        return [(e.name, e.shape, str(np.dtype(e.dtype))) for e in entries]
    out = []
    for name in _dataset_names(f[GROUP].id) if GROUP in f else []:
        ds = f[GROUP][name]
        out.append((name, () if is_scalar(ds) else tuple(ds.shape), str(ds.dtype)))
    return out


def _per_array(f: h5py.File, path: str) -> dict[str, np.ndarray]:
    """Formats 1 and 2: one dataset per array, listed through HDF5's own visit and low-level
    opens (h5py's `visititems` builds an object per member). Local."""
    if GROUP not in f:
        return {}
    group = f[GROUP].id
    return {name: read_all(h5py.Dataset(h5py.h5d.open(group, name.encode())), path)
            for name in _dataset_names(group)}


def _dataset_names(group_id) -> list[str]:
    names: list[str] = []
    h5py.h5o.visit(group_id, lambda n, info: names.append(n.decode())
                   if info.type == h5py.h5o.TYPE_DATASET and not n.endswith(CRC_SUFFIX.encode())
                   else None, info=True)
    return names
