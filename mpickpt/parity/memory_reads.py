"""The lost rank's side of a rebuild that reads its survivors' memory (`peer_rows`): units for
degraded reads, and whole periods XORed straight into its own rows (r = 1) or gathered per
survivor for the decoder (r >= 2). The work is split into pieces of about PIECE_BYTES, spread
over up to MAX_THREADS threads, each with a `PeerReader` of its own (the reads and the XOR kernel
release the GIL). Local: nothing here talks to other ranks."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from mpickpt.parity.peer_rows import Peer, PeerReader
from mpickpt.parity.period_slots import move_range, segments, slot_view
from mpickpt.parity.xor_rows import xor_views

PIECE_BYTES = 4 << 20
"""A chunk is read in pieces of about this many bytes of units, so that the scratch buffers stay
a few MB and are reused."""
MAX_THREADS = 4
"""Threads a lost rank reads and XORs with (at most its cores)."""


class MemoryReads:
    """Reads and decodes of one lost rank. Local; `close` ends its threads."""

    def __init__(self, store):
        self.store = store
        threads = min(MAX_THREADS, len(os.sched_getaffinity(0)))
        self.readers = [PeerReader(store) for _ in range(threads)]
        self._pool: ThreadPoolExecutor | None = None
        self._buffers: dict[int, torch.Tensor] = {}

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    def probe(self, peers: dict[int, Peer]) -> None:
        """Read one word of each survivor (CrossMemoryError where the kernel refuses)."""
        for peer in peers.values():
            self.readers[0].probe(peer)

    def units(self, peers: dict[int, Peer], stripes: np.ndarray) -> dict[int, torch.Tensor]:
        """Each survivor's units of `stripes` (ascending), by group position."""
        base = self.store.layout.base
        return dict(self._each_reader(
            list(peers.items()),
            lambda reader, s, peer: (s - base, reader.units(peer, s - base, stripes))))

    def pieces(self, p0: int, p1: int) -> list[tuple[int, int]]:
        """Periods [p0, p1) in runs of about PIECE_BYTES of units."""
        L = self.store.layout
        step = max(1, PIECE_BYTES // (L.g * self.store.words.width * 4))
        return [(a, min(p1, a + step)) for a in range(p0, p1, step)]

    def xor_into_rows(self, p0: int, p1: int, peers: dict[int, Peer]) -> None:
        """r = 1: this rank's units of periods [p0, p1) are the XOR of its survivors' units of
        the same stripes; written straight into its rows and parity, slot by slot and row tensor
        by row tensor (no unit buffer, no second pass). The caller holds the store's lock."""
        self._each_reader(self.pieces(p0, p1),
                          lambda reader, a, b: self._xor_piece(reader, a, b, peers))

    def period_units(self, p0: int, p1: int, peers: dict[int, Peer]) -> dict[int, torch.Tensor]:
        """Each survivor's units of periods [p0, p1) in stripe order ((n g, W) each, buffers
        reused by the next call), by group position: what it would have sent."""
        st, L = self.store, self.store.layout
        n, W = p1 - p0, st.words.width
        out = {}
        for i, (s, peer) in enumerate(peers.items()):
            pos = s - L.base
            words, parity = self.readers[0].span(peer, pos, p0, p1)
            buf = self._buffer(i, n * L.g * W)
            move_range(L, pos, words, parity, p0 * L.r, p0, buf.view(n, L.g, W), to_units=True)
            out[pos] = buf
        return out

    def close(self) -> None:
        """End the threads and drop the scratch buffers. Local; safe twice."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for reader in self.readers:
            reader.release()
        self._buffers.clear()

    def _xor_piece(self, reader: PeerReader, p0: int, p1: int, peers: dict[int, Peer]) -> None:
        st, L = self.store, self.store.layout
        n = p1 - p0
        spans = [(s - L.base, *reader.span(peer, s - L.base, p0, p1))
                 for s, peer in peers.items()]
        for o in range(L.g):
            for seg in segments(st.words.widths):
                dest, real = slot_view(L, st.pos, st.words, st.parity, 0, o, p0, n, seg)
                if real:
                    xor_views(dest, [slot_view(L, pos, words, parity, p0 * L.r, o, p0, n,
                                               seg)[0][:real]
                                     for pos, words, parity in spans])

    def _each_reader(self, jobs: list[tuple], work) -> list:
        """work(reader, *job) for every job, reader i taking jobs i, i + n, ... in order on a
        thread of its own (a reader's scratch serves one job at a time); results in job order."""
        n = len(self.readers)
        if n == 1 or len(jobs) <= 1:
            return [work(self.readers[0], *job) for job in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="mpickpt-rebuild")
        futures = [self._pool.submit(lambda i: [work(self.readers[i], *job)
                                                for job in jobs[i::n]], i) for i in range(n)]
        wait(futures)  # all of them, also when one failed: none may write on after we return
        out: list = [None] * len(jobs)
        for i, f in enumerate(futures):
            out[i::n] = f.result()
        return out

    def _buffer(self, i: int, words: int) -> torch.Tensor:
        buf = self._buffers.get(i)
        if buf is None or buf.numel() < words:
            buf = self._buffers[i] = torch.empty(words, dtype=torch.int32)
        return buf[:words].view(-1, self.store.words.width)
