"""IncrCP's Bloom filter: bit i of the filter is bit (i & 7) of byte (i >> 3), set for every hash
position of every key added, and no key added is ever reported absent."""
import numpy as np
import pytest

from mpickpt.incrcp import bloom
from mpickpt.incrcp.bloom import BloomFilter


def reference_bits(f: BloomFilter, batches) -> np.ndarray:
    """The bits set one position at a time, in plain Python."""
    bits = np.zeros_like(f.bits)
    for keys in batches:
        for p in f._positions(np.asarray(keys)).ravel().tolist():
            bits[p >> 3] |= 1 << (p & 7)
    return bits


@pytest.mark.parametrize("n", [0, 1, 7, 3000])
def test_bits_are_those_of_each_position_and_added_keys_are_found(n):
    rng = np.random.default_rng(n)
    first, more = rng.integers(0, 1 << 40, n), rng.integers(-(1 << 20), 1 << 20, n // 2 + 1)
    f = BloomFilter.of(first)
    f.add(more)
    assert f.bits.dtype == np.uint8 and len(f.bits) == -(-f.num_bits // 8)
    np.testing.assert_array_equal(f.bits, reference_bits(f, [first, more]))
    assert f.contains(np.concatenate([first, more])).all()
    absent = rng.integers(1 << 41, 1 << 42, 2000)
    assert f.contains(absent).mean() < (0.05 if n >= 3000 else 1.0)  # ~1 % at 10 bits per key


def test_keys_hashed_once_test_as_keys_hashed_per_filter():
    from mpickpt.incrcp.bloom import key_hashes

    rng = np.random.default_rng(5)
    keys = np.unique(rng.integers(0, 1 << 40, 5000))
    hashed = key_hashes(keys)
    for n in (10, 700, 4000):
        f = BloomFilter.of(rng.choice(keys, n, replace=False))
        assert np.array_equal(f.contains(keys, hashed), f.contains(keys))
        assert np.array_equal(f.contains(keys[100:900], (hashed[0][100:900], hashed[1][100:900])),
                              f.contains(keys[100:900]))


@pytest.mark.parametrize("path", ["kernel", "numpy"])
def test_split_membership_is_isin(path, monkeypatch):
    """Stage 3's membership equals np.isin on ascending chunks (the kernel's merge) and on
    shuffled ones (the fallback), with either side empty, negative keys, and keys beyond the
    other side's at both ends."""
    from mpickpt.incrcp import sorted_members

    if path == "numpy":
        monkeypatch.setattr(sorted_members, "KERNEL", None)
    elif sorted_members.KERNEL is None:
        pytest.skip("mpickpt._bloom_cpu is not built")
    rng = np.random.default_rng(6)
    for n, m in ((0, 5), (5, 0), (300, 40), (40, 300), (1000, 1000), (3, 2000)):
        keys = np.unique(rng.integers(-50, 500, n))
        gids = np.unique(rng.integers(-100, 600, m))
        for chunk in (gids, rng.permutation(gids)):
            for checked in (False, True):  # the new keys' order checked by the caller
                got = sorted_members.members(chunk, keys, checked=checked)
                assert got.dtype == bool and np.array_equal(got, np.isin(chunk, keys))


def test_a_kernel_built_before_its_fourth_argument_falls_back_to_the_search(monkeypatch):
    from mpickpt.incrcp import sorted_members

    class Stale:  # the kernel as built before `check_new`
        def members(self, keys, new_keys, out):
            raise AssertionError("not called with three arguments")

    monkeypatch.setattr(sorted_members, "KERNEL", Stale())
    chunk = np.array([1, 4, 5, 9], dtype=np.int64)
    keys = np.array([4, 9, 11], dtype=np.int64)
    assert sorted_members.members(chunk, keys, checked=True).tolist() == [False, True, False, True]


def test_new_keys_are_made_strictly_ascending_once_for_every_chunk_tested_against_them():
    from mpickpt.incrcp.sorted_members import ascending, members

    keys = np.array([3, 7, 8, 20], dtype=np.int64)
    assert ascending(keys) is keys  # already so: not copied
    messy = np.array([8, 3, 20, 7, 8], dtype=np.int64)  # two pieces overlapping, a repeat
    fixed = ascending(messy)
    assert fixed.tolist() == [3, 7, 8, 20]
    chunk = np.array([1, 3, 8, 9, 20], dtype=np.int64)
    assert members(chunk, fixed, checked=True).tolist() == [False, True, True, False, True]


def test_the_merge_refuses_keys_out_of_order_and_the_split_falls_back():
    from mpickpt.incrcp import sorted_members

    kernel = sorted_members.KERNEL
    if kernel is None:
        pytest.skip("mpickpt._bloom_cpu is not built")
    keys, out = np.array([1, 5, 9], dtype=np.int64), np.empty(3, dtype=np.uint8)
    with pytest.raises(ValueError, match="the keys are not strictly ascending at position 2"):
        kernel.members(np.array([2, 9, 9], dtype=np.int64), keys, out)
    with pytest.raises(ValueError, match="the new keys are not strictly ascending at position 1"):
        kernel.members(np.array([2, 9, 10], dtype=np.int64), keys[::-1].copy(), out)
    with pytest.raises(ValueError, match="the new keys are not strictly ascending at position 1"):
        kernel.members(np.array([5], dtype=np.int64), np.array([100, 5], dtype=np.int64),
                       out[:1])  # past the chunk's last key too
    with pytest.raises(ValueError, match="inconsistent buffers"):
        kernel.members(keys, keys, out[:2])
    chunk = np.array([9, 1, 4, 5], dtype=np.int64)
    assert sorted_members.members(chunk, keys).tolist() == [True, True, False, True]


def test_the_gc_rule_keeps_a_chunk_while_a_retained_step_lies_in_its_span():
    from mpickpt.incrcp.extraction import keeps
    from mpickpt.store.chunk_index import ChunkRef

    rng = np.random.default_rng(7)
    for _ in range(300):
        retained = sorted(set(rng.integers(0, 40, rng.integers(0, 6)).tolist()))
        column = int(rng.integers(0, 40))
        until = None if rng.random() < 0.2 else column + int(rng.integers(1, 10))
        ref = ChunkRef("b.h5", 0, 0, 5, 0, 9, column, until)
        want = until is None or any(column <= s < until for s in retained)
        assert keeps(ref, retained) == want, (retained, column, until)


@pytest.mark.skipif(bloom.KERNEL is None, reason="mpickpt._bloom_cpu was not built")
def test_the_c_kernel_sets_and_counts_the_bits_numpy_does(monkeypatch):
    rng = np.random.default_rng(8)
    for n, probes in ((1, 50), (257, 3000), (5000, 20000)):
        keys = rng.integers(-(1 << 40), 1 << 40, n)
        probe = np.concatenate([keys[: n // 2], rng.integers(0, 1 << 41, probes)])
        with_kernel = BloomFilter.of(keys)
        counted = with_kernel.count(probe)
        hashed = bloom.key_hashes(probe[10:])
        counted_hashed = with_kernel.count(probe[10:], hashed)
        monkeypatch.setattr(bloom, "KERNEL", None)
        plain = BloomFilter.of(keys)
        assert np.array_equal(with_kernel.bits, plain.bits)
        assert counted == plain.count(probe) == int(plain.contains(probe).sum())
        assert counted_hashed == int(plain.contains(probe[10:]).sum())
        monkeypatch.undo()
    with pytest.raises(ValueError, match="count_present: inconsistent"):
        bloom.KERNEL.count_present(with_kernel.bits, with_kernel.num_bits, 7,
                                   np.zeros(3, np.uint64), np.zeros(2, np.uint64))
    with pytest.raises(ValueError, match="set_bits: inconsistent"):
        bloom.KERNEL.set_bits(with_kernel.bits, len(with_kernel.bits) * 8 + 1, 7,
                              np.zeros(3, np.uint64), np.zeros(3, np.uint64))
