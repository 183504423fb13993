"""HDF5 datasets, groups and numeric attributes made and read through h5py's low-level API.

h5py's high-level objects cost 50-150 us of Python each (property lists built per call, a weak
reference registry, selection objects), and a shard file holds ~140 small datasets, a group per
table and two attributes per group: that overhead was most of a background writer's CPU per file,
several times the CPU of the bytes themselves. The objects made here are the ones h5py's
high-level calls make (same datatypes, ASCII link names with intermediate groups created, no
timestamps, attributes deleted and recreated), so every reader keeps using h5py's high-level API
and files written either way are read the same. Attributes other than numeric scalars and vectors
(strings, booleans, which h5py maps to its own types) go through the high-level path. Local:
nothing here uses MPI.
"""
from __future__ import annotations

import numpy as np
from h5py import h5a, h5d, h5g, h5p, h5s, h5t


def _link_plist():
    plist = h5p.create(h5p.LINK_CREATE)
    plist.set_create_intermediate_group(True)
    plist.set_char_encoding(h5t.CSET_ASCII)
    return plist


def _untimed(kind):
    plist = h5p.create(kind)
    plist.set_obj_track_times(False)
    return plist


class Plists:
    """The property lists every object is created with, built once (read-only afterwards)."""

    def __init__(self):
        self.link = _link_plist()
        self.dataset = _untimed(h5p.DATASET_CREATE)
        self.early = _untimed(h5p.DATASET_CREATE)  # allocated at creation, never filled
        self.early.set_alloc_time(h5d.ALLOC_TIME_EARLY)
        self.early.set_fill_time(h5d.FILL_TIME_NEVER)
        self.group = _untimed(h5p.GROUP_CREATE)
        self.types: dict[str, h5t.TypeID] = {}
        self.read_types: dict[str, h5t.TypeID] = {}
        self.text = h5t.py_create(h5t.string_dtype(), logical=True)  # vlen UTF-8, as h5py's str
        self.text_memory = h5t.py_create(h5t.string_dtype())  # Python objects, converted to it

    def type_of(self, dtype: np.dtype) -> h5t.TypeID:
        """HDF5's (logical) type for a numpy dtype, cached per dtype."""
        key = dtype.str
        if key not in self.types:
            self.types[key] = h5t.py_create(dtype, logical=True)
        return self.types[key]

    def read_type_of(self, dtype: np.dtype) -> h5t.TypeID:
        """The memory type h5py reads an attribute of `dtype` with; cached for plain numbers
        and booleans (strings, enums and compound types are converted per call, as h5py does)."""
        if dtype.kind not in "iufb" or dtype.metadata or dtype.subdtype is not None:
            return h5t.py_create(dtype)
        key = dtype.str
        if key not in self.read_types:
            self.read_types[key] = h5t.py_create(dtype)
        return self.read_types[key]


PLISTS = Plists()
"""Shared by every call in this process: the lists are never modified after construction."""


def _encode(name: str) -> bytes:
    try:
        return name.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError(f"HDF5 object name {name!r}: expected ASCII") from None


def create_dataset(parent, name: str, shape: tuple, dtype, early: bool = False) -> h5d.DatasetID:
    """A new contiguous dataset `name` under the open group or file `parent`, unwritten. `early`:
    its file space is allocated now (`get_offset()` says where; nothing fills it), for a writer
    that puts the bytes there itself (`store.direct_io`). Local."""
    dtype = np.dtype(dtype)
    space = h5s.create_simple(tuple(int(n) for n in shape))
    return h5d.create(parent.id, _encode(name), PLISTS.type_of(dtype), space,
                      dcpl=PLISTS.early if early else PLISTS.dataset, lcpl=PLISTS.link)


def write_block(ds: h5d.DatasetID, block: np.ndarray, start: int, rows: int) -> None:
    """Write the C-contiguous `block` at row `start` of `ds`, a dataset of `rows` rows. Local."""
    if start == 0 and block.shape[0] == rows:
        ds.write(h5s.ALL, h5s.ALL, block)
        return
    file_space = ds.get_space()
    file_space.select_hyperslab((start,) + (0,) * (block.ndim - 1), block.shape)
    ds.write(h5s.create_simple(block.shape), file_space, block)


def write_array(parent, name: str, array: np.ndarray) -> h5d.DatasetID:
    """Create dataset `name` under `parent` holding the whole of `array`. Local."""
    array = np.ascontiguousarray(array)
    ds = create_dataset(parent, name, array.shape, array.dtype)
    if array.size:
        ds.write(h5s.ALL, h5s.ALL, array)
    return ds


def create_group(parent, name: str):
    """A new (h5py high-level) group `name` under `parent`, intermediate groups included. Local."""
    import h5py

    return h5py.Group(h5g.create(parent.id, _encode(name), lcpl=PLISTS.link, gcpl=PLISTS.group))


def _numeric(value) -> np.ndarray | None:
    """`value` as an array when it is a numeric scalar or vector h5py stores as a plain number
    type; None otherwise (strings, booleans, objects)."""
    if isinstance(value, (str, bytes, bool, np.bool_)):
        return None
    array = np.asarray(value)
    if array.dtype.kind not in "iuf" or array.ndim > 1:
        return None
    return array if array.flags.c_contiguous else array.copy()  # (keeps a 0-d array 0-d)


def set_attrs(obj, attrs: dict) -> None:
    """Set every attribute of `attrs` on the open h5py object `obj` (replacing any of the same
    name), numeric ones and strings through the low-level API. Local."""
    for key, value in attrs.items():
        if isinstance(value, str):  # a scalar vlen UTF-8 string, as h5py stores a str
            _create_attr(obj, key, np.array(value, dtype=h5t.string_dtype()), PLISTS.text,
                         PLISTS.text_memory)
            continue
        array = _numeric(value)
        if array is None:
            obj.attrs[key] = value
            continue
        _create_attr(obj, key, array, PLISTS.type_of(array.dtype))


def _create_attr(obj, key: str, array: np.ndarray, htype, mtype=None) -> None:
    name = _encode(key)
    if h5a.exists(obj.id, name):
        h5a.delete(obj.id, name)
    space = h5s.create_simple(array.shape) if array.ndim else h5s.create(h5s.SCALAR)
    attr = h5a.create(obj.id, name, htype, space)
    try:
        attr.write(array, mtype=mtype)
    finally:
        attr.close()


def read_attrs(obj_id) -> list[tuple[str, object]]:
    """Every attribute of the object `obj_id` (a low-level id) as (name, value), each value what
    h5py's high-level `attrs[name]` returns (the same reads and conversions: vlen strings decoded
    to str, top-level array types unfolded, 0-d arrays as scalars, empty ones as h5py.Empty),
    without its per-attribute Python overhead. Unordered. Local."""
    out = []
    for i in range(h5a.get_num_attrs(obj_id)):
        attr = h5a.open(obj_id, index=i)
        try:
            out.append((attr.name.decode("utf-8", "surrogateescape"), _attr_value(attr)))
        finally:
            attr.close()
    return out


def read_attr(obj_id, name: str, default=None):
    """One attribute of the object `obj_id` (a low-level id) as `read_attrs` reads it; `default`
    when it has none of that name. Local."""
    key = _encode(name)
    if not h5a.exists(obj_id, key):
        return default
    attr = h5a.open(obj_id, key)
    try:
        return _attr_value(attr)
    finally:
        attr.close()


def _attr_value(attr):
    import h5py

    shape, dtype = attr.shape, attr.dtype
    if shape is None:
        return h5py.Empty(dtype)
    htype = PLISTS.read_type_of(dtype)
    if dtype.subdtype is not None:
        dtype, sub = dtype.subdtype
        shape = shape + sub
    array = np.zeros(shape, dtype=dtype, order="C") if dtype.kind in "OSUV" else \
        np.empty(shape, dtype=dtype)
    attr.read(array, mtype=htype)
    info = h5t.check_string_dtype(dtype) if dtype.kind == "O" else None
    if info and info.length is None:
        array = np.array([b.decode("utf-8", "surrogateescape") for b in array.flat],
                         dtype=dtype).reshape(array.shape)
    return array[()] if array.ndim == 0 else array


def read_slab(ds: h5d.DatasetID, start: int, stop: int, out: np.ndarray | None = None
              ) -> np.ndarray:
    """Rows [start, stop) of the dataset `ds` (a low-level id), clamped to its rows as a slice
    is; into `out` when given (C-contiguous, of exactly those rows' shape and the dataset's
    dtype: ValueError otherwise). Local."""
    space = ds.get_space()
    shape = space.shape
    stop = min(stop, shape[0])
    start = min(start, stop)
    want = (stop - start, *shape[1:])
    if out is None:
        out = np.empty(want, dtype=ds.dtype)
    elif out.shape != want or out.dtype != ds.dtype or not out.flags.c_contiguous:
        raise ValueError(f"read_slab: destination {out.shape} {out.dtype} does not take rows "
                         f"{start}..{stop} of a {shape} {ds.dtype} dataset contiguously")
    if out.size == 0:
        return out
    if start == 0 and stop == shape[0]:
        ds.read(h5s.ALL, h5s.ALL, out)
        return out
    space.select_hyperslab((start,) + (0,) * (len(shape) - 1), out.shape)
    ds.read(h5s.create_simple(out.shape), space, out)
    return out


def open_sibling(ds: h5d.DatasetID, name: bytes) -> h5d.DatasetID:
    """The dataset at absolute path `name` in the file of `ds` (KeyError when absent). Local."""
    from h5py import h5i

    fid = h5i.get_file_id(ds)
    try:
        return h5d.open(fid, name)
    except (KeyError, ValueError):
        raise KeyError(name.decode()) from None
