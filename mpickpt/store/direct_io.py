"""Writes of a file's large blocks that bypass the page cache (O_DIRECT).

A buffered write copies every byte into the kernel's page cache, and the writeback at fsync pushes
them out again: CPU per byte that a background writer takes from training. Where the page cache
has to grow for the file (a checkpoint stays on disk; its pages are new ones) it costs far more
than the copy: on this project's VM a buffered 23 MB write into a new file cost 58-110 ms of CPU,
and 7 ms where the pages of a just-deleted file were reused; with O_DIRECT it cost 2.5 ms
(`bench/time_lost.py` reports the writers' CPU per GB). A `DirectFile` writes the whole pages of a
block straight from the caller's memory (the device reads them; nothing is copied), and only the
partial pages at a block's two ends go through the page cache, so that no page is ever written
both ways. Blocks not in page-aligned memory (encoded rows, gathered rows) pass through one
page-aligned bounce buffer: a copy, which is what the page cache would cost at best; arrays made
to be written (`empty_like_file`: IncrCP's bundles, gathered into `row_arena` buffers) start on a
page.

HDF5 keeps writing its metadata and small datasets itself; the large datasets are allocated at
creation (`h5_lowlevel.create_dataset(early=True)`) so that their place in the file is known, and
their blocks come here. A filesystem that refuses O_DIRECT (EINVAL at open or at the first
write) gets buffered writes of the same bytes instead (`DirectFile.direct` says which). The file's
fsync, done by the caller, covers both kinds of write. (tmpfs takes O_DIRECT on recent kernels,
and its pages are the page cache: nothing is saved there, and nothing is lost.) Local: nothing
here uses MPI.
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os

import numpy as np

PAGE = 4096
"""Alignment of file offsets, lengths and memory for O_DIRECT (covers 512-byte and 4K devices)."""
MIN_DIRECT = 64 << 10
"""Blocks with fewer whole pages than this many bytes are written buffered: one syscall either way."""
BOUNCE_BYTES = 4 << 20


class DirectFile:
    """The file at `path` (already created), opened twice: with O_DIRECT for whole pages and
    plainly for the partial pages at block ends. Close it before the caller's fsync. Local."""

    def __init__(self, path: str):
        self.path = path
        self.plain = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            self.fd = _open_direct(path)
        except OSError:
            os.close(self.plain)
            raise
        self.bounce: mmap.mmap | None = None
        self.direct_bytes = self.buffered_bytes = 0

    @property
    def direct(self) -> bool:
        """Whether O_DIRECT writes go out (False once the filesystem refused one, and after
        `close`)."""
        return self.fd is not None

    def write_at(self, offset: int, block: np.ndarray) -> None:
        """Write the bytes of C-contiguous `block` at `offset` of the file. Local."""
        data = block.reshape(-1).view(np.uint8)
        end = offset + len(data)
        a, b = -(-offset // PAGE) * PAGE, end // PAGE * PAGE
        if self.fd is None or b - a < MIN_DIRECT:
            self._plain(data, offset)
            return
        self._plain(data[:a - offset], offset)
        self._direct(data[a - offset:b - offset], a)
        self._plain(data[b - offset:], b)

    def close(self) -> None:
        """Close both descriptors and drop the bounce buffer. Safe twice. Local."""
        for name in ("fd", "plain"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
        if self.bounce is not None:
            try:
                self.bounce.close()
            except BufferError:  # a failed write's traceback still holds a view: left to GC
                pass
            self.bounce = None

    def _plain(self, data: np.ndarray, offset: int) -> None:
        _pwrite_all(self.plain, memoryview(data), offset)
        self.buffered_bytes += len(data)

    def _direct(self, data: np.ndarray, offset: int) -> None:
        """Whole pages from `offset`: from `data` itself where it is page-aligned in memory, else
        through the bounce buffer; buffered for good once the filesystem refuses them."""
        try:
            if data.ctypes.data % PAGE == 0:
                _pwrite_all(self.fd, memoryview(data), offset)
            else:
                self._bounced(data, offset)
            self.direct_bytes += len(data)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            os.close(self.fd)
            self.fd = None  # this filesystem (or this device's alignment) refuses O_DIRECT
            self._plain(data, offset)

    def _bounced(self, data: np.ndarray, offset: int) -> None:
        if self.bounce is None:
            self.bounce = mmap.mmap(-1, BOUNCE_BYTES)
        staging = np.frombuffer(self.bounce, dtype=np.uint8)
        for at in range(0, len(data), BOUNCE_BYTES):
            piece = data[at:at + BOUNCE_BYTES]
            staging[:len(piece)] = piece
            _pwrite_all(self.fd, memoryview(self.bounce)[:len(piece)], offset + at)


def empty_like_file(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose memory starts on a page boundary when it is
    large enough for O_DIRECT (`MIN_DIRECT` bytes): written at a page-aligned file offset (a
    dataset of at least `--ckpt-align` bytes), its whole pages then go out from it, without the
    bounce buffer's copy. Smaller ones are numpy's own. Local."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < MIN_DIRECT:
        return np.empty(shape, dtype)
    raw = np.empty(nbytes + PAGE, np.uint8)
    at = -raw.ctypes.data % PAGE
    return raw[at:at + nbytes].view(dtype).reshape(shape)


@contextlib.contextmanager
def direct_file(path: str, wanted: bool = True):
    """A `DirectFile` on `path` (which must exist) for the span of the block, None unless
    `wanted`; closed after. Local."""
    sink = DirectFile(path) if wanted else None
    try:
        yield sink
    finally:
        if sink is not None:
            sink.close()


def _open_direct(path: str) -> int | None:
    """`path` opened for O_DIRECT writes, or None where the platform or filesystem has none."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_CLOEXEC | flag)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """pwrite all of `view` at `offset` (a short write continues where it stopped)."""
    while len(view):
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        view, offset = view[n:], offset + n
