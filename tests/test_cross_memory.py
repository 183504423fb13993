"""Reads of another process's memory (process_vm_readv) as a parity rebuild uses them: spans, rows
by iovec or through their span, a survivor's units and periods, the errors of a dead peer or an
unmapped address; and the strided XOR that decodes r = 1 from what was read."""
import errno
import multiprocessing as mp
import os
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mpickpt.parity import cross_memory, peer_rows
from mpickpt.parity.layout import GroupLayout
from mpickpt.parity.peer_rows import Peer, PeerReader
from mpickpt.parity.xor_rows import xor_many, xor_many_built, xor_views

pytestmark = pytest.mark.skipif(not cross_memory.available(), reason="no process_vm_readv")

ROWS, DIM = 5000, 16
LAYOUT = GroupLayout(3, 1, 0, (ROWS, ROWS, ROWS - 7, ROWS))
RS = GroupLayout(2, 2, 0, (ROWS, ROWS, ROWS - 7, ROWS))  # r = 2: parity rows run backwards


def _arrays(seed):
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((ROWS, DIM)).astype(np.float32)
    state = rng.random(ROWS).astype(np.float32)
    parity = rng.integers(-2**31, 2**31, (RS.parity_rows, DIM + 1)).astype(np.int32)
    return weight, state, parity


def _hold(seed, conn):
    """The peer: holds its arrays, publishes where they are, waits to be told to go."""
    weight, state, parity = _arrays(seed)
    conn.send((os.getpid(), cross_memory.host_key(), weight.ctypes.data, state.ctypes.data,
               parity.ctypes.data))
    conn.recv()


@pytest.fixture(scope="module")
def peer():
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_hold, args=(11, there), daemon=True)
    proc.start()
    pid, key, w, s, p = here.recv()
    yield SimpleNamespace(pid=pid, key=key, weight=w, state=s, parity=p, arrays=_arrays(11))
    here.send("go")
    proc.join(10)


def _hold_shared(seed, conn):
    """A peer whose arrays live in shared memory (`SharedRows`), as a training rank's do: it
    publishes their addresses and (descriptor, offset), and waits to be told to go."""
    from mpickpt.parity.shared_rows import SharedRows

    shared = SharedRows()
    tensors = [torch.from_numpy(a.copy()) for a in _arrays(seed)]
    assert all(shared.adopt(t) for t in tensors)
    conn.send((os.getpid(), cross_memory.host_key(), [t.data_ptr() for t in tensors],
               [shared.locate(t) for t in tensors]))
    conn.recv()


@pytest.fixture(scope="module")
def shared_peer():
    ctx = mp.get_context("spawn")  # the peer uses torch: no fork of this process's threads
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_hold_shared, args=(11, there), daemon=True)
    proc.start()
    pid, key, (w, s, p), at = here.recv()
    yield SimpleNamespace(pid=pid, key=key, weight=w, state=s, parity=p, at=at,
                          arrays=_arrays(11))
    here.send("go")
    proc.join(10)


def _mapped_peer(p, at=None):
    """The shared peer as a round publishes it: its buffers offered to be mapped (`at`:
    (descriptor, offset) of weight, state and parity, else the peer's own)."""
    (wfd, wo), (sfd, so), (pfd, po) = at or p.at
    return Peer(p.key, p.pid, True, True, p.parity, (pfd, po),
                ((p.weight, DIM * 4, wfd, wo), (p.state, 4, sfd, so)))


def _reader(layout=LAYOUT):
    words = SimpleNamespace(widths=[DIM, 1], width=DIM + 1)
    return PeerReader(SimpleNamespace(layout=layout, words=words))


def _peer(p):
    return Peer(p.key, p.pid, True, True, p.parity, (-1, 0),
                ((p.weight, DIM * 4, -1, 0), (p.state, 4, -1, 0)))


def _units(arrays, pos, stripes, layout=LAYOUT):
    weight, state, parity = arrays
    out = np.zeros((len(stripes), DIM + 1), dtype=np.int32)
    rows = layout.row_of_stripe(pos, stripes)
    d = rows >= 0
    out[d, :DIM] = weight[rows[d]].view(np.int32)
    out[d, DIM] = state[rows[d]].view(np.int32)
    prow = layout.parity_row(pos, stripes)
    out[prow >= 0] = parity[prow[prow >= 0]]
    return out


def test_spans_and_rows_of_a_peer(peer):
    weight, state, _ = peer.arrays
    assert peer.key == cross_memory.host_key() != 0
    out = np.empty((100, DIM), dtype=np.float32)
    cross_memory.read_span(peer.pid, peer.weight + 40 * DIM * 4, out)
    assert np.array_equal(out, weight[40:140])
    rows = np.sort(np.random.default_rng(0).choice(ROWS, 3 * cross_memory.IOV_MAX + 5,
                                                   replace=False))
    got = np.empty((len(rows), DIM), dtype=np.float32)
    cross_memory.read_rows(peer.pid, peer.weight, DIM * 4, rows, got)
    assert np.array_equal(got, weight[rows])
    one = np.empty((len(rows), 1), dtype=np.float32)
    cross_memory.read_rows(peer.pid, peer.state, 4, rows, one)
    assert np.array_equal(one[:, 0], state[rows])


@pytest.mark.parametrize("by", ["iovec", "span"])
def test_a_survivors_units_and_periods(peer, by, monkeypatch):
    # iovec: a row read costs nothing, so every array goes by rows; span: spans cost nothing
    monkeypatch.setattr(peer_rows, "IOVEC_S", 0.0 if by == "iovec" else 1.0)
    reader = _reader()
    stripes = np.sort(np.random.default_rng(1).choice(LAYOUT.stripes, 700, replace=False))
    for pos in (0, 2):  # position 2 has fewer rows: padding reads as zeros
        got = reader.units(_peer(peer), pos, stripes).numpy()
        assert np.array_equal(got, _units(peer.arrays, pos, stripes)), pos
    words, parity = reader.span(_peer(peer), 2, 400, LAYOUT.periods)
    units = torch.zeros(LAYOUT.periods - 400, LAYOUT.g, DIM + 1, dtype=torch.int32)
    for j, o in enumerate(LAYOUT.data_offsets(2)):
        first = 400 * 3 + j
        n = min(len(units), max(0, -(-(LAYOUT.rows[2] - first) // 3)))
        words.read_every(first, 3, units[:n, o])
    units[:, (2 - 0) % LAYOUT.g] = parity
    want = _units(peer.arrays, 2, np.arange(400 * LAYOUT.g, LAYOUT.stripes))
    assert np.array_equal(units.view(-1, DIM + 1).numpy(), want)
    assert reader.bytes_read > 0


@pytest.mark.parametrize("by", ["iovec", "span"])
def test_reed_solomon_parity_rows_out_of_order(peer, by, monkeypatch):
    """r = 2: a holder's parity rows of the stripes of one period run backwards (stripes 4 and 5
    of position 1 are its parity rows 3 and 2); every stripe of a run of periods, read both ways."""
    monkeypatch.setattr(peer_rows, "IOVEC_S", 0.0 if by == "iovec" else 1.0)
    assert list(RS.parity_row(1, np.array([4, 5]))) == [3, 2]
    stripes = np.concatenate([np.arange(4, 6), np.arange(8, 40), [RS.stripes - 1]])
    for pos in (1, 2):
        got = _reader(RS).units(_peer(peer), pos, stripes).numpy()
        assert np.array_equal(got, _units(peer.arrays, pos, stripes, RS)), pos


def test_a_dead_peer_and_an_unmapped_address_fail_clearly(peer):
    with pytest.raises(cross_memory.CrossMemoryError, match="EFAULT") as e:
        cross_memory.read_span(peer.pid, 8, np.empty(4, dtype=np.int32), "parity rows")
    assert e.value.errno == errno.EFAULT and "parity rows" in str(e.value)
    proc = mp.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join(10)
    with pytest.raises(cross_memory.CrossMemoryError, match="ESRCH") as e:
        cross_memory.read_span(proc.pid, peer.weight, np.empty(4, dtype=np.int32))
    assert isinstance(e.value, RuntimeError)  # what survivors treat as a peer's death
    with pytest.raises(ValueError, match="C-contiguous output of 3 equal rows"):
        cross_memory.read_rows(peer.pid, peer.weight, 64, np.arange(3), np.empty((2, 16)))


@pytest.mark.parametrize("kernel", [True, False], ids=["C", "torch"])
def test_xor_views_of_strided_rows(kernel):
    rng = np.random.default_rng(2)
    big = torch.from_numpy(rng.integers(-2**31, 2**31, (900, 20)).astype(np.int32))
    dest_base = torch.zeros(300, 40, dtype=torch.int32)
    dest = dest_base[::3, 5:22]  # (100, 17), rows 3 * 40 words apart
    sources = [big[0:300:3, :17], big[1:180:2, 3:20], big[600:600, :17], big[700:800, 2:19]]
    xor_views(dest, sources, kernel=kernel)
    want = np.zeros((100, 17), dtype=np.int32)
    for s in sources:
        want[:len(s)] ^= s.numpy()
    assert np.array_equal(dest.numpy(), want)
    assert dest_base[1::3].abs().sum() == 0 and dest_base[:, :5].abs().sum() == 0  # nothing else
    state = torch.zeros(50, 1, dtype=torch.int32)
    xor_views(state, [big[:100:2, 7:8], big[:30, 9:10]], kernel=kernel)
    assert np.array_equal(state[:30, 0].numpy(), (big[:60:2, 7] ^ big[:30, 9]).numpy())
    assert np.array_equal(state[30:, 0].numpy(), big[60:100:2, 7].numpy())
    with pytest.raises(ValueError, match="source 0 must be a CPU int32"):
        xor_views(dest, [big[:, :16]], kernel=kernel)
    with pytest.raises(ValueError, match="rows <= 100"):
        xor_views(dest, [big[:101, :17]], kernel=kernel)


@pytest.mark.parametrize("width", [2048, 17], ids=["wide", "narrow"])
@pytest.mark.parametrize("kernel", [True, False], ids=["C", "torch"])
def test_a_reader_never_sees_a_partial_xor(kernel, width):
    """A sweep beside the step rewrites rows the lookup reads with the values they already hold:
    a thread reading them meanwhile must see those values throughout, never a partial XOR (wide
    rows go through the kernel's staging buffer, narrow ones word by word in registers)."""
    rng = np.random.default_rng(5)
    sources = [torch.from_numpy(rng.integers(-2**31, 2**31, (64, width)).astype(np.int32))
               for _ in range(3)]
    final = sources[0] ^ sources[1] ^ sources[2]
    dest = final.clone()
    stop, rewrites = threading.Event(), [0]

    def rewrite():
        while not stop.is_set():
            xor_views(dest, sources, kernel=kernel)
            rewrites[0] += 1

    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        # read until the writer has rewritten many times: narrow rows rewrite in microseconds,
        # and with the GIL's switch interval a fixed count of reads could end before it ran
        seen, deadline = [], time.monotonic() + 20
        while (len(seen) < 3000 or rewrites[0] <= 50) and time.monotonic() < deadline:
            seen.append(not torch.equal(dest, final))
    finally:
        stop.set()
        writer.join()
    assert rewrites[0] > 20 and sum(seen) == 0, (rewrites[0], sum(seen))


@pytest.mark.skipif(not xor_many_built(), reason="the C kernels were not built")
def test_xor_many_does_each_job_in_order():
    """Several strided XORs by address in one call: a source longer than its destination is
    cut to it, a shorter one contributes to its own rows, no source zeroes the rows; a bad
    record is refused before anything is written."""
    from mpickpt._parity_cpu import xor_rows_many

    rng = np.random.default_rng(3)
    big = rng.integers(-2**31, 2**31, (600, 20)).astype(np.int32)
    dest = np.full((200, 20), 7, dtype=np.int32)

    def at(a, row, col=0):
        return a.ctypes.data + (row * a.shape[1] + col) * 4

    jobs = [((at(dest, 0), 160, 50), 64, [(at(big, 0), 80, 80), (at(big, 300, 4), 160, 20)]),
            ((at(dest, 1, 16), 80, 100), 4, [(at(big, 0, 19), 80, 100)]),
            ((at(dest, 150), 80, 10), 8, []),
            ((at(dest, 190), 80, 0), 8, [(at(big, 0), 80, 5)])]  # no rows: nothing
    xor_many(jobs)
    want = np.full((200, 20), 7, dtype=np.int32)
    want[0:100:2, :16] = big[0:50, :16]
    want[0:40:2, :16] ^= big[300:340:2, 4:20]
    want[1:101, 16] = big[0:100, 19]
    want[150:160, :2] = 0
    assert np.array_equal(dest, want)
    with pytest.raises(ValueError, match="record at word 0"):
        xor_rows_many(np.array([at(dest, 0), 80, 1, 4, 2, at(big, 0), 80, 1], np.int64).tobytes())
    with pytest.raises(ValueError, match="record at word 5"):
        xor_rows_many(np.array([at(dest, 0), 80, 1, 4, 0, at(dest, 0), 80, 1, 0, 0],
                               np.int64).tobytes())
    assert np.array_equal(dest, want)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("layout", [LAYOUT, RS, GroupLayout(4, 1, 0, (9, 0, 13, 12, 1))],
                         ids=["k3r1", "k2r2", "k4r1-short"])
def test_slot_extents_are_the_slot_views(layout, padded):
    """`slot_extent` names by address exactly the rows `slot_view` views, for every position,
    offset, row tensor and run of periods of a shard and of a span of it, rows wider apart than
    their words included, and refuses rows outside the memory it was given: past the end of a
    row tensor or of the parity rows, or before a span's first row."""
    from mpickpt.parity.period_slots import rows_at, segments, slot_extent, slot_view
    from mpickpt.parity.row_words import RowWords

    segs = segments([DIM, 1])
    for pos in range(layout.g):
        rows = layout.rows[pos]
        tensors = [torch.zeros(rows, DIM + 5)[:, 2:2 + DIM], torch.zeros(3 * rows)[1::3]] \
            if padded else [torch.zeros(rows, DIM), torch.zeros(rows)]
        parity = torch.zeros((layout.parity_rows, DIM + 1), dtype=torch.int32)
        whole = RowWords.span(tensors, 0)
        a = min(rows, 2 * layout.k)  # a span from period 2 on, as a reader holds it
        part = RowWords.span([t[a:] for t in tensors], a)
        for words, p0, pbase in ((whole, 0, 0), (part, 2, 2 * layout.r)):
            par = parity[pbase:]
            at = rows_at(words, par, pbase)
            for p in sorted({p0, p0 + 1, layout.periods // 2, layout.periods - 1}):
                for n in {1, layout.periods - p}:
                    for o in range(layout.g):
                        for seg in segs:
                            view, real = slot_view(layout, pos, words, par, pbase, o, p, n, seg)
                            address, stride, got = slot_extent(layout, pos, at, o, p, n, seg)
                            assert got == real == len(view)
                            if real:  # (one row's stride is anything)
                                assert address == view.data_ptr()
                                assert real == 1 or stride == view.stride(0) * 4
                            # and both are the rows the layout maps these stripes to
                            stripes = np.arange(p, p + n) * layout.g + o
                            prow = layout.parity_row(pos, stripes)
                            if (prow >= 0).all():
                                want = par.data_ptr() + 4 * seg[0] + \
                                    (prow - pbase) * (DIM + 1) * 4
                            else:
                                row = layout.row_of_stripe(pos, stripes)
                                row = row[row >= 0] - words.base
                                t = words.tensors[seg[2]]
                                want = t.data_ptr() + row * t.stride(0) * 4
                            assert len(want) == real
                            assert (address + np.arange(real) * stride == want).all()
        if rows < 2 * layout.k + 1:
            continue
        last = layout.data_offsets(pos)[(rows - 1) % layout.k]  # where the shard's last row is
        short = rows_at(RowWords.span([t[:rows - 1] for t in tensors], 0), parity)
        first = layout.data_offsets(pos)[0]
        for seg in segs:  # the last row lies past a tensor one row short; row 0 before a span
            assert slot_extent(layout, pos, rows_at(whole, parity), last, (rows - 1) // layout.k,
                               1, seg)[2] == 1
            with pytest.raises(ValueError, match="lie outside it"):
                slot_extent(layout, pos, short, last, (rows - 1) // layout.k, 1, seg)
            with pytest.raises(ValueError, match="row -"):
                slot_extent(layout, pos, rows_at(part, parity[2 * layout.r:], 2 * layout.r),
                            first, 0, 1, seg)
    at = rows_at(RowWords.span([torch.zeros(1, DIM), torch.zeros(1)], 0), parity[:-1])
    holds = (1 - layout.r) % layout.g  # where position 0 holds the last parity row of a period
    with pytest.raises(ValueError, match="lie outside it"):  # the last parity row is cut off
        slot_extent(layout, 0, at, holds, layout.periods - 1, 1, segs[0])


def test_no_reader_thread_writes_on_after_one_failed():
    """A failed read (a survivor died) propagates only once every other reader's job is over:
    none may go on writing rows after the caller released the store's lock."""
    import threading
    import time

    from mpickpt.parity.memory_reads import MemoryReads

    words = SimpleNamespace(widths=[DIM, 1], width=DIM + 1)
    reads = MemoryReads(SimpleNamespace(layout=LAYOUT, words=words))
    reads.readers = [_reader(), _reader()]  # one core or more: two threads
    started, done, ran = threading.Event(), threading.Event(), []

    def work(reader, job):
        ran.append(job)
        if job == 0:
            assert started.wait(5)  # the other thread is inside job 1
            raise cross_memory.CrossMemoryError(1, errno.ESRCH, "rows")
        started.set()
        time.sleep(0.3)
        done.set()

    with pytest.raises(cross_memory.CrossMemoryError, match="ESRCH"):
        reads._each_reader([(0,), (1,), (2,)], work)
    assert done.is_set() and {0, 1} <= set(ran)
    reads.close()
    assert all(not r._scratch for r in reads.readers) and reads._pool is None


def test_readers_take_the_next_job_not_taken():
    """Jobs go to whichever reader is free (a slow job does not hold back the ones dealt after
    it), each exactly once; results come back in job order with the reader that ran them."""
    import time

    from mpickpt.parity.memory_reads import MemoryReads

    import threading

    words = SimpleNamespace(widths=[DIM, 1], width=DIM + 1)
    placed = set()  # `place` (a core split's widening) runs on each pool thread as it starts
    reads = MemoryReads(SimpleNamespace(layout=LAYOUT, words=words),
                        place=lambda: placed.add(threading.get_ident()))
    reads.readers = [_reader(), _reader()]
    ran_on = set()

    def work(reader, job):
        ran_on.add(threading.get_ident())
        time.sleep(0.4 if job == 0 else 0.01)
        return job * 10, reads.readers.index(reader)

    out = reads._each_reader([(j,) for j in range(9)], work)
    reads.close()
    assert placed == ran_on and len(placed) == 2 and threading.get_ident() not in placed
    assert [got for _, (got, _) in out] == [j * 10 for j in range(9)]
    assert all(i == ran_on for i, (_, ran_on) in out)
    slow = out[0][0]
    assert [i for i, _ in out].count(slow) == 1  # the other reader took all 8 short jobs


def test_reserved_scratch_serves_whole_pieces_and_outlives_close(peer, monkeypatch):
    """`MemoryReads.reserve` faults in each reader's buffers for a whole piece of every survivor
    slot before any failure: the reads of a piece then allocate nothing, and a rebuild's end
    keeps them for the next one. `pull` reads each survivor's degraded units on the same
    threads as the periods."""
    from mpickpt.parity import memory_reads
    from mpickpt.parity.memory_reads import MemoryReads

    monkeypatch.setattr(memory_reads, "READER_SCRATCH_BYTES", 3 << 16)  # pieces shorter than the shard
    monkeypatch.setattr(peer_rows, "IOVEC_S", 1.0)  # degraded units by span: row buffers
    words = SimpleNamespace(widths=[DIM, 1], width=DIM + 1,
                            memory=lambda: [(0, DIM * 4, DIM * 4), (0, 4, 4)])
    reads = MemoryReads(SimpleNamespace(layout=LAYOUT, words=words))
    held = reads.reserve()
    a, b = reads.pieces(0, LAYOUT.periods)[1]
    n = b - a
    per_slot = n * LAYOUT.k * (DIM * 4 + 4) + n * LAYOUT.r * (DIM + 1) * 4
    assert held == reads.reserved == len(reads.readers) * (LAYOUT.g - 1) * per_slot
    kept = {id(buf) for r in reads.readers for buf in r._scratch.values()}
    for reader in reads.readers:
        for slot, pos in enumerate((0, 1, 3)):
            words_, parity = reader.span(_peer(peer), pos, a, b, slot)
            assert np.array_equal(parity.numpy(), peer.arrays[2][a:b])
    assert {id(buf) for r in reads.readers for buf in r._scratch.values()} == kept

    stripes = np.sort(np.random.default_rng(4).choice(LAYOUT.stripes, 300, replace=False))
    units, seconds = reads.pull(0, 0, {0: _peer(peer), 2: _peer(peer)}, stripes)
    assert seconds == 0.0 and sorted(units) == [0, 2]
    for pos in (0, 2):
        assert np.array_equal(units[pos].numpy(), _units(peer.arrays, pos, stripes)), pos
    assert kept < {id(buf) for r in reads.readers for buf in r._scratch.values()}  # + rows'
    reads.close()  # the reserved buffers stay, the others go
    assert reads._pool is None
    assert {id(buf) for r in reads.readers for buf in r._scratch.values()} == kept


def _resident_pages(buf: np.ndarray) -> tuple[int, int]:
    """(pages of `buf` in memory, pages it spans), by mincore(2)."""
    import ctypes

    page = os.sysconf("SC_PAGE_SIZE")
    start = buf.ctypes.data // page * page
    pages = -(-(buf.ctypes.data + buf.nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(ctypes.c_void_p(start), pages * page, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def test_reserve_faults_every_page_in():
    """A buffer larger than malloc's largest mmap threshold (32 MB) is fresh from the kernel:
    untouched, its pages are not resident; reserved, all of them are."""
    reader = _reader()
    fresh = np.empty(40 << 20, dtype=np.uint8)
    assert _resident_pages(fresh)[0] < _resident_pages(fresh)[1] // 2  # the check can fail
    del fresh
    held = reader.reserve({("slot", 0): 40 << 20})
    resident, pages = _resident_pages(reader._scratch[("slot", 0)])
    assert held == 40 << 20 and resident == pages


def _lost_rank(pos=2):
    """A lost rank at group position `pos` of LAYOUT: its rows and parity all NaN."""
    from mpickpt.parity.row_words import RowWords

    weight = torch.full((LAYOUT.rows[pos], DIM), float("nan"))
    state = torch.full((LAYOUT.rows[pos],), float("nan"))
    parity = torch.full((LAYOUT.parity_rows, DIM + 1), 0x7FC00000, dtype=torch.int32)
    return SimpleNamespace(layout=LAYOUT, words=RowWords.span([weight, state], 0), parity=parity,
                           pos=pos)


@pytest.mark.parametrize("by", ["iovec", "span"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("xor", ["one call", "per slot"])
@pytest.mark.parametrize("lost", [2, 0], ids=["middle", "tail"])
def test_one_pass_xors_the_periods_and_reads_the_degraded_units(peer, monkeypatch, by, threads,
                                                                xor, lost):
    """`pull` on 1 or 3 reader threads: the chunk's periods are the XOR of the survivors'
    units, written into this rank's rows and parity and nowhere else, and the degraded units
    it returns beside them are the survivors' own; a second rebuild on the same readers after
    `close` does the same on the reserved scratch. A piece's XOR is one call of the kernel by
    address, or (without its batch entry) one per slot and row tensor. The chunk is in the
    middle of the short position 2's rows, or (position 0 lost) the last periods, where
    survivor 2's rows end before the others'."""
    from mpickpt.parity import memory_reads
    from mpickpt.parity.memory_reads import MemoryReads

    if xor == "one call" and not xor_many_built():
        pytest.skip("the C kernels were not built")
    monkeypatch.setattr(memory_reads, "xor_many_built", lambda: xor == "one call")
    calls = {"one call": 0, "per slot": 0}

    def counted(kind, real):
        return lambda *a: (calls.__setitem__(kind, calls[kind] + 1), real(*a))[1]

    monkeypatch.setattr(memory_reads, "xor_many", counted("one call", memory_reads.xor_many))
    monkeypatch.setattr(memory_reads, "xor_views", counted("per slot", memory_reads.xor_views))
    monkeypatch.setattr(memory_reads, "READER_SCRATCH_BYTES", 3 << 16)  # several pieces
    monkeypatch.setattr(peer_rows, "IOVEC_S", 0.0 if by == "iovec" else 1.0)
    st = _lost_rank(lost)
    reads = MemoryReads(st)
    reads.readers = [PeerReader(st) for _ in range(threads)]
    reads.reserve()
    p0, p1 = (100, 1300) if lost == 2 else (LAYOUT.periods - 300, LAYOUT.periods)
    chunk = np.arange(p0 * LAYOUT.g, p1 * LAYOUT.g)
    outside = np.setdiff1d(np.arange(LAYOUT.stripes), chunk)
    stripes = np.sort(np.random.default_rng(5).choice(outside, 500, replace=False))
    survivors = [s for s in range(LAYOUT.g) if s != lost]
    peers = {s: _peer(peer) for s in survivors}  # one process stands for all three survivors
    want = np.zeros((len(chunk), DIM + 1), dtype=np.int32)
    for pos in peers:
        want ^= _units(peer.arrays, pos, chunk)
    rows, prow = LAYOUT.row_of_stripe(lost, chunk), LAYOUT.parity_row(lost, chunk)
    for rebuild in range(2):
        units, seconds = reads.pull(p0, p1, peers, stripes)
        assert seconds > 0 and sorted(units) == survivors
        assert calls[xor] > 0 and sum(calls.values()) == calls[xor]
        for pos in peers:
            assert np.array_equal(units[pos].numpy(), _units(peer.arrays, pos, stripes)), pos
        got = np.zeros_like(want)
        d = rows >= 0
        got[d, :DIM] = st.words.tensors[0][rows[d]].numpy().view(np.int32)
        got[d, DIM] = st.words.tensors[1][rows[d]].numpy().view(np.int32)
        got[prow >= 0] = st.parity[prow[prow >= 0]].numpy()
        assert np.array_equal(got[d | (prow >= 0)], want[d | (prow >= 0)]), rebuild
        untouched = np.ones(LAYOUT.rows[lost], dtype=bool)
        untouched[rows[d]] = False
        assert torch.isnan(st.words.tensors[0][torch.from_numpy(untouched)]).all()
        reads.close()
        assert reads._pool is None
        st.words.tensors[0].fill_(float("nan"))


def test_r2_reserves_the_first_readers_spans_and_the_unit_buffers():
    """r >= 2 gathers units through the first reader only: the others reserve nothing, and the
    unit buffers it fills are reserved and kept by `close`."""
    from mpickpt.parity.memory_reads import MemoryReads

    words = SimpleNamespace(widths=[DIM, 1], width=DIM + 1,
                            memory=lambda: [(0, DIM * 4, DIM * 4), (0, 4, 4)])
    reads = MemoryReads(SimpleNamespace(layout=RS, words=words))
    reads.readers = [_reader(RS), _reader(RS)]
    held = reads.reserve()
    units = sum(b.numel() * 4 for b in reads._buffers.values())
    assert len(reads._buffers) == RS.g - 1 and units > 0
    assert held == sum(len(b) for b in reads.readers[0]._scratch.values()) + units
    assert not reads.readers[1]._scratch
    kept = {i: b.data_ptr() for i, b in reads._buffers.items()}
    reads.close()
    assert {i: b.data_ptr() for i, b in reads._buffers.items()} == kept


@pytest.mark.parametrize("transport,local_size,mapped,reads,reserved", [
    ("auto", 4, False, True, True), ("copy", 4, False, True, True),
    ("auto", 3, False, False, False), ("network", 4, False, False, False),
    ("auto", 4, True, True, False)])
def test_the_guard_reserves_where_a_group_may_read_memory(transport, local_size, mapped, reads,
                                                          reserved):
    """Scratch is held ahead only where a rebuild could copy from the group's memory: not over
    the network, nor on a node with fewer ranks than a group (k + r = 4 here), nor where the
    rows are in shared memory (a lost rank maps its survivors' instead; readers, no scratch)."""
    from mpickpt.parity.guard import ParityConfig, ParityGuard

    st = _lost_rank()
    st.topo = SimpleNamespace(local_size=local_size)
    guard = SimpleNamespace(store=st, config=ParityConfig(k=3, r=1, transport=transport),
                            _place=None, _threads=2, mapped=mapped)
    got = ParityGuard._reserve_reads(guard)
    assert (got is not None, got is not None and got.reserved > 0) == (reads, reserved)


@pytest.mark.parametrize("cores,local_size,threads,free", [
    (16, 4, 1, True), (2, 4, 1, False), (2, 2, 1, False), (4, 2, 1, True), (8, 4, 2, False)])
def test_a_rank_votes_to_sweep_beside_where_its_node_leaves_a_core_free(
        monkeypatch, cores, local_size, threads, free):
    """--rebuild-sweep auto: beside where this rank's share of the node (its affinity over the
    node's ranks) leaves a core beyond its training threads; lookup elsewhere."""
    from mpickpt.engine import free_cores
    from mpickpt.parity.guard import ParityGuard

    monkeypatch.setattr(free_cores, "cores_available", lambda: cores)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    st = _lost_rank()
    guard = SimpleNamespace(store=st, topo=SimpleNamespace(local_size=local_size))
    assert ParityGuard._core_free(guard) == free


def test_a_sweep_beside_the_step_writes_under_the_lock_and_gives_up_when_closed(peer):
    """`pull_behind`: the periods are XORed in on the sweeper's thread only once it holds the
    store's lock (training's thread holds it while it changes rows), its future gives the
    sweep's seconds; `close` by a thread that holds the lock (the recovery path) cancels a
    sweep still waiting for it instead of waiting forever, and nothing was written."""
    from mpickpt.parity.memory_reads import MemoryReads

    st = _lost_rank(2)
    reads = MemoryReads(st)
    peers = {s: _peer(peer) for s in range(LAYOUT.g) if s != 2}
    chunk = np.arange(100 * LAYOUT.g, 200 * LAYOUT.g)
    want = np.zeros((len(chunk), DIM + 1), dtype=np.int32)
    for pos in peers:
        want ^= _units(peer.arrays, pos, chunk)
    rows = LAYOUT.row_of_stripe(2, chunk)
    d = rows >= 0
    weights = st.words.tensors[0]

    def written() -> bool:
        return np.array_equal(weights[rows[d]].numpy().view(np.int32), want[d, :DIM])

    lock = threading.RLock()
    with lock:
        future = reads.pull_behind(100, 200, peers, lock)
        time.sleep(0.2)
        assert not future.done() and torch.isnan(weights[rows[d]]).all()
    assert future.result(timeout=30) > 0 and written()
    weights.fill_(float("nan"))
    with lock:
        future = reads.pull_behind(100, 200, peers, lock)
        reads.close()  # returns: the sweep gave up
        assert future.result(timeout=1) is None
    assert torch.isnan(weights[rows[d]]).all()


# ---- shared row memory, mapped by the lost rank (shared_rows) --------------------------------

def test_adopt_moves_a_tensor_into_shared_memory_in_place():
    """The same tensor object keeps its values in memory a peer can map (`/proc/<pid>/fd/<n>`
    of a memfd named for mpickpt); a view, a part of a larger storage or an empty tensor stays
    where it is."""
    from mpickpt.parity.shared_rows import MEMFD_NAME, PeerMaps, SharedRows

    shared = SharedRows()
    t = torch.randn(300, DIM)
    before, ident = t.clone(), id(t)
    assert shared.adopt(t) and id(t) == ident and torch.equal(t, before)
    fd, offset = shared.locate(t)
    assert offset == 0 and os.readlink(f"/proc/self/fd/{fd}") == f"/memfd:{MEMFD_NAME} (deleted)"
    assert shared.locate(t[7:]) == (fd, 7 * DIM * 4) and shared.adopt(t)  # already shared
    assert shared.nbytes == t.numel() * 4
    t[5, 3] = 42.0  # the training rank's updates are what a mapping sees
    seen = PeerMaps().words(os.getpid(), fd, 5 * DIM * 4, DIM * 4)
    assert seen.view(torch.float32)[3].item() == 42.0
    whole = torch.randn(10, DIM)
    for other in (whole[:, 1:], whole[2:], torch.empty(0, DIM)):
        at = other.data_ptr()
        assert not shared.adopt(other) and other.data_ptr() == at and shared.locate(other) is None


def test_peer_maps_refuse_what_is_not_a_row_buffer(shared_peer):
    from mpickpt.parity.shared_rows import PeerMapError, PeerMaps

    maps = PeerMaps()
    (wfd, wo), _, _ = shared_peer.at
    got = maps.words(shared_peer.pid, wfd, wo + 64, 128)
    assert np.array_equal(got.numpy(), shared_peer.arrays[0].view(np.int32).reshape(-1)[16:48])
    with pytest.raises(PeerMapError, match="holds"):
        maps.words(shared_peer.pid, wfd, wo, ROWS * DIM * 4 + 4)
    for offset in (2, -4):
        with pytest.raises(PeerMapError, match="not a word of it"):
            maps.words(shared_peer.pid, wfd, offset, 4)
    with pytest.raises(PeerMapError, match="not an mpickpt row buffer"):
        maps.words(shared_peer.pid, 0, 0, 4)  # its stdin
    proc = mp.get_context("fork").Process(target=os._exit, args=(0,))
    proc.start()
    proc.join(10)
    with pytest.raises(PeerMapError, match="cannot open"):
        maps.words(proc.pid, wfd, 0, 4)
    maps.close()
    assert not maps._maps and not maps.mapped


@pytest.mark.parametrize("offered", ["mapped", "refused"])
def test_a_mapped_survivor_reads_as_its_copies_do(shared_peer, offered):
    """Units and spans of a survivor whose buffers the probe mapped equal what copies read, all
    of them read in place; where a buffer it offers cannot be mapped (descriptor 0 is not one),
    the probe falls back to copies, with the same values."""
    from mpickpt.parity.shared_rows import PeerMaps

    maps = PeerMaps()
    words = SimpleNamespace(widths=[DIM, 1], width=DIM + 1)
    reader = PeerReader(SimpleNamespace(layout=LAYOUT, words=words), maps)
    at = None if offered == "mapped" else [shared_peer.at[0], (0, 0), shared_peer.at[2]]
    peer = _mapped_peer(shared_peer, at)
    assert peer.mappable
    reader.probe(peer, 2)
    assert (shared_peer.pid in maps.mapped) == (offered == "mapped")
    stripes = np.sort(np.random.default_rng(1).choice(LAYOUT.stripes, 700, replace=False))
    for pos in (0, 2):
        got = reader.units(peer, pos, stripes).numpy()
        assert np.array_equal(got, _units(shared_peer.arrays, pos, stripes)), pos
    words_, parity = reader.span(peer, 2, 400, LAYOUT.periods)
    assert np.array_equal(parity.numpy(), shared_peer.arrays[2][400:LAYOUT.periods])
    assert np.array_equal(words_.tensors[0].numpy().view(np.float32),
                          shared_peer.arrays[0][1200:LAYOUT.rows[2]])
    assert reader.bytes_read > 0
    assert reader.bytes_mapped == (reader.bytes_read if offered == "mapped" else 0)


@pytest.mark.skipif(not xor_many_built(), reason="the C kernels were not built")
@pytest.mark.parametrize("source", ["copied", "mapped"])
def test_a_whole_sweep_from_mapped_survivors_is_the_xor(shared_peer, source):
    """`pull` of every period of a lost rank from survivors it maps (or copies): its rows and
    parity are the XOR of the survivors' units, the degraded units beside them the survivors'
    own, and the reads are counted as mapped only where they were."""
    from mpickpt.parity.memory_reads import MemoryReads

    lost = 1
    st = _lost_rank(lost)
    reads = MemoryReads(st, threads=2)
    peers = {s: _mapped_peer(shared_peer) if source == "mapped" else
             Peer(shared_peer.key, shared_peer.pid, True, True, shared_peer.parity, (-1, 0),
                  ((shared_peer.weight, DIM * 4, -1, 0), (shared_peer.state, 4, -1, 0)))
             for s in range(LAYOUT.g) if s != lost}
    reads.probe(peers)
    stripes = np.arange(5, LAYOUT.stripes, 37)
    units, _ = reads.pull(0, LAYOUT.periods, peers, stripes)
    chunk = np.arange(LAYOUT.stripes)
    want = np.zeros((len(chunk), DIM + 1), dtype=np.int32)
    for pos in peers:
        want ^= _units(shared_peer.arrays, pos, chunk)
        assert np.array_equal(units[pos].numpy(), _units(shared_peer.arrays, pos, stripes))
    rows, prow = LAYOUT.row_of_stripe(lost, chunk), LAYOUT.parity_row(lost, chunk)
    d = rows >= 0
    assert np.array_equal(st.words.tensors[0][rows[d]].numpy().view(np.int32), want[d, :DIM])
    assert np.array_equal(st.words.tensors[1][rows[d]].numpy().view(np.int32), want[d, DIM])
    assert np.array_equal(st.parity[prow[prow >= 0]].numpy(), want[prow >= 0])
    assert reads.bytes_read > 0
    assert reads.bytes_mapped == (reads.bytes_read if source == "mapped" else 0)
    reads.close()
    assert not reads.maps.mapped


@pytest.mark.skipif(not xor_many_built(), reason="the C kernels were not built")
@pytest.mark.parametrize("sources", [1, 2, 3, 4])
def test_xor_many_in_row_blocks_of_narrow_rows(sources):
    """Records of many rows (several of the kernel's row blocks), rows of 4 to 68 bytes as a
    rebuild's are, some sources shorter than their destination: each destination row is the
    XOR of the sources that have it, records interleaved in memory as a piece's slots are."""
    rng = np.random.default_rng(sources)
    n, g = 1000, 4
    src = [rng.integers(-2**31, 2**31, (g * n, 17)).astype(np.int32) for _ in range(sources)]
    dest = np.full((g * n, 17), 9, dtype=np.int32)
    jobs, want = [], dest.copy()
    for o in range(g):
        for c, w in ((0, 16), (16, 1)):
            short = [n - 1 - 301 * (i % 3) for i in range(sources)]
            jobs.append(((dest.ctypes.data + (o * 17 + c) * 4, g * 68, n), 4 * w,
                         [(a.ctypes.data + (o * 17 + c) * 4, g * 68, m) for a, m in
                          zip(src, short)]))
            acc = np.zeros((n, w), dtype=np.int32)
            for a, m in zip(src, short):
                acc[:m] ^= a[o::g][:m, c:c + w]
            want[o::g, c:c + w] = acc
    xor_many(jobs)
    assert np.array_equal(dest, want)


def test_publishing_ahead_lets_no_process_attach(monkeypatch):
    """The descriptors `encode` publishes need no ptrace attach: only a round's fields (a lost
    rank may have to copy) let this user's processes read this one."""
    allowed = []
    monkeypatch.setattr(cross_memory, "allow_readers", lambda: allowed.append(1))
    peer_rows._allow_readers.cache_clear()
    weight, state = torch.zeros(8, DIM), torch.zeros(8)
    words = SimpleNamespace(tensors=[weight, state], widths=[DIM, 1],
                            memory=lambda: [(weight.data_ptr(), DIM * 4, DIM * 4),
                                            (state.data_ptr(), 4, 4)])
    store = SimpleNamespace(words=words, parity=torch.zeros(3, DIM + 1, dtype=torch.int32))
    ahead = Peer.parse(peer_rows.describe(store, True, False, readable=False))
    assert not allowed and ahead.serves and ahead.key == cross_memory.host_key()
    assert not ahead.mappable  # nothing shared: the buffers are offered as -1
    peer_rows.describe(store, True, False)
    peer_rows.describe(store, True, False)
    assert allowed == [1]
    peer_rows._allow_readers.cache_clear()


@pytest.mark.parametrize("case", ["mapped", "other host", "not shared", "old generation"])
def test_a_lost_rank_premaps_only_survivors_it_can_map_here(case):
    """At its loss a rank begins mapping its survivors where encode said they were, only where
    every survivor is shared, on this host, and published in the current generation."""
    from mpickpt.parity.guard import ParityGuard

    key = peer_rows.host_key()
    peer = Peer(key + (case == "other host"), 123, True, False, 0,
                (-1, 0) if case == "not shared" else (5, 0), ((0, DIM * 4, 6, 0), (0, 4, 7, 0)))
    calls = []
    guard = SimpleNamespace(_published={0: peer, 2: peer, 3: peer, 4: peer, 5: peer},
                            _published_in=0 if case == "old generation" else 1,
                            topo=SimpleNamespace(generation=1, rank=3),
                            store=SimpleNamespace(layout=SimpleNamespace(base=0, g=4)),
                            reads=SimpleNamespace(premap=lambda p, keep: calls.append(
                                (p, keep))))
    ParityGuard._premap(guard, {3})  # at rank 3's loss
    ParityGuard._premap(guard, {3}, keep=True)  # ahead, when parity is encoded (rank 3 too)
    assert calls == ([({0: peer, 2: peer}, False), ({0: peer, 2: peer}, True)]
                     if case == "mapped" else [])


def test_maps_made_ahead_outlive_a_rebuild_until_dropped(shared_peer):
    """Maps made ahead (`premap(keep=True)`) are what `premapped` gives; a rebuild's end, also
    released on a thread of its own, keeps them (not admitted: the next rebuild admits them
    again), and a premap at a loss that they cover maps nothing new; `drop_maps` unmaps them.
    Maps made at a loss go with the rebuild."""
    from mpickpt.parity.memory_reads import MemoryReads

    reads = MemoryReads(_lost_rank(1), threads=2)
    peers = {s: _mapped_peer(shared_peer) for s in (0, 2, 3)}
    reads.premap(peers, keep=True)
    assert reads.premapped() == peers
    held = set(reads.maps._maps)
    assert held and all(pid == shared_peer.pid for pid, _ in held)
    reads.admit(peers)
    assert reads.maps.mapped == {shared_peer.pid}
    reads.close(wait=False)
    releaser = reads._releaser
    assert releaser is not None and releaser.name == "mpickpt-release"
    reads.premap(peers)  # waits for the release first, then finds them all mapped
    assert not releaser.is_alive() and reads._releaser is None and reads._premap is None
    assert reads.premapped() == peers and set(reads.maps._maps) == held
    assert not reads.maps.mapped
    stripes = np.arange(0, LAYOUT.stripes, 5)
    reads.admit(peers)
    got = reads.units({0: peers[0]}, stripes)[0].numpy()
    assert np.array_equal(got, _units(shared_peer.arrays, 0, stripes))
    assert reads.bytes_mapped == reads.bytes_read > 0
    reads.drop_maps()
    assert reads.premapped() is None and not reads.maps._maps and not reads.maps.mapped
    reads.premap({2: peers[2]})  # at a loss
    assert reads.premapped() == {2: peers[2]} and reads.maps._maps
    reads.close()
    assert reads.premapped() is None and not reads.maps._maps


@pytest.mark.parametrize("case", ["premapped", "moved", "probed", "not yet", "unpublished"])
def test_a_premap_stands_for_the_probe_only_where_the_buffers_are_unchanged(case):
    """Every rank decides alike from a round's counts whether a lost rank still probes: not
    where it probed, nor where it premapped its survivors and they all publish the buffers they
    published before the failure; else it does (a survivor's buffer moved, nothing was
    published in this generation, or it neither probed nor premapped)."""
    from mpickpt.parity.rebuild import Rebuild

    key = peer_rows.host_key()

    def fields(m, said=0, fd=5):
        return [key, 100 + m, 1, said, 4096, fd, 0, 8192, 68, fd + 1, 0]

    said = {"probed": peer_rows.PROBED, "not yet": 0}.get(case, peer_rows.PREMAPPED)
    published = {m: Peer.parse(fields(m)) for m in range(4)}
    got = [[0] * 5 + fields(m, said if m == 1 else 0, 7 if case == "moved" and m == 2 else 5)
           for m in range(4)]
    rb = SimpleNamespace(store=SimpleNamespace(layout=SimpleNamespace(g=4)), failed={1},
                         published=None if case == "unpublished" else published)
    assert Rebuild._probing(rb, got) == (case in ("moved", "not yet", "unpublished"))
