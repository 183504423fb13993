"""The lost rank's side of a rebuild that reads its survivors' memory (`peer_rows`): units for
degraded reads, and whole periods XORed straight into its own rows (r = 1) or gathered per
survivor for the decoder (r >= 2). The work is split into pieces whose reads fill about
READER_SCRATCH_BYTES of scratch, taken one at a time by up to MAX_THREADS threads, each with a
`PeerReader` of its own (the reads and the XOR kernel release the GIL; a piece's XOR is one call
of the kernel, by addresses checked against the buffers). Local: nothing here talks to other
ranks."""
from __future__ import annotations

import itertools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from mpickpt.parity.peer_rows import Peer, PeerReader, fault_in
from mpickpt.parity.period_slots import move_range, rows_at, segments, slot_extent, slot_view
from mpickpt.parity.shared_rows import PeerMaps, SharedRows
from mpickpt.parity.xor_rows import xor_many, xor_many_built, xor_views

READER_SCRATCH_BYTES = 12 << 20
"""What one reader thread holds for a piece: each survivor's rows (k per period, at their row
strides) and parity rows (r per period) of the piece's periods. A piece is as many periods as
fill it (~4 MB of units at k = 3, r = 1), whatever the group's shape; `reserve` faults it in."""
MAX_THREADS = 4
"""Threads a lost rank reads and XORs with (at most its cores)."""


class MemoryReads:
    """Reads and decodes of one lost rank. Local; `close` ends its threads."""

    def __init__(self, store, place=None, threads: int | None = None):
        """`place`: called on each of its threads when it starts (their cores: the whole share
        under a core split, `mpickpt.engine.core_split`). `threads`: how many (default: the
        calling thread's cores, at most MAX_THREADS)."""
        self.store, self._place = store, place
        threads = min(MAX_THREADS, threads or len(os.sched_getaffinity(0)))
        self.maps = PeerMaps() if SharedRows.supported() else None
        """The survivors' shared buffers this rank maps in a rebuild (`shared_rows`)."""
        self.readers = [PeerReader(store, self.maps) for _ in range(threads)]
        self._pool: ThreadPoolExecutor | None = None
        self._sweeper: ThreadPoolExecutor | None = None
        self._cancel = threading.Event()
        self._mapper: ThreadPoolExecutor | None = None
        self._premap: Future | None = None
        self._premapped: dict[int, Peer] | None = None
        self._kept = False
        """The maps were made ahead (`premap(keep=True)`): a rebuild's end keeps them."""
        self._buffers: dict[int, torch.Tensor] = {}
        self._releaser: threading.Thread | None = None
        """The thread of a release `close(wait=False)` began."""
        self.reserved = 0
        """Bytes of scratch faulted in ahead by `reserve` (kept by `close`)."""

    def reserve(self) -> int:
        """Fault in the scratch of a whole piece of this rank's layout now, before any failure,
        so that a rebuild's first round does not pay for fresh pages (survivors' row strides
        are taken to be this rank's: a wider one grows its buffer then): every reader's spans
        for r = 1, where they all read; for r >= 2, where the first reader reads the spans of
        the gathered units, its spans and the unit buffers. Returns the bytes held. Local."""
        self._released()
        st, L = self.store, self.store.layout
        periods = self._piece_periods()
        sizes = {(slot, part): nbytes for slot in range(L.g - 1)
                 for part, nbytes in self._span_bytes(periods).items()}
        readers = self.readers if L.r == 1 else self.readers[:1]
        self.reserved = sum(reader.reserve(sizes) for reader in readers)
        if L.r > 1:
            for slot in range(L.g - 1):
                buf = self._buffer(slot, periods * L.g * st.words.width)
                fault_in(buf.numpy())
                self.reserved += buf.numel() * 4
        return self.reserved

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.readers)

    @property
    def bytes_mapped(self) -> int:
        """Of `bytes_read`, those read in the survivors' mapped buffers."""
        return sum(r.bytes_mapped for r in self.readers)

    def premap(self, peers: dict[int, Peer], keep: bool = False) -> None:
        """Begin mapping the group members' shared buffers `peers` (by world rank, as they
        were published: `ParityGuard.encode`) on a thread of its own, so that their page tables
        (~10 ms for 69 MB on the VM) are not built in a rebuild's first round: ahead (`keep`:
        when parity is encoded; these maps outlive rebuilds, until `drop_maps` or the next
        such call), or while this lost rank waits in its step's first exchanges. Nothing new
        begins while one is under way or where an earlier one mapped `peers` as published
        alike. A buffer that cannot be mapped is left to the probe; a round reads what the
        survivors publish then, so a stale map is never read. `premapped` says which were
        mapped. Local."""
        self._released()
        if self.maps is None:
            return
        if keep:
            self.drop_maps()
        elif self._premap is not None or self._covers(peers):
            return
        if self._mapper is None:
            self._mapper = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-map",
                                              initializer=self._place)
        reader = self.readers[0]

        def map_all():
            mapped = {}
            for s, peer in peers.items():
                try:
                    reader.map_peer(peer, s - self.store.layout.base)
                    mapped[s] = peer
                except (OSError, ValueError):  # a PeerMapError too: the probe maps or copies it
                    pass
            return mapped

        self._premapped, self._kept = None, keep or self._kept  # those made ahead stay
        self._premap = self._mapper.submit(map_all)

    def _covers(self, peers: dict[int, Peer]) -> bool:
        done = self._end_premap() or {}
        return all(done.get(s) == peer for s, peer in peers.items())

    def drop_maps(self) -> None:
        """Unmap every buffer mapped so far, ahead or not (the memory of a member that left
        lives on while a map of it does). Local."""
        self._released()
        self._end_premap()
        self._premapped, self._kept = None, False
        if self.maps is not None:
            self.maps.close()

    def premapped(self) -> dict[int, Peer] | None:
        """The members `premap` mapped, by world rank, as published then, once it is done
        (waited for here): None where none began. Local."""
        self._released()
        return self._end_premap()

    def admit(self, peers: dict[int, Peer]) -> None:
        """Read `peers` in their maps from now on, as `probe` would have decided: every rank
        agreed that `premap` mapped them as they publish their buffers now. Local."""
        self._released()
        self.maps.mapped.update(peer.pid for peer in peers.values())

    def probe(self, peers: dict[int, Peer]) -> None:
        """Map each survivor's shared buffers, or read one word of it where they are not
        (CrossMemoryError where the kernel refuses that too)."""
        self._released()
        self._end_premap()
        for s, peer in peers.items():
            self.readers[0].probe(peer, s - self.store.layout.base)

    def _end_premap(self) -> dict[int, Peer] | None:
        if self._premap is not None:
            try:
                self._premapped = self._premap.result()
            except Exception:  # noqa: BLE001 - nothing mapped to rely on: the probe decides
                self._premapped = None
            self._premap = None
        return self._premapped

    def units(self, peers: dict[int, Peer], stripes: np.ndarray) -> dict[int, torch.Tensor]:
        """Each survivor's units of `stripes` (ascending), by group position."""
        self._released()
        return dict(got for _, got in self._each_reader(
            list(peers.items()),
            lambda reader, s, peer: self._read_units(reader, s, peer, stripes)))

    def _read_units(self, reader: PeerReader, s: int, peer: Peer, stripes: np.ndarray
                    ) -> tuple[int, torch.Tensor]:
        """(group position, units of `stripes`) of survivor `s`, read by `reader`."""
        pos = s - self.store.layout.base
        return pos, reader.units(peer, pos, stripes)

    def pieces(self, p0: int, p1: int) -> list[tuple[int, int]]:
        """Periods [p0, p1) in pieces of `_piece_periods`."""
        step = self._piece_periods()
        return [(a, min(p1, a + step)) for a in range(p0, p1, step)]

    def _piece_periods(self) -> int:
        """Periods whose reads of the g - 1 survivors fill READER_SCRATCH_BYTES."""
        per_period = (self.store.layout.g - 1) * sum(self._span_bytes(1).values())
        return max(1, READER_SCRATCH_BYTES // per_period)

    def _span_bytes(self, periods: int) -> dict:
        """Scratch bytes of one survivor's span of `periods` periods (`PeerReader.span`'s
        buffers): k rows per period of each row tensor, at this rank's row strides (its rows'
        widths where it publishes none), and r parity rows."""
        st, L = self.store, self.store.layout
        memory = st.words.memory()
        strides = [stride for _, stride, _ in memory] if memory else \
            [4 * w for w in st.words.widths]
        sizes = {i: periods * L.k * stride for i, stride in enumerate(strides)}
        sizes["parity"] = periods * L.r * st.words.width * 4
        return sizes

    def pull(self, p0: int, p1: int, peers: dict[int, Peer],
             stripes: np.ndarray | None = None) -> tuple[dict[int, torch.Tensor], float]:
        """r = 1, one pass of the reader threads. This rank's units of periods [p0, p1) are the
        XOR of its survivors' units of the same stripes: written straight into its rows and
        parity, slot by slot and row tensor by row tensor (no unit buffer, no second pass).
        Beside them, the same threads read each survivor's units of the degraded `stripes`
        (ascending; none where None), returned by group position for the caller to decode.
        Also returns the seconds the periods took (the longest of the readers' own times on
        them), the cost the next chunk is sized by. The caller holds the store's lock."""
        self._released()
        if self.store.layout.r != 1:
            raise ValueError(f"pull decodes r = 1 by XOR, this group has r = "
                             f"{self.store.layout.r}: use units and period_units")
        jobs = [("units", s, peer) for s, peer in peers.items()] if stripes is not None else []
        jobs += [("xor", a, b) for a, b in self.pieces(p0, p1)]
        here = rows_at(self.store.words, self.store.parity) \
            if p1 > p0 and xor_many_built() else None  # this rank's memory, once for the pieces

        def work(reader, kind, a, b):
            start = time.perf_counter()
            if kind == "units":
                got = self._read_units(reader, a, b, stripes)
            else:
                got = self._xor_piece(reader, a, b, peers, here)
            return kind, got, time.perf_counter() - start

        done = self._each_reader(jobs, work)
        units = dict(got for _, (kind, got, _) in done if kind == "units")
        per_reader = [0.0] * len(self.readers)  # a reader ran its jobs one after another
        for i, (kind, _, took) in done:
            per_reader[i] += took if kind == "xor" else 0.0
        return units, max(per_reader)

    def pull_behind(self, p0: int, p1: int, peers: dict[int, Peer], lock) -> Future:
        """`pull` of periods [p0, p1) (no degraded units) on a thread of its own, holding `lock`
        (the store's) while it writes, so that the caller goes on with its step meanwhile. The
        future gives the sweep's seconds; the caller must let nothing change the group's rows
        or parity until it has waited for it. Local."""
        self._released()
        if self._sweeper is None:
            self._sweeper = ThreadPoolExecutor(1, thread_name_prefix="mpickpt-sweep",
                                               initializer=self._place)
        self._cancel.clear()

        def sweep() -> float | None:
            while not lock.acquire(timeout=0.05):  # `close` under the lock cancels it
                if self._cancel.is_set():
                    return None
            try:
                return self.pull(p0, p1, peers)[1]
            finally:
                lock.release()

        return self._sweeper.submit(sweep)

    def period_units(self, p0: int, p1: int, peers: dict[int, Peer]) -> dict[int, torch.Tensor]:
        """Each survivor's units of periods [p0, p1) in stripe order ((n g, W) each, buffers
        reused by the next call), by group position: what it would have sent."""
        self._released()
        st, L = self.store, self.store.layout
        n, W = p1 - p0, st.words.width
        out = {}
        for i, (s, peer) in enumerate(peers.items()):
            pos = s - L.base
            words, parity = self.readers[0].span(peer, pos, p0, p1, i)
            buf = self._buffer(i, n * L.g * W)
            move_range(L, pos, words, parity, p0 * L.r, p0, buf.view(n, L.g, W), to_units=True)
            out[pos] = buf
        return out

    def close(self, wait: bool = True) -> None:
        """End the threads, unmap the survivors' buffers and drop the scratch buffers, but
        those `reserve` faulted in (a rebuild that follows reuses them). Waits for a sweep
        `pull_behind` began, which gives up if it has not taken the lock yet (a caller may hold
        it). `wait` False: all that on a thread of its own (unmapping and ending threads take a
        few ms that a rebuild's last round need not wait for; nothing is read by then), which
        every later use of these reads waits for first. Local; safe twice."""
        self._released()
        if not wait:
            self._releaser = threading.Thread(target=self._release, daemon=True,
                                              name="mpickpt-release")
            self._releaser.start()
            return
        self._release()

    def _released(self) -> None:
        """Wait for a release `close(wait=False)` began."""
        releaser = self._releaser
        if releaser is not None and releaser is not threading.current_thread():
            releaser.join()
            self._releaser = None

    def _release(self) -> None:
        if self._sweeper is not None:
            self._cancel.set()  # a sweep still waiting for the lock gives up
            self._sweeper.shutdown(wait=True)
            self._sweeper = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._end_premap()
        if self._mapper is not None:
            self._mapper.shutdown(wait=True)
            self._mapper = None
        for reader in self.readers:
            reader.release()
        if self.maps is not None and self._kept:  # mapped ahead: kept for the next loss
            self.maps.mapped.clear()  # which admits them again
        elif self.maps is not None:
            self._premapped = None
            self.maps.close()
        if not self.reserved:  # r >= 2 reserves its unit buffers too
            self._buffers.clear()

    def _xor_piece(self, reader: PeerReader, p0: int, p1: int, peers: dict[int, Peer],
                   here) -> None:
        """XOR the survivors' units of periods [p0, p1) into this rank's: in one kernel call by
        address where `here` (this rank's `RowsAt`, None without the batch kernel) and the
        spans read allow it, else slot by slot."""
        st, L = self.store, self.store.layout
        n = p1 - p0
        spans = [(s - L.base, *reader.span(peer, s - L.base, p0, p1, slot))
                 for slot, (s, peer) in enumerate(peers.items())]
        there = [rows_at(words, parity, p0 * L.r) for _, words, parity in spans] \
            if here is not None else [None]
        if None not in there:  # one kernel call for the whole piece
            jobs = []
            for o in range(L.g):
                for seg in segments(st.words.widths):
                    sources = [slot_extent(L, pos, at, o, p0, n, seg)
                               for (pos, _, _), at in zip(spans, there)]
                    jobs.append((slot_extent(L, st.pos, here, o, p0, n, seg), 4 * seg[1], sources))
            xor_many(jobs)
            return
        for o in range(L.g):
            for seg in segments(st.words.widths):
                dest, real = slot_view(L, st.pos, st.words, st.parity, 0, o, p0, n, seg)
                if real:
                    xor_views(dest, [slot_view(L, pos, words, parity, p0 * L.r, o, p0, n,
                                               seg)[0][:real]
                                     for pos, words, parity in spans])

    def _each_reader(self, jobs: list[tuple], work) -> list[tuple[int, object]]:
        """work(reader, *job) for every job, each reader on a thread of its own taking the next
        job not taken yet (a reader's scratch serves one job at a time), until none is left or
        a job failed (a thread may still begin one job after that); (reader index, result) in
        job order. Waits for every thread, also when one failed: none may write on after this
        returns, which then raises the failure of the lowest reader that had one."""
        n = len(self.readers)
        if n == 1 or len(jobs) <= 1:
            return [(0, work(self.readers[0], *job)) for job in jobs]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(n, thread_name_prefix="mpickpt-rebuild",
                                            initializer=self._place)
        taken, failed = itertools.count(), threading.Event()
        out: list = [None] * len(jobs)

        def run(i):
            while not failed.is_set() and (j := next(taken)) < len(jobs):
                try:
                    out[j] = (i, work(self.readers[i], *jobs[j]))
                except BaseException:
                    failed.set()
                    raise

        futures = [self._pool.submit(run, i) for i in range(n)]
        wait(futures)
        for f in futures:
            f.result()  # once every thread is over
        return out

    def _buffer(self, i: int, words: int) -> torch.Tensor:
        buf = self._buffers.get(i)
        if buf is None or buf.numel() < words:
            buf = self._buffers[i] = torch.empty(words, dtype=torch.int32)
        return buf[:words].view(-1, self.store.words.width)
