"""Row buffers reused between files (mpickpt.store.row_arena) and the IncrCP bundles gathered
into them: the rows appended are the rows picked, across growth and reuse, and a bundle written
from an arena holds exactly its own chunks' rows, quantized rows copied as they are."""
import h5py
import numpy as np
import pytest

from mpickpt.incrcp.extraction import BundleBuilder
from mpickpt.quant.codecs import Codec
from mpickpt.store.direct_io import PAGE
from mpickpt.store.row_arena import MIN_ROWS, RowArena, RowBuffer
from mpickpt.store.row_arrays import EncodedRows, StoredRows
from mpickpt.store.shard_file import verify_file


def test_a_buffer_holds_the_rows_picked_across_growth():
    rng = np.random.default_rng(0)
    buf, expected = RowBuffer((16,), np.float32), []
    for n in (700, 5000, 20_000, 3):  # grows past MIN_ROWS twice, its rows copied over
        src = rng.standard_normal((n, 16)).astype(np.float32)
        for which in (None, rng.integers(0, n, n // 2), rng.random(n) < 0.5):
            got = buf.append(src, which)
            picked = src if which is None else src[which]
            np.testing.assert_array_equal(got, picked)
            expected.append(picked)
    np.testing.assert_array_equal(buf.rows(), np.concatenate(expected))
    assert len(buf.data) >= buf.length > MIN_ROWS
    assert buf.data.ctypes.data % PAGE == 0  # large enough for O_DIRECT: page-aligned
    with pytest.raises(ValueError, match=r"rows of float64 \(16,\) appended to a buffer of "
                                         r"float32 \(16,\) rows"):
        buf.append(np.zeros((4, 16)))


def test_an_arena_reuses_its_memory_and_keeps_no_more_than_it_may():
    rng = np.random.default_rng(1)
    arena = RowArena(keep_bytes=3 << 20)
    big = arena.buffer("weight", (16,), np.float32)
    big.append(rng.standard_normal((40_000, 16)).astype(np.float32))  # 2.6 MB
    small = arena.buffer("gids", (), np.int64)
    small.append(np.arange(40_000))
    at = big.data.ctypes.data
    arena.reset()  # 2.9 MB held: both kept, emptied
    assert arena.buffer("weight", (16,), np.float32) is big and big.length == 0
    src = rng.standard_normal((30_000, 16)).astype(np.float32)
    np.testing.assert_array_equal(big.append(src), src)
    assert big.data.ctypes.data == at  # the same memory, no new pages
    assert arena.buffer("weight", (8,), np.float16) is big  # not empty: it stays, and refuses
    with pytest.raises(ValueError, match="float16"):
        big.append(np.zeros((2, 8), np.float16))
    arena.buffer("scale", (1,), np.float32).append(np.ones((200_000, 1), np.float32))  # 0.8 MB
    arena.reset()  # 3.7 MB: the largest goes
    assert set(arena.buffers) == {"gids", "scale"} and arena.nbytes <= 3 << 20
    assert arena.buffer("gids", (2,), np.int32) is not small  # empty: another shape, new buffer
    again = arena.buffer("weight", (16,), np.float32)  # dropped: starts at its capacity
    again.append(src[:10])
    assert again is not big and len(again.data) == len(big.data) and again.length == 10
    arena.reset()  # 3.4 MB: dropped again
    assert "weight" not in arena.buffers
    narrow = arena.buffer("weight", (8,), np.float32)
    np.testing.assert_array_equal(narrow.append(src[:10, :8].copy()), src[:10, :8])
    assert len(narrow.data) == MIN_ROWS  # another row shape: from scratch


def _chunk(rng, lo, n, codec):
    gids = np.arange(lo, lo + 3 * n, 3, dtype=np.int64)
    w = rng.standard_normal((n, 16)).astype(np.float32)
    enc = codec.encode(w)
    return {"gids": gids, "weight": EncodedRows(codec, (16,), "float32", enc),
            "state": EncodedRows(None, (), "float32",
                                 {"values": rng.random(n).astype(np.float32)})}


def _read(path, name, n):
    with h5py.File(path, "r") as f:
        return StoredRows(f[f"rows/{name}"], path).raw(0, n).arrays


def test_bundles_from_one_arena_hold_their_own_chunks_rows(tmp_path):
    rng, codec, arena = np.random.default_rng(2), Codec("adaptive", 4), RowArena()
    for step in (5, 6):  # the second bundle reuses the first one's memory
        bundle = BundleBuilder(f"bundle-{step}.h5", arena)
        chunks = [_chunk(rng, 10_000 * k, n, codec) for k, n in enumerate((3000, 50, 9000))]
        picks = [np.flatnonzero(rng.random(len(c["gids"])) < 0.4) for c in chunks]
        refs = [bundle.add(k, 4, c, step, p) for k, (c, p) in enumerate(zip(chunks, picks))]
        assert bundle.add(0, 4, chunks[0], step, picks[0][:0]) is None  # nothing picked
        total = sum(map(len, picks))
        assert [(r.table, r.start, r.stop, r.until) for r in refs] == [
            (k, s, s + len(p), step) for k, (s, p) in
            enumerate(zip(np.cumsum([0] + [len(p) for p in picks]), picks))]
        for r, c, p in zip(refs, chunks, picks):
            assert (r.gid_min, r.gid_max) == (c["gids"][p[0]], c["gids"][p[-1]])
        assert bundle.write(str(tmp_path), step) > 0
        path = str(tmp_path / bundle.relpath)
        assert verify_file(path) == []
        with h5py.File(path, "r") as f:
            np.testing.assert_array_equal(
                f["rows/gids"][:], np.concatenate([c["gids"][p] for c, p in zip(chunks, picks)]))
        for name in ("weight", "state"):
            stored = _read(path, name, total)
            for part, got in stored.items():  # codes, scales ... copied as they are
                np.testing.assert_array_equal(got, np.concatenate(
                    [c[name].arrays[part][p] for c, p in zip(chunks, picks)]), err_msg=part)


def test_a_bundle_refuses_rows_stored_another_way(tmp_path):
    rng = np.random.default_rng(3)
    bundle = BundleBuilder("bundle-7.h5", RowArena())
    bundle.add(0, 7, _chunk(rng, 0, 100, Codec("adaptive", 4)), 7)
    with pytest.raises(ValueError, match="bundle-7.h5: cannot bundle rows of weight stored "
                                         "with different codecs"):
        bundle.add(1, 7, _chunk(rng, 500, 100, Codec("adaptive", 2)), 7)


def test_an_extractor_keeps_bounded_empty_buffers_between_ingestions_and_restores_the_same(
        tmp_path):
    """Each ingestion's bundles are gathered into the extractor's arenas, which it resets once
    they are written, but for the new row-0 bundle's when it fits the limit: that one is held
    for the next ingestion, which reads its chunks from memory and never opens its file. With a
    limit below a bundle's size (buffers dropped and made again at every ingestion) nothing is
    held, every arena is empty and within the limit, and the next ingestion reads the bundle
    from its file. Every step restores what an extractor that holds and keeps everything
    restores, bit for bit, and close to the rows saved (the weights 4-bit, the optimizer state
    exact)."""
    from mpickpt.model.shard_plan import ShardPlan
    from tests.local_chain import LocalChain

    plan, limit = ShardPlan.build((3000, 2000, 1500, 400), 2), 16 << 10

    def run(root, keep):
        chain = LocalChain(str(root), plan, dim=8, policy="incrcp", seed=7, bits=4,
                           incrcp_reset="never")
        for e in chain.extractors:  # --incrcp-hold `keep`, and no more kept in any arena
            e.limit_held(keep)
            e.arenas = tuple(RowArena(keep_bytes=keep) for _ in range(3))
        rng, saved, opened_last = np.random.default_rng(7), {}, 0
        for step in range(1, 9):
            for r in range(plan.world_size):
                chain.touch(r, rng.choice(plan.local_rows(r), plan.local_rows(r) // 3), rng)
            last = [e.held.relpath if e.held else None for e in chain.extractors]
            chain.save(step)
            saved[step] = chain.snapshot()
            for e, rel in zip(chain.extractors, last):
                opened_last += rel is not None and rel in e.opened.entries
                held = e.held.arena if e.held is not None else None
                assert all(b.length == 0 for a in e.arenas if a is not held
                           for b in a.buffers.values())
                assert all(a.nbytes <= keep for a in e.arenas)
                if held is not None:
                    assert e.held.relpath.endswith(f"bundle-{step:012d}-row0.h5")
                    assert {b.length for b in held.buffers.values()} == {e.held.length}
        return chain, saved, opened_last

    small, saved, _ = run(tmp_path / "small", limit)
    kept, _, opened_held = run(tmp_path / "kept", 1 << 30)
    assert small.extracted_rows == kept.extracted_rows > 0
    assert all(e.held is None for e in small.extractors)
    assert all(e.held is not None for e in kept.extractors) and opened_held == 0
    assert max(s.bundle_bytes for s in small.ingestions) > 4 * limit
    assert any(a.dropped for e in small.extractors for a in e.arenas)
    for step in (2, 5, 8):
        got, want = small.restore(step)[0], kept.restore(step)[0]
        for r in range(plan.world_size):
            for name in want[r]:
                what = f"step {step} rank {r} {name}"
                np.testing.assert_array_equal(got[r][name], want[r][name], err_msg=what)
                err = np.abs(got[r][name] - saved[step][r][name])  # 4-bit weights: ~4 %
                assert err.mean() <= 0.1 * np.abs(saved[step][r][name]).mean(), what


def test_the_hold_limit_decides_whether_a_bundle_is_held_and_what_row0_arenas_keep(tmp_path):
    """--incrcp-hold: a written row-0 bundle is held when its buffers fit the limit (the
    default's 512 MB, here a few kB), never with 0; the row-0 arenas keep their buffers up to it
    (at least `KEEP_BYTES`), the row-1 arena `KEEP_BYTES`; a negative limit is refused."""
    from mpickpt.incrcp.extraction import Extractor
    from mpickpt.incrcp.held_bundle import HOLD_BYTES
    from mpickpt.model.shard_plan import ShardPlan
    from mpickpt.store.row_arena import KEEP_BYTES
    from tests.local_chain import LocalChain

    default = Extractor(str(tmp_path / "d"))
    assert default.hold_bytes == HOLD_BYTES >= 4 * KEEP_BYTES
    assert [a.keep_bytes for a in default.arenas] == [HOLD_BYTES, HOLD_BYTES, KEEP_BYTES]
    default.limit_held(0)
    assert [a.keep_bytes for a in default.arenas] == [KEEP_BYTES] * 3
    with pytest.raises(ValueError, match=r"^--incrcp-hold must be a size in bytes >= 0, got -1$"):
        default.limit_held(-1)

    plan = ShardPlan.build((3000, 2000), 1)
    held = {}
    for hold in (0, HOLD_BYTES):
        chain = LocalChain(str(tmp_path / str(hold)), plan, dim=8, policy="incrcp", seed=3,
                           incrcp_reset="never")
        chain.extractors[0].limit_held(hold)
        rng = np.random.default_rng(3)
        for step in range(1, 5):
            chain.touch(0, rng.choice(plan.local_rows(0), 1500), rng)
            chain.save(step)
        held[hold] = chain.extractors[0].held
        assert chain.extracted_rows > 0
    assert held[0] is None
    assert held[HOLD_BYTES].relpath.endswith("bundle-000000000004-row0.h5")
