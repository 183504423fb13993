"""HDF5 shard files: one per rank (and writer part) per checkpoint.

Layout of a shard file (format 3; `store.tables` also reads the per-table layout of formats 1
and 2, ``/tables/<t>/{gids, weight, state/<s>}``)::

    /                      attrs: format_version, step, kind, codec, rank, part, world_size, ...
    /rows                  attr tables: (table, start, stop, gid_min, gid_max) per table
    /rows/gids             int64 (n,)   global row ids, ascending within each table's rows
    /rows/weight           float32 (n, D)
    /rows/state/<s>        optimizer state per row, e.g. adagrad_sum (n,), momentum (n, D)
    /extra/<name>          small per-rank arrays (RNG states)
    /dense/packed          replicated dense state, packed (only in the dense file: `dense_file`)

Every dataset is contiguous, written in blocks of `BLOCK_ROWS` rows, and carries the CRC32 of each block in a
sibling dataset ``<name>.crc`` (uint32), so a reader that needs only some rows verifies only the
blocks it reads. Only background writer processes and restore open these files.
"""
from __future__ import annotations

import contextlib
import errno
import os

import h5py
import numpy as np

from mpickpt.store import attr_digest, h5_lowlevel
from mpickpt.store.crc import crc32
from mpickpt.store.direct_io import MIN_DIRECT
from mpickpt.store.errors import CheckpointCorruptError, CheckpointError

FORMAT_VERSION = 3
"""2: every file ends with /_attrs, the digest of its attributes (`store.attr_digest`); 3: shard
rows and dense arrays are packed (`store.tables`, `store.dense_file`), which a reader of format 2
would take for files without rows or dense state."""
READABLE_VERSIONS = (1, 2, 3)
BLOCK_ROWS = 1 << 16
CRC_SUFFIX = ".crc"


def block_crcs(array: np.ndarray, block_rows: int = BLOCK_ROWS) -> np.ndarray:
    """CRC32 of each block of `block_rows` rows of a C-contiguous array. Local."""
    n = array.shape[0]
    out = np.empty(max(1, -(-n // block_rows)), dtype=np.uint32)
    for i, a in enumerate(range(0, max(n, 1), block_rows)):
        block = np.ascontiguousarray(array[a:a + block_rows]).reshape(-1)
        out[i] = crc32(memoryview(block).cast("B"))
    return out


def write_dataset(group: h5py.Group, name: str, array: np.ndarray, before_block=None,
                  log=None, direct=None) -> int:
    """Write `array` block by block with per-block CRCs (a `BlockWriter`); returns bytes
    written. Local.

    The dataset is contiguous (no chunk padding, no chunk index), made through h5py's low-level
    API (`h5_lowlevel`: the high-level objects cost more CPU than the bytes of a small dataset).
    `before_block(nbytes)` is called before each block is written (the writer hands reserved
    disk space over there). `log` (a `crc_combine.BlockLog`) is told where the blocks landed in
    the file and their CRCs. `direct` (a `direct_io.DirectFile` on the same file): large
    datasets' blocks are written through it, past the page cache."""
    scalar = array.ndim == 0
    array = array.reshape(1) if scalar else array
    writer = BlockWriter(group, name, array.shape, array.dtype, before_block, log, direct)
    for a in range(0, array.shape[0], BLOCK_ROWS):
        writer.write(array[a:a + BLOCK_ROWS])
    writer.close()
    if scalar:
        h5py.Dataset(writer.ds).attrs["scalar"] = True
    return array.nbytes


class BlockWriter:
    """A contiguous dataset written block after block, each block's CRC32 kept and written as
    its checksum dataset at `close`. Each CRC is computed before the block is written
    (`store.crc`: a 4 MB block in ~0.1 ms, less than a helper thread would cost). With `direct`
    (a `direct_io.DirectFile`), a dataset of at least `direct_io.MIN_DIRECT` bytes is allocated
    at creation and its blocks are written at its offset through `direct`, not through HDF5.
    Local."""

    def __init__(self, group: h5py.Group, name: str, shape: tuple, dtype, before_block=None,
                 log=None, direct=None):
        self.group, self.name, self.before_block, self.log = group, name, before_block, log
        self.dtype, self.rows = np.dtype(dtype), shape[0]
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        early = direct is not None and self.rows * self.row_bytes >= MIN_DIRECT
        self.ds = h5_lowlevel.create_dataset(group, name, shape, dtype, early=early)
        self.direct, self.offset = (direct, self.ds.get_offset()) if early else (None, None)
        self.at, self.crcs, self.sizes = 0, [], []

    def write(self, block: np.ndarray) -> int:
        block = np.ascontiguousarray(block, dtype=self.dtype)
        self.crcs.append(crc32(memoryview(block.reshape(-1)).cast("B")))
        self.sizes.append(block.nbytes)
        if self.before_block is not None:
            self.before_block(block.nbytes)
        if block.shape[0] and self.offset is not None:
            self.direct.write_at(self.offset + self.at * self.row_bytes, block)
        elif block.shape[0]:
            h5_lowlevel.write_block(self.ds, block, self.at, self.rows)
        self.at += block.shape[0]
        return block.nbytes

    def close(self) -> None:
        if self.log is not None:
            log_blocks(self.log, self.ds, list(zip(self.crcs, self.sizes)))
        if not self.crcs:  # an empty dataset has the CRC of one empty block
            self.crcs.append(crc32(b""))
        h5_lowlevel.write_array(self.group, self.name + CRC_SUFFIX, np.array(self.crcs, np.uint32))


def log_blocks(log, ds: h5py.h5d.DatasetID, blocks: list[tuple[int, int]]) -> None:
    """Tell `log` where the contiguous dataset `ds` (a low-level id) lies in its file and its
    blocks' (crc, length); empty blocks are left out. Local."""
    log.add(ds.get_offset(), [(c, n) for c, n in blocks if n])


def read_rows(ds: h5py.Dataset, start: int, stop: int, path: str,
              crc_ds: h5py.Dataset | None = None, cache=None, out: np.ndarray | None = None
              ) -> np.ndarray:
    """Rows [start, stop) of `ds`, verifying the CRC of every block they touch (`crc_ds`: its
    checksum dataset, when the caller has it at hand; `cache`: a `block_cache.BlockCache` whose
    blocks are reused, the result then read-only). `out`: where the rows go, when the caller
    has their destination (filled and returned; read into directly when the rows are whole
    blocks and `out` takes them contiguously, which saves a copy and a buffer's page faults;
    its contents are undefined after a CheckpointCorruptError). Local."""
    if cache is not None or (out is not None and not _takes_blocks(ds, start, stop, out)):
        data = cache.rows(ds, start, stop, path, crc_ds) if cache is not None else \
            read_rows(ds, start, stop, path, crc_ds)
        if out is None:
            return data
        out[...] = data
        return out
    first, last = start // BLOCK_ROWS, max(start, stop - 1) // BLOCK_ROWS
    a, b = first * BLOCK_ROWS, min(ds.shape[0], (last + 1) * BLOCK_ROWS)
    try:
        data = h5_lowlevel.read_slab(ds.id, a, b, out)
        crc_id = crc_ds.id if crc_ds is not None else \
            h5_lowlevel.open_sibling(ds.id, (ds.name + CRC_SUFFIX).encode())
        crcs = h5_lowlevel.read_slab(crc_id, first, last + 1)
    except (OSError, KeyError, ValueError) as e:
        raise CheckpointCorruptError(f"{path}: dataset {ds.name} cannot be read: {e}") from None
    _check_blocks(data, crcs, first, ds.shape[0], path, ds.name)
    return data[start - a:stop - a]


def _check_blocks(data: np.ndarray, crcs: np.ndarray, first: int, rows: int, path: str,
                  name: str) -> None:
    """CheckpointCorruptError naming the first bad block's rows unless the blocks of `data`
    (whole blocks from block `first` of dataset `name`, `rows` rows long) have the CRCs
    `crcs`. Local."""
    got = block_crcs(data)
    if len(got) != len(crcs) or not np.array_equal(got, crcs):
        bad = first + (int(np.argmax(got != crcs)) if len(got) == len(crcs) else 0)
        raise CheckpointCorruptError(
            f"{path}: dataset {name} fails its checksum in rows "
            f"{bad * BLOCK_ROWS}..{min(rows, (bad + 1) * BLOCK_ROWS) - 1}")


def _takes_blocks(ds: h5py.Dataset, start: int, stop: int, out: np.ndarray) -> bool:
    """Whether rows [start, stop) are whole checksum blocks of `ds` and `out` takes exactly them
    in one contiguous read."""
    n = ds.shape[0]
    return (start % BLOCK_ROWS == 0 and (stop % BLOCK_ROWS == 0 or stop == n) and start < stop <= n
            and out.flags.c_contiguous and out.dtype == ds.dtype
            and out.shape == (stop - start, *ds.shape[1:]))


def read_all(ds: h5py.Dataset, path: str) -> np.ndarray:
    """The whole dataset, checksum-verified (0-d arrays come back 0-d). Local."""
    data = read_rows(ds, 0, ds.shape[0], path)
    return data.reshape(()) if is_scalar(ds) else data


def read_checked(f: h5py.File, name: str, path: str) -> np.ndarray:
    """The whole dataset at absolute path `name` of the open file `f`, checksum-verified, through
    the low-level API (a small dataset such as /_attrs, read at every open); KeyError when it is
    absent. Local."""
    ds = h5py.h5d.open(f.id, name.encode())
    try:
        data = h5_lowlevel.read_slab(ds, 0, ds.shape[0])
        crc_ds = h5py.h5d.open(f.id, (name + CRC_SUFFIX).encode())
        crcs = h5_lowlevel.read_slab(crc_ds, 0, crc_ds.shape[0])
    except (OSError, KeyError, ValueError, IndexError) as e:  # IndexError: a 0-d dataset
        raise CheckpointCorruptError(f"{path}: dataset {name} cannot be read: {e}") from None
    _check_blocks(data, crcs, 0, data.shape[0], path, name)
    return data


def is_scalar(ds: h5py.Dataset) -> bool:
    """Whether `ds` was written from a 0-d array (one row, marked `scalar`). Local."""
    return bool(h5py.h5a.exists(ds.id, b"scalar")) and bool(ds.attrs["scalar"])


def open_hdf5(path: str, mode: str = "r", **kwargs) -> h5py.File:
    """h5py.File without HDF5's file locks: the commit protocol orders writers and readers, and
    filesystems without working locks (NFS without lockd, some Lustre mounts) would otherwise fail
    every open with ENOLCK. A lock error that still surfaces is reported as one.

    Files are written in HDF5's latest format, whose metadata (superblock, object headers,
    B-trees, heaps) carries HDF5's own checksums: damaged metadata is then an error when read.
    In the earliest format it is not, and the C library can crash on it (a flipped bit in an
    attribute's header segfaulted a reader in the corruption trials). Local."""
    if mode != "r":
        kwargs.setdefault("libver", "latest")
    try:
        return h5py.File(path, mode, locking=False, **kwargs)
    except OSError as e:
        if is_lock_error(e):
            raise LockingError(path, e) from None
        raise


class LockingError(CheckpointError):
    """The filesystem refused a file lock: not damage, a configuration problem."""

    def __init__(self, path: str, error: Exception):
        super().__init__(f"{path}: the filesystem refused a file lock ({error}); mpickpt opens "
                         f"HDF5 files without locks, so something else asks for one: set "
                         f"HDF5_USE_FILE_LOCKING=FALSE, or mount the filesystem with working locks")


def is_lock_error(error: Exception) -> bool:
    """An HDF5 or OS error that comes from a refused file lock (ENOLCK, 'unable to lock'). Local."""
    text = str(error).lower()
    return getattr(error, "errno", None) == errno.ENOLCK or "unable to lock" in text or \
        "no locks available" in text


def open_shard(path: str, check_attrs: bool = True) -> h5py.File:
    """Open a shard for reading, its attributes checked against their digest; a missing,
    truncated or non-HDF5 file, or damaged attributes, raise CheckpointError. `check_attrs=False`
    skips the digest, for a file whose every byte was just checked against the whole-file CRC32
    of its sealed manifest (verify). Local."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: shard file is missing")
    try:
        f = open_hdf5(path, "r")
    except LockingError:
        raise
    except OSError as e:
        raise CheckpointCorruptError(f"{path}: not a readable HDF5 file (truncated or corrupted): "
                                     f"{e}") from None
    try:
        version = h5_lowlevel.read_attr(f.id, "format_version")
        if version not in READABLE_VERSIONS:
            raise CheckpointError(f"{path}: format_version {version!r}, expected one of "
                                  f"{list(READABLE_VERSIONS)}")
        if version >= 2 and not f.id.links.exists(attr_digest.DIGEST.encode()):
            raise CheckpointCorruptError(f"{path}: the digest of its attributes "
                                         f"/{attr_digest.DIGEST} is missing (damaged)")
        if check_attrs:
            attr_digest.check(f, path, read_checked)
    except CheckpointError:
        f.close()
        raise
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as e:
        f.close()
        raise CheckpointCorruptError(f"{path}: HDF5 metadata cannot be read (corrupted): "
                                     f"{e}") from None
    return f


class OpenShards:
    """Shard files opened with `open_shard` (attributes checked) once each for one reader that
    visits a file more than once (a restore reads rows, then RNG states from the same shard);
    closed at exit. `open(path)` is an opener for `segments.SegmentReader`. `check(path, f)`,
    when given, vets each file as it is opened (raising CheckpointError), e.g. its identity
    (`checkpoint.identity.IdentityCheck`). Local."""

    def __init__(self, check=None):
        self.files: dict[str, h5py.File] = {}
        self.check = check

    def open(self, path: str) -> h5py.File:
        if path not in self.files:
            f = open_shard(path)
            try:
                if self.check is not None:
                    self.check(path, f)
            except BaseException:
                f.close()
                raise
            self.files[path] = f
        return self.files[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for f in self.files.values():
            f.close()
        self.files = {}


def alignment(align: int) -> dict:
    """h5py.File arguments that start every object of at least `align` bytes at a multiple of
    `align` (a parallel filesystem's stripe size, so no two ranks' datasets share a stripe); {}
    for 0. Local."""
    return {"alignment_threshold": align, "alignment_interval": align} if align > 0 else {}


def seal_attributes(f: h5py.File, record: attr_digest.AttrRecord | None = None) -> None:
    """End a file being written with the digest of its attributes (`record`: those the writer
    set through it, not read back). Local."""
    attr_digest.seal(f, write_dataset, record)


def verify_file(path: str, opener=None) -> list[str]:
    """Check every dataset's block checksums; returns the problems found (empty when sound).
    `opener(path)` supplies an open file it keeps (default: opened and closed here). Local."""
    try:
        f = (opener or open_shard)(path)
    except CheckpointError as e:
        return [str(e)]
    problems: list[str] = []
    with contextlib.nullcontext(f) if opener else f:
        datasets: dict[str, h5py.Dataset] = {}
        try:
            f.visititems(lambda n, o: datasets.__setitem__(n, o)
                         if isinstance(o, h5py.Dataset) else None)
        except (RuntimeError, OSError, KeyError, ValueError) as e:
            return [f"{path}: HDF5 structure cannot be read (corrupted metadata): {e}"]
        for name, ds in datasets.items():
            if name.endswith(CRC_SUFFIX):
                continue
            try:
                crc_ds = datasets.get(name + CRC_SUFFIX)
                if crc_ds is None:
                    raise KeyError(f"its checksums {name + CRC_SUFFIX} are missing")
                read_rows(ds, 0, ds.shape[0], path, crc_ds)
            except CheckpointError as e:
                problems.append(str(e))
            except (RuntimeError, OSError, KeyError, ValueError) as e:
                problems.append(f"{path}: dataset /{name} cannot be read: {e}")
    return problems
