"""Row arrays in shard files: plain datasets, or groups of encoded (quantized) rows.

A lossless row array is a dataset ``<table group>/<name>`` (n, ...) as before. A row array stored
with a lossy codec (`mpickpt.quant.codecs`) is a *group* of that name whose attributes hold the
codec (``codec``, JSON) and the logical shape (``shape``, ``dtype``); its datasets are the codec's
arrays (``codes`` + ``scale`` + ``offset``, ``centroids``, or ``values``), each written block by
block with per-block CRCs like every dataset. Encoding runs block by block (`BLOCK_ROWS` rows), so
a background writer never holds more than one encoded block beyond the staged rows.

`StoredRows` hides the difference from readers: `.shape`, `.dtype`, `.rows(a, b)` (decoded,
checksum-verified) and `.raw(a, b)` (the encoded arrays, for copying rows without re-quantizing).
1-D row arrays (per-row optimizer scalars) are encoded as rows of one value, so only fp16/fp32 apply
to them. Local: nothing here uses MPI.
"""
from __future__ import annotations

from dataclasses import dataclass

import h5py
import numpy as np

from mpickpt.quant.codecs import Codec, from_attrs
from mpickpt.store import h5_lowlevel
from mpickpt.store.errors import CheckpointCorruptError
from mpickpt.store.row_gather import take_rows
from mpickpt.store.shard_file import BLOCK_ROWS, BlockWriter, read_rows


def is_encoded(obj) -> bool:
    """Whether an HDF5 object is an encoded row array (a group carrying a codec). Local."""
    return isinstance(obj, h5py.Group) and "codec" in obj.attrs


class StoredRows:
    """One row array of a table group, plain or encoded. Local."""

    def __init__(self, obj, path: str):
        self.obj, self.path = obj, path
        self.codec: Codec | None = None
        self._parts: dict | None = None  # the codec's datasets, looked up at the first raw()
        if is_encoded(obj):
            try:
                self.codec = from_attrs(obj.attrs)
                self.shape = tuple(int(v) for v in obj.attrs["shape"])
            except (KeyError, ValueError) as e:
                raise CheckpointCorruptError(f"{path}: encoded array {obj.name}: {e}") from None
            self.dtype = np.dtype(str(obj.attrs.get("dtype", "float32")))
        else:
            self.shape, self.dtype = tuple(obj.shape), obj.dtype

    @property
    def name(self) -> str:
        return self.obj.name

    @property
    def dim(self) -> int:
        return self.shape[1] if len(self.shape) > 1 else 1

    def rows(self, start: int, stop: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, stop), decoded to the logical dtype and shape; written into `out` and
        returned when given (plain rows are then read straight into it where they can be: see
        `shard_file.read_rows`). Local."""
        if self.codec is None:
            return read_rows(self.obj, start, stop, self.path, out=out)
        into = out if out is not None and self.dtype == np.float32 else None
        rows = self.codec.decode(self.raw(start, stop).arrays, self.dim, into)
        if into is not None and np.may_share_memory(rows, into):
            return out  # decoded in place
        rows = rows.reshape((stop - start, *self.shape[1:])).astype(self.dtype, copy=False)
        if out is None:
            return rows
        out[...] = rows
        return out

    def raw(self, start: int, stop: int, cache=None) -> "EncodedRows":
        """The stored arrays of rows [start, stop), checksum-verified (`cache`: as
        `shard_file.read_rows`'s). Local."""
        if self.codec is None:
            return EncodedRows(None, self.shape[1:], str(self.dtype),
                               {"values": read_rows(self.obj, start, stop, self.path,
                                                    cache=cache)})
        arrays = {key: read_rows(ds, start, stop, self.path, cache=cache)
                  for key, ds in self.parts().items()}
        return EncodedRows(self.codec, self.shape[1:], str(self.dtype), arrays)

    def parts(self) -> dict:
        """The codec's datasets by name, looked up once (a reader of many small row ranges,
        IncrCP's extraction, asks for them per chunk). Local."""
        if self._parts is None:
            missing = [k for k in self.codec.array_names() if k not in self.obj]
            if missing:
                raise CheckpointCorruptError(f"{self.path}: encoded array {self.obj.name} lacks "
                                             f"its dataset {missing[0]}")
            self._parts = {k: self.obj[k] for k in self.codec.array_names()}
        return self._parts


def open_rows(group: h5py.Group, name: str, path: str) -> StoredRows:
    """The row array `name` of a table group (KeyError when absent). Local."""
    return StoredRows(group[name], path)


@dataclass
class EncodedRows:
    """Stored arrays of some rows, copied between files without decoding (codec None: plain)."""

    codec: Codec | None
    tail: tuple
    dtype: str
    arrays: dict

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, rows) -> "EncodedRows":
        """The selected rows (a mask or index array). Local."""
        return EncodedRows(self.codec, self.tail, self.dtype,
                           {k: take_rows(a, rows) for k, a in self.arrays.items()})


def write_encoded(parent: h5py.Group, name: str, data: np.ndarray, codec: Codec,
                  before_block=None, log=None, direct=None) -> int:
    """Encode `data` block by block into the group `name`; returns the bytes stored. `log` and
    `direct`: as `shard_file.write_dataset`'s. Local."""
    n = data.shape[0]
    rows2d = data.reshape(n, -1)
    group = _encoded_group(parent, name, codec, data.shape, data.dtype)
    probe = codec.encode(rows2d[:0])
    writers = {k: BlockWriter(group, k, (n, *a.shape[1:]), a.dtype, before_block, log, direct)
               for k, a in probe.items()}
    total = 0
    for a in range(0, n, BLOCK_ROWS):
        for k, arr in codec.encode(rows2d[a:a + BLOCK_ROWS]).items():
            total += writers[k].write(arr)
    for w in writers.values():
        w.close()
    return total


def write_raw(parent: h5py.Group, name: str, rows: EncodedRows, direct=None,
              before_block=None) -> int:
    """Write rows copied with `StoredRows.raw` (no re-encoding); returns bytes stored. `direct`
    and `before_block`: as `shard_file.write_dataset`'s. Local."""
    from mpickpt.store.shard_file import write_dataset

    if rows.codec is None:
        return write_dataset(parent, name, rows.arrays["values"], before_block, direct=direct)
    n = len(rows)
    group = _encoded_group(parent, name, rows.codec, (n, *rows.tail), np.dtype(rows.dtype))
    return sum(write_dataset(group, k, a, before_block, direct=direct)
               for k, a in rows.arrays.items())


def _encoded_group(parent, name, codec: Codec, shape, dtype) -> h5py.Group:
    group = parent.require_group(name)
    h5_lowlevel.set_attrs(group, {**codec.attrs(), "shape": np.asarray(shape, dtype=np.int64),
                                  "dtype": str(np.dtype(dtype))})
    return group
