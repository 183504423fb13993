"""A digest of every HDF5 attribute of a file, kept in the file and checked when it is opened.

Datasets carry per-block CRCs, but restore also trusts attributes: the codec of an encoded row
array and its shape, a table group's gid_min/gid_max, a 0-d array's `scalar` flag, the file's step
and rank. A writer therefore ends each file with the dataset ``/_attrs``: the SHA-256 of every
attribute of every object (object path, attribute name, dtype, shape and bytes, in sorted order),
CRC-checked like any dataset. `check` recomputes it at open: a flipped bit in an attribute, or in
the digest, is reported as damage naming the file. Files written before digests existed (format
version 1) have none and are read as they are. Local: nothing here uses MPI.
"""
from __future__ import annotations

import hashlib

import h5py
import numpy as np

from mpickpt.store.errors import CheckpointCorruptError
from mpickpt.store.h5_lowlevel import read_attrs, set_attrs

DIGEST = "_attrs"
"""Name of the digest dataset at the root of the file."""


class AttrRecord:
    """The attributes a writer set on the objects of the file it is writing, by object path, so
    that sealing the file takes their values from here instead of reading them back (HDF5's
    per-attribute calls were a quarter of a small file's CPU). Local."""

    def __init__(self):
        self.values: dict[str, dict] = {}
        self.unread: set[str] = set()  # objects whose values do not digest as read back

    def set(self, obj, attrs: dict) -> None:
        """`h5_lowlevel.set_attrs(obj, attrs)`, remembered as the values were when set."""
        set_attrs(obj, attrs)
        path = obj.name.lstrip("/") or "/"
        self.values.setdefault(path, {}).update(
            {k: _canonical(v).copy() for k, v in attrs.items() if not _reads_back_changed(v)})
        if any(_reads_back_changed(v) for v in attrs.values()):
            self.unread.add(path)

    def known(self) -> dict[str, dict]:
        """{object path: {name: value}} for `attrs_digest`'s `written`."""
        return {p: v for p, v in self.values.items() if p not in self.unread}


def attrs_digest(f, written: dict | None = None) -> bytes:
    """SHA-256 over every attribute of every object of the open file `f`. Local.

    Objects are listed with HDF5's own visit, which reports each one's attribute count: only
    objects that have attributes are opened (most datasets have none; opening every object
    through h5py was most of a restore's time). `written` (an `AttrRecord`'s values): an
    object whose attribute count is that of its entry there is digested from the entry; any
    other is read. The entry's values digest as their read-back would (`_canonical`)."""
    found = [("/", h5py.h5a.get_num_attrs(f.id))]
    h5py.h5o.visit(f.id, lambda name, info: found.append((name.decode(), info.num_attrs)),
                   info=True)
    h = hashlib.sha256()
    for name, count in sorted(found):
        if name.startswith(DIGEST) or name == ".":
            continue
        h.update(f"{name}\0".encode())
        if not count:
            continue
        known = (written or {}).get(name)
        if known is not None and len(known) == count:
            items = list(known.items())
        else:
            items = read_attrs(f.id if name == "/" else h5py.h5o.open(f.id, name.encode()))
        for key, value in sorted(items, key=lambda kv: kv[0]):
            value = _canonical(value)
            h.update(f"{key}\0{value.dtype.str}\0{value.shape}\0".encode())
            h.update(value.tobytes())
    return h.digest()


def _reads_back_changed(value) -> bool:
    """Whether h5py reads `value` back as another type: an Empty's dtype is spelled
    differently, and a Python `bytes` (variable-length ASCII) comes back as str."""
    return isinstance(value, h5py.Empty) or type(value) is bytes


def _canonical(value) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:  # variable-length strings
        array = np.asarray([str(v) for v in array.ravel()]).reshape(array.shape)
    return np.ascontiguousarray(array)


def seal(f, write_dataset, record: AttrRecord | None = None) -> None:
    """Write the digest of `f`'s attributes as /_attrs; call last, once every attribute is set.
    `write_dataset(group, name, array)` writes a CRC-checked dataset; `record`: the attributes
    the caller set through it (the others are read back). Local."""
    digest = attrs_digest(f, record.known() if record is not None else None)
    write_dataset(f, DIGEST, np.frombuffer(digest, dtype=np.uint8).copy())


def check(f, path: str, read_checked) -> None:
    """CheckpointCorruptError naming `path` unless /_attrs matches the attributes of `f`; a file
    without /_attrs passes (it predates digests; the caller decides by its format version).
    `read_checked(f, name, path)` reads a CRC-checked dataset. Local."""
    if not f.id.links.exists(DIGEST.encode()):
        return
    stored = read_checked(f, "/" + DIGEST, path).tobytes()
    if stored != attrs_digest(f):
        raise CheckpointCorruptError(f"{path}: HDF5 attributes do not match their digest /{DIGEST} "
                                     f"(an attribute was damaged)")
