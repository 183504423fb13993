"""A survivor's units read straight from its memory by a lost rank of its group on the same host
(`cross_memory`), instead of the survivor gathering and sending them.

Every rank publishes where its rows live in each rebuild round (`describe`: fields appended to the
round's counts), with the shared buffers that hold them (`shared_rows`); a lost rank reads whole
spans of a survivor's rows and parity for a range of periods (`PeerReader.span`) and single
units for degraded reads (`PeerReader.units`): views of the survivor's buffers where it could
map them at the probe, else copies into scratch buffers it reuses (one iovec per degraded
row). The survivor does nothing: the round's counts exchange (or the lookup's, where it carries
them: `Rebuild.outgoing`) is the point where its rows are consistent, and it changes none of
them before the lost rank's lookup has finished (its rows change only in its sparse update,
which needs the pooled rows of the lost rank's lookup). Local.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from mpickpt.parity import cross_memory
from mpickpt.parity.row_words import RowWords
from mpickpt.parity.shared_rows import PeerMapError, PeerMaps

IOVEC_S = 0.75e-6
READ_BYTES_PER_S = 4e9
"""What a row read costs the kernel here: ~0.75 us per iovec (it pins the page) and ~4 GB/s
(measured on the 2-core VM); they decide between one iovec per row and one read of a span."""

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def fault_in(buf: np.ndarray) -> None:
    """Write one byte of every page `buf` touches, so that its pages are resident before a
    rebuild needs them. Local."""
    flat = buf.reshape(-1).view(np.uint8)
    flat[::PAGE_BYTES] = 0  # one write per page, and the last (a buffer seldom starts on a
    flat[-1:] = 0           # page boundary)

FIXED_FIELDS = 7
"""host key, pid, serves (its rows can be read), probed (as a lost rank: PROBED, it has read its
survivors; PREMAPPED, it mapped them all as they were published ahead, `ParityGuard.encode`), parity
address, parity's shared buffer (descriptor, offset; -1, 0 where not shared); then
(address, row stride, descriptor, offset) per row tensor."""
PER_TENSOR = 4
PROBED, PREMAPPED = 1, 2


def describe(store, enabled: bool, probed: int, mapping: bool = True,
             readable: bool = True) -> list[int]:
    """This rank's fields of a rebuild round's counts. `enabled`: the transport may use memory
    reads at all (else all zeros but the pid); `mapping`: offer the shared buffers to be mapped
    (else copies only); `readable`: let processes of this user read this one's memory
    (`cross_memory.allow_readers`, which copies need: a round's; not where only descriptors are
    published ahead, as mapping needs no ptrace attach). Local."""
    mem = store.words.memory() if enabled and cross_memory.available() else None
    serves = mem is not None and store.parity.device.type == "cpu"
    if not serves:
        return [0, os.getpid(), 0, 0, 0, -1, 0] + [0, 0, -1, 0] * len(store.words.tensors)
    if readable:
        _allow_readers()
    shared = getattr(store, "shared", None) if mapping else None
    fields = [host_key(), os.getpid(), 1, int(probed), store.parity.data_ptr(),
              *_shared_at(shared, store.parity)]
    for (address, stride, _), t in zip(mem, store.words.tensors):
        fields += [address, stride, *_shared_at(shared, t)]
    return fields


def _shared_at(shared, t) -> tuple[int, int]:
    at = shared.locate(t) if shared is not None else None
    return at if at is not None else (-1, 0)


@functools.cache
def host_key() -> int:
    """This process's host key (`cross_memory.host_key`), computed once."""
    return cross_memory.host_key()


@functools.cache
def _allow_readers() -> None:
    """Let this user's processes read this one, the first time a round publishes it."""
    cross_memory.allow_readers()


@dataclass(frozen=True)
class Peer:
    """Where one survivor's rows are, as it published them in a round."""

    key: int
    pid: int
    serves: bool
    probed: int  # 0, PROBED or PREMAPPED
    parity: int
    parity_shared: tuple[int, int]  # (descriptor, offset); descriptor -1: not shared
    tensors: tuple[tuple[int, int, int, int], ...]  # (address, row stride, descriptor, offset)

    @classmethod
    def parse(cls, fields) -> "Peer":
        f = [int(x) for x in fields]
        rest = f[FIXED_FIELDS:]
        return cls(f[0], f[1], bool(f[2]), f[3], f[4], (f[5], f[6]),
                   tuple(tuple(rest[i:i + PER_TENSOR]) for i in range(0, len(rest), PER_TENSOR)))

    def same_buffers(self, other: "Peer") -> bool:
        """`other` (published later) names the same process, host and buffers."""
        return replace(other, probed=self.probed) == self

    @property
    def mappable(self) -> bool:
        """Every buffer it published is shared (`shared_rows`)."""
        return self.parity_shared[0] >= 0 and all(t[2] >= 0 for t in self.tensors)


class PeerReader:
    """The lost rank's reads of its survivors' rows and parity. Local."""

    def __init__(self, store, maps: PeerMaps | None = None):
        """`maps`: the survivors' buffers this rank maps, shared by its readers (None: copies
        only)."""
        self.store = store
        self.widths = store.words.widths
        self.maps = maps
        self.bytes_read = 0
        self.bytes_mapped = 0
        """Of `bytes_read`, those read where a survivor's buffer lies instead of copied."""
        self._scratch: dict[tuple, np.ndarray] = {}
        self._reserved: set[tuple] = set()  # keys of `reserve`'s buffers, which `release` keeps

    def probe(self, peer: Peer, pos: int) -> None:
        """Map every buffer of `peer` (group position `pos`) where it published them shared and
        they hold its rows; else read one word of it (CrossMemoryError when the kernel
        refuses)."""
        if self.maps is not None and peer.mappable:
            try:
                self.map_peer(peer, pos)
                self.maps.mapped.add(peer.pid)
                return
            except PeerMapError:
                pass  # copies then, as where nothing is shared
        if self.store.layout.parity_rows:  # else the group holds no rows: nothing to rebuild
            cross_memory.read_span(peer.pid, peer.parity, np.empty(1, dtype=np.int32), "a word")

    def map_peer(self, peer: Peer, pos: int) -> None:
        """Map every buffer of `peer` (group position `pos`), checking that each holds its rows
        (PeerMapError where one cannot be mapped or is too short). Reads go to the maps only
        once `probe` has admitted the peer."""
        if self.maps is None:
            raise PeerMapError("this process cannot map shared memory (no memfd)")
        if not peer.mappable:
            raise PeerMapError(f"process {peer.pid} shares no row buffers to map")
        for i in range(len(self.widths)):
            self._mapped(peer, i, 0, self.store.layout.rows[pos])
        self._mapped(peer, "parity", 0, self.store.layout.parity_rows)

    def _is_mapped(self, peer: Peer) -> bool:
        """The probe mapped `peer`, and it still offers its buffers in this round."""
        return self.maps is not None and peer.mappable and peer.pid in self.maps.mapped

    def _where(self, peer: Peer, which) -> tuple[int, int, int, int, int]:
        """(address, row stride in bytes, descriptor, offset, row words) of `peer`'s row tensor
        `which` (an index) or of its parity ("parity")."""
        if which == "parity":
            W = self.store.words.width
            return (peer.parity, W * 4, *peer.parity_shared, W)
        return (*peer.tensors[which], self.widths[which])

    def _mapped(self, peer: Peer, which, first: int, n: int) -> torch.Tensor:
        """Rows [first, first + n) of `peer`'s row tensor `which` (or "parity"), an (n, width)
        int32 view of its mapped buffer."""
        _, stride, fd, offset, w = self._where(peer, which)
        if n == 0:
            return torch.zeros((0, w), dtype=torch.int32)
        words = self.maps.words(peer.pid, fd, offset + first * stride, (n - 1) * stride + 4 * w)
        return words.as_strided((n, w), (stride // 4, 1))

    def span(self, peer: Peer, pos: int, p0: int, p1: int, slot: int = 0
             ) -> tuple[RowWords, torch.Tensor]:
        """Position `pos`'s data rows and parity rows of periods [p0, p1): views of `peer`'s
        mapped buffers, or read into the scratch of survivor `slot` (0, 1, ...: one set of
        buffers per survivor a piece reads): a RowWords span (shard row numbers) and its parity
        rows p0 r ... (p1 r - 1)."""
        L = self.store.layout
        a, b = p0 * L.k, max(p0 * L.k, min(p1 * L.k, L.rows[pos]))
        W, m = self.store.words.width, (p1 - p0) * L.r
        if self._is_mapped(peer):
            tensors = [self._mapped(peer, i, a, b - a) for i in range(len(self.widths))]
            parity = self._mapped(peer, "parity", p0 * L.r, m)
            got = (b - a) * 4 * sum(self.widths) + m * W * 4
            self.bytes_read += got
            self.bytes_mapped += got
            return RowWords.span(tensors, a), parity
        tensors = []
        for i, ((address, stride, _, _), w) in enumerate(zip(peer.tensors, self.widths)):
            n = b - a
            buf = self._buffer((slot, i), n * stride)
            if n:
                cross_memory.read_span(peer.pid, address + a * stride,
                                       buf[:(n - 1) * stride + 4 * w], "rows")
                self.bytes_read += n * 4 * w
            tensors.append(torch.from_numpy(buf[:n * stride]).view(torch.int32)
                           .view(n, stride // 4)[:, :w])
        pbuf = self._buffer((slot, "parity"), m * W * 4)
        if m:
            cross_memory.read_span(peer.pid, peer.parity + p0 * L.r * W * 4, pbuf[:m * W * 4],
                                   "parity rows")
            self.bytes_read += m * W * 4
        parity = torch.from_numpy(pbuf[:m * W * 4]).view(torch.int32).view(m, W)
        return RowWords.span(tensors, a), parity

    def units(self, peer: Peer, pos: int, stripes: np.ndarray) -> torch.Tensor:
        """Position `pos`'s units (data row or parity row; zeros for padding) of `stripes`,
        ((n, W) int32)."""
        L, W = self.store.layout, self.store.words.width
        out = np.zeros((len(stripes), W), dtype=np.int32)
        rows = L.row_of_stripe(pos, stripes)
        data = np.flatnonzero(rows >= 0)
        c = 0
        for i, w in enumerate(self.widths):
            if len(data):
                out[data, c:c + w] = self._rows(peer, i, rows[data])
            c += w
        prow = L.parity_row(pos, stripes)
        par = np.flatnonzero(prow >= 0)
        if len(par):
            out[par] = self._rows(peer, "parity", prow[par])
        return torch.from_numpy(out)

    def _rows(self, peer: Peer, which, rows: np.ndarray) -> np.ndarray:
        """Rows `rows` (any order: parity rows of ascending stripes are not ascending for r >= 2)
        of `peer`'s row tensor `which` (or "parity"), (n, w) int32: loads where it is mapped;
        else one iovec per row, or one read of the span they lie in where that costs less (the
        kernel's time per iovec against its time per byte: a narrow array such as rowwise
        Adagrad's state)."""
        first, last = int(rows.min()), int(rows.max())
        if self._is_mapped(peer):
            got = self._mapped(peer, which, first, last - first + 1).numpy()[rows - first]
            self.bytes_read += got.nbytes
            self.bytes_mapped += got.nbytes
            return got
        address, stride, _, _, w = self._where(peer, which)
        span = (last - first) * stride + 4 * w
        if span / READ_BYTES_PER_S < len(rows) * IOVEC_S:
            n = last - first + 1
            buf = self._buffer(("rows", which), n * stride)
            cross_memory.read_span(peer.pid, address + first * stride, buf[:span], "rows")
            self.bytes_read += span
            table = buf[:n * stride].view(np.int32).reshape(n, stride // 4)
            return table[rows - first, :w]
        got = np.empty((len(rows), w), dtype=np.int32)
        cross_memory.read_rows(peer.pid, address, stride, rows, got, "rows")
        self.bytes_read += got.nbytes
        return got

    def reserve(self, sizes: dict) -> int:
        """Allocate the scratch buffers `sizes` ({key: bytes}) now and fault their pages in, so
        that a rebuild's first reads do not: a fresh page costs a fault, which on 2 busy cores
        came to ~10 ms in the first piece of each reader thread. Returns the bytes held."""
        for key, nbytes in sizes.items():
            fault_in(self._buffer(key, nbytes))
        self._reserved.update(sizes)
        return sum(len(self._scratch[key]) for key in self._reserved)

    def release(self) -> None:
        """Drop the scratch buffers but the reserved ones (they come back as needed)."""
        for key in set(self._scratch) - self._reserved:
            del self._scratch[key]

    def _buffer(self, key, nbytes: int) -> np.ndarray:
        """A scratch buffer of at least `nbytes`, kept for the next round (fresh pages cost a
        fault each; these stay mapped)."""
        buf = self._scratch.get(key)
        if buf is None or len(buf) < nbytes:
            buf = np.empty(max(nbytes, 1), dtype=np.uint8)
            self._scratch[key] = buf
        return buf
