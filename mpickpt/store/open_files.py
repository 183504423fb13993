"""Files opened and checked once, kept open while a long-lived reader keeps coming back to them.

The IncrCP extractor compares each new checkpoint with every older chunk of its chain, which lives
in the column files and bundles of earlier ingestions: opening each of them again at every
ingestion (HDF5's open, and the attribute digest `open_shard` checks) was a fifth of its CPU.
Those files never change once written, so a `VerifiedFiles` keeps them open across ingestions. A
path is opened again, and checked again, when it no longer names the same file (inode, size and
modification time differ: a bundle rewritten by a retried ingestion). Data blocks are still
checksum-verified whenever they are read. Local: one per reader process, no MPI.
"""
from __future__ import annotations

import os
from collections import OrderedDict

LIMIT = 64
"""Files kept open between visits at most (`trim`: least recently used closed first)."""


class VerifiedFiles:
    """Files under `root` opened with `shard_file.open_shard` (attributes checked against their
    digest), each with a dict of what the caller derived from it (datasets, row arrays), which
    is dropped when the file is closed, as are its blocks in `blocks` (a `BlockCache` whose
    blocks outlive one visit). Nothing is closed behind a visit's back: `get` only
    opens, and `trim` (between visits) closes the least recently used past `limit`. Local."""

    def __init__(self, root: str, limit: int = LIMIT, blocks=None):
        if limit < 0:
            raise ValueError(f"VerifiedFiles limit: expected a count >= 0, got {limit!r}")
        self.root, self.limit = root, limit
        self.blocks = blocks  # a BlockCache keyed by the same relative paths, kept in step
        self.entries: OrderedDict[str, tuple] = OrderedDict()
        self.opened = 0  # opens (and digest checks) so far

    def get(self, rel: str):
        """(the open file at `rel`, its lookups dict): opened and checked now unless the same
        file is open already. Errors as `open_shard`'s. Local."""
        from mpickpt.store.shard_file import open_shard

        path = os.path.join(self.root, rel)
        identity = _identity(path)
        entry = self.entries.get(rel)
        if entry is not None and identity is not None and entry[0] == identity:
            self.entries.move_to_end(rel)
            return entry[1], entry[2]
        if entry is not None:
            self._close(rel)
        f = open_shard(path)
        self.opened += 1
        self.entries[rel] = (identity, f, {})
        return f, self.entries[rel][2]

    def keep_only(self, rels) -> None:
        """Close every file not in `rels` (before they are deleted), then `trim`. Local."""
        for rel in [r for r in self.entries if r not in rels]:
            self._close(rel)
        self.trim()

    def trim(self) -> None:
        """Close the least recently used files past `limit`. Local."""
        while len(self.entries) > self.limit:
            self._close(next(iter(self.entries)))

    def close(self) -> None:
        """Close every file (safe twice). Local."""
        for rel in list(self.entries):
            self._close(rel)

    def _close(self, rel: str) -> None:
        _, f, lookups = self.entries.pop(rel)
        lookups.clear()
        if self.blocks is not None:
            self.blocks.drop_file(rel)
        f.close()


def _identity(path: str) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
