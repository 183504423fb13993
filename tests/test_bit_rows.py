"""The rows of a bit-vector's set bits: the C kernel and numpy's unpacking against the plain
definition (bit b of word i is row 64 i + b), the sign bit and empty words included."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpickpt.track import bit_rows
from mpickpt.track.bitvector import RowBitVector


def _reference(words: np.ndarray) -> np.ndarray:
    bits = [(int(w) >> b) & 1 for w in words.view(np.uint64) for b in range(64)]
    return np.flatnonzero(np.array(bits, dtype=bool)).astype(np.int64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.just(0), st.just(-1), st.just(-(1 << 63)),
                          st.integers(-(1 << 63), (1 << 63) - 1)), max_size=40))
def test_set_rows_are_the_positions_of_the_set_bits(values):
    words = np.array(values, dtype=np.int64)
    want = _reference(words)
    np.testing.assert_array_equal(bit_rows.unpacked(words), want)
    np.testing.assert_array_equal(bit_rows.set_rows(words), want)


@pytest.mark.skipif(bit_rows.KERNEL is None, reason="mpickpt._row_bits_cpu not built")
def test_the_kernel_refuses_what_it_cannot_answer():
    words = np.array([0b1011, -1], dtype=np.int64)
    assert bit_rows.KERNEL.count(words) == 67
    with pytest.raises(ValueError, match=r"more set bits than out's 66 rows"):
        bit_rows.KERNEL.rows(words, np.empty(66, dtype=np.int64))
    with pytest.raises(ValueError, match=r"12 bytes, not whole 64-bit words"):
        bit_rows.KERNEL.count(np.zeros(3, dtype=np.int32))
    out = np.full(70, -7, dtype=np.int64)
    assert bit_rows.KERNEL.rows(words, out) == 67
    assert out[:3].tolist() == [0, 1, 3] and out[3:67].tolist() == list(range(64, 128))
    assert out[67:].tolist() == [-7] * 3  # nothing written past the rows


def test_a_bit_vector_extracts_and_clears_the_rows_it_marked():
    rng = np.random.default_rng(4)
    n = 1_000_003
    rows = np.unique(rng.integers(0, n, 20_000))
    bv = RowBitVector(n)
    bv.mark(torch.from_numpy(rows), sorted_unique=True)
    assert bv.count() == len(rows)
    got = bv.extract()
    assert got.dtype == torch.int64
    np.testing.assert_array_equal(got.numpy(), rows)
    assert bv.count() == 0 and int(bv.words.abs().sum()) == 0


def test_words_of_other_layouts_give_the_same_rows_and_other_items_are_refused():
    words = np.array([5, -(1 << 63), 0, 1 << 40], dtype=np.int64)
    want = _reference(words)
    for variant in (words.astype(">i8"), words.view(np.uint64), np.repeat(words, 2)[::2]):
        np.testing.assert_array_equal(bit_rows.set_rows(variant), want)
        np.testing.assert_array_equal(bit_rows.unpacked(variant), want)
    raw = np.frombuffer(b"\0" + words.tobytes(), dtype=np.int64, offset=1)  # unaligned
    np.testing.assert_array_equal(bit_rows.set_rows(raw), want)
    with pytest.raises(ValueError, match=r"must be 64-bit integers, got int32"):
        bit_rows.set_rows(np.array([1, 1], dtype=np.int32))
    with pytest.raises(ValueError, match=r"must be 64-bit integers, got float64"):
        bit_rows.unpacked(np.array([1.0]))
