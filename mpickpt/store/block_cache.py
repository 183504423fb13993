"""Verified blocks kept while one reader reads many small row ranges of the same datasets.

Every dataset carries a CRC32 per block of `BLOCK_ROWS` rows, so reading rows [a, b) reads and
checks every block they touch. IncrCP's extraction reads each chunk of a bundle on its own, and a
bundle holds every table's chunks back to back: a chunk of a few thousand rows costs a whole block
(4 MB of D = 16 weights), read and checksummed again for each of its neighbours. A `BlockCache`
keeps the blocks it verified, least recently used first out past `limit_bytes`, so each block of
a file is read and checked once per reader. Cached blocks are read-only: a caller that writes into
what it got raises instead of changing the cache. Local: one cache per reader, no MPI.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

LIMIT_BYTES = 64 << 20


class BlockCache:
    """LRU of verified blocks keyed by (file path, dataset name, block number). Local."""

    def __init__(self, limit_bytes: int = LIMIT_BYTES):
        self.limit, self.bytes = limit_bytes, 0
        self.blocks: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.hits = self.misses = 0

    def rows(self, ds, start: int, stop: int, path: str, crc_ds=None) -> np.ndarray:
        """Rows [start, stop) of the h5py dataset `ds` of the file at `path`, every block they
        touch read and checksum-verified once (`shard_file.read_rows` semantics). Local."""
        from mpickpt.store.shard_file import BLOCK_ROWS, read_rows

        n = ds.shape[0]
        stop = min(stop, n)
        if stop <= start:
            return read_rows(ds, start, stop, path, crc_ds)
        first, last = start // BLOCK_ROWS, (stop - 1) // BLOCK_ROWS
        pieces = []
        for block in range(first, last + 1):
            key = (path, ds.name, block)
            data = self.blocks.get(key)
            if data is None:
                self.misses += 1
                data = read_rows(ds, block * BLOCK_ROWS, min(n, (block + 1) * BLOCK_ROWS), path,
                                 crc_ds)
                data.flags.writeable = False
                self._put(key, data)
            else:
                self.hits += 1
                self.blocks.move_to_end(key)
            base = block * BLOCK_ROWS  # only the rows asked for, not whole blocks, are joined
            pieces.append(data[max(start - base, 0):stop - base])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def _put(self, key: tuple, data: np.ndarray) -> None:
        self.blocks[key] = data
        self.bytes += data.nbytes
        while self.bytes > self.limit and len(self.blocks) > 1:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old.nbytes

    def drop_file(self, path: str) -> None:
        """Drop the blocks of the file at `path` (closed, changed or about to go). Local."""
        for key in [k for k in self.blocks if k[0] == path]:
            self.bytes -= self.blocks.pop(key).nbytes

    def clear(self) -> None:
        """Drop every block (the files they came from may change or go). Local."""
        self.blocks.clear()
        self.bytes = 0
