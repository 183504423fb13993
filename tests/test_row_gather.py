"""Row gathers and scatters (mpickpt.store.row_gather, kernels/rows_cpu.c) against numpy's
indexing, with the kernel and with its numpy fallback."""
import numpy as np
import pytest

from mpickpt.store import row_gather
from mpickpt.store.row_gather import put_rows, take_rows


@pytest.fixture(params=["kernel", "numpy"])
def path(request, monkeypatch):
    if request.param == "kernel":
        if row_gather.KERNEL is None:
            pytest.skip("mpickpt._rows_cpu was not built (no C compiler)")
        monkeypatch.setattr(row_gather, "KERNEL_MIN_ROWS", 1)  # small cases through it too
    else:
        monkeypatch.setattr(row_gather, "KERNEL", None)
    return request.param


def _arrays(rng):
    rows = 1000
    structured = np.zeros(rows, dtype=[("x", "<f4"), ("y", "<i8")])
    structured["y"] = rng.integers(0, 1 << 40, rows)
    return {"f32 rows of 16": rng.standard_normal((rows, 16)).astype(np.float32),
            "f16 scales": rng.standard_normal((rows, 2)).astype(np.float16),
            "u8 codes": rng.integers(0, 256, (rows, 9), dtype=np.uint8),
            "i64 gids": rng.integers(0, 1 << 50, rows),
            "f32 state": rng.random(rows).astype(np.float32),
            "3-d": rng.standard_normal((rows, 3, 5)),
            "structured": structured,
            "objects": np.array([f"row {i}" for i in range(rows)], dtype=object)}


def test_take_rows_equals_numpy_for_every_dtype_index_and_mask(path):
    rng = np.random.default_rng(0)
    for name, a in _arrays(rng).items():
        index = rng.integers(0, len(a), 300)  # unsorted, with repeats
        mask = rng.random(len(a)) < 0.3
        for which in (index, np.unique(index), mask, index.astype(np.int32), index[:0]):
            got = take_rows(a, which)
            np.testing.assert_array_equal(got, a[which], err_msg=name)
            assert got.dtype == a.dtype and got.flags.c_contiguous and got.flags.writeable
            assert not np.shares_memory(got, a)


def test_take_rows_gathers_into_a_given_array_and_refuses_one_that_cannot_take_the_rows(path):
    rng = np.random.default_rng(5)
    for name, a in _arrays(rng).items():
        index = rng.integers(0, len(a), 300)
        mask = rng.random(len(a)) < 0.3
        for which in (index, mask, index[:0]):
            picked = len(a[which])
            dest = np.zeros((picked + 20,) + a.shape[1:], a.dtype)  # a buffer's tail
            got = take_rows(a, which, out=dest[10:10 + picked])
            assert np.shares_memory(got, dest) or picked == 0
            np.testing.assert_array_equal(dest[10:10 + picked], a[which], err_msg=name)
            untouched = np.concatenate([dest[:10], dest[10 + picked:]])
            np.testing.assert_array_equal(untouched, np.zeros_like(untouched), err_msg=name)
    a = rng.standard_normal((100, 4)).astype(np.float32)
    index = rng.integers(0, 100, 30)
    read_only = np.zeros((30, 4), np.float32)
    read_only.flags.writeable = False
    for bad, says in ((np.zeros((29, 4), np.float32), "float32 \\(29, 4\\)"),
                      (np.zeros((30, 4), np.float64), "float64"),
                      (np.zeros((30, 8), np.float32)[:, ::2], "non-contiguous"),
                      (read_only, "read-only")):
        with pytest.raises(ValueError, match=f"into an array of .*{says}.*: expected a "
                                             f"writeable, contiguous float32 array of shape "
                                             f"\\(30, 4\\)"):
            take_rows(a, index, out=bad)


def test_take_rows_reads_read_only_and_falls_back_on_strided_sources(path):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((500, 8)).astype(np.float32)
    a.flags.writeable = False  # a BlockCache block
    index = rng.integers(0, 500, 100)
    np.testing.assert_array_equal(take_rows(a, index), a[index])
    strided = rng.standard_normal((500, 16)).astype(np.float32)[:, ::2]
    np.testing.assert_array_equal(take_rows(strided, index), strided[index])
    out = np.zeros((100, 8), np.float32)  # into a given array: the kernel refuses, numpy takes
    np.testing.assert_array_equal(take_rows(strided, index, out=out), strided[index])
    np.testing.assert_array_equal(out, strided[index])


def test_take_rows_into_memory_it_reads_equals_numpy_and_a_0d_source_is_no_row(path):
    a = np.arange(10.0)
    want = a.copy()
    want[1:5] = a[[0, 0, 1, 2]]
    take_rows(a, np.array([0, 0, 1, 2]), out=a[1:5])  # rows overwritten before they are read
    np.testing.assert_array_equal(a, want)
    with pytest.raises(TypeError):  # a 0-d array has no rows to pick
        take_rows(np.array(5.0), np.array([0, 0]), out=np.empty(2))


def test_put_rows_equals_numpy_and_the_last_of_repeated_rows_wins(path):
    rng = np.random.default_rng(2)
    for name, a in _arrays(rng).items():
        index = rng.permutation(len(a))[:400]
        rows = a[rng.integers(0, len(a), 400)]
        mine, want = np.zeros_like(a), np.zeros_like(a)
        put_rows(mine, index, rows)
        want[index] = rows
        np.testing.assert_array_equal(mine, want, err_msg=name)
    out = np.zeros((4, 3), np.float32)
    put_rows(out, np.array([1, 2, 1]), np.arange(9, dtype=np.float32).reshape(3, 3))
    np.testing.assert_array_equal(out[1], [6, 7, 8])
    np.testing.assert_array_equal(out[2], [3, 4, 5])


def test_put_rows_with_overlapping_rows_equals_numpy(path):
    want = np.arange(20, dtype=np.float32).reshape(10, 2)
    mine = want.copy()
    want[[1, 2, 3]] = want[0:3]
    put_rows(mine, [1, 2, 3], mine[0:3])
    np.testing.assert_array_equal(mine, want)


def test_put_rows_into_strided_or_from_scalars_and_lists_equals_numpy(path):
    base = np.zeros((6, 4), np.float32)
    put_rows(base[:, ::2], [0, 5], np.ones((2, 2), np.float32))
    assert base[[0, 5]][:, ::2].all() and not base[:, 1::2].any()
    out = np.zeros((4, 2), np.int64)
    put_rows(out, [3], 5)
    put_rows(out, [0, 1], [[1, 2], [3, 4]])
    np.testing.assert_array_equal(out, [[1, 2], [3, 4], [0, 0], [5, 5]])
    read_only = np.zeros((3, 2))
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        put_rows(read_only, [0], np.ones((1, 2)))


def test_encoded_rows_select_rows_by_mask_and_index_as_numpy(path):
    from mpickpt.store.row_arrays import EncodedRows

    rng = np.random.default_rng(3)
    rows = EncodedRows(None, (16,), "float32",
                       {"codes": rng.integers(0, 256, (50, 8), dtype=np.uint8),
                        "scale": rng.standard_normal((50, 2)).astype(np.float16)})
    mask = rng.random(50) < 0.5
    for which in (mask, ~mask, np.flatnonzero(mask)[::-1]):
        got = rows[which]
        assert len(got) == len(rows.arrays["codes"][which])
        for k, a in rows.arrays.items():
            np.testing.assert_array_equal(got.arrays[k], a[which])


def test_put_rows_casts_like_numpy_where_dtypes_differ(path):
    out = np.zeros((5, 2), np.float64)
    put_rows(out, np.array([4, 0]), np.array([[1, 2], [3, 4]], dtype=np.float32))
    np.testing.assert_array_equal(out[[4, 0]], [[1, 2], [3, 4]])
    mask = np.array([True, False, True, False, False])
    put_rows(out, mask, np.full((2, 2), 7.0))
    np.testing.assert_array_equal(out[[0, 2]], np.full((2, 2), 7.0))


def test_bad_indices_and_masks_are_refused_naming_the_value_and_nothing_is_written(path):
    a = np.arange(20, dtype=np.float32).reshape(10, 2)
    with pytest.raises(IndexError, match="10"):
        take_rows(a, np.array([3, 10]))
    with pytest.raises(IndexError, match="-1"):
        take_rows(a, np.array([-1, 2]))
    with pytest.raises(IndexError, match="mask of shape"):
        take_rows(a, np.ones(9, dtype=bool))
    with pytest.raises(IndexError, match="float64"):
        take_rows(a, np.array([1.0]))
    strided = np.zeros((10, 4), np.float32)[:, ::2]  # numpy's path: negatives refused too
    with pytest.raises(IndexError, match="-1"):
        take_rows(strided, [-1])
    with pytest.raises(IndexError, match="10"):
        take_rows(np.zeros((5, 0)), [10])  # zero-width rows: still checked
    with pytest.raises(IndexError, match="-2"):
        put_rows(np.zeros((5, 2)), [-2], np.ones((1, 2), np.float32))  # a cast, numpy's path
    out = np.zeros_like(a)
    with pytest.raises(IndexError, match="12"):
        put_rows(out, np.array([0, 12]), np.ones((2, 2), np.float32))
    assert not out.any()


def test_the_kernel_refuses_inconsistent_buffers():
    if row_gather.KERNEL is None:
        pytest.skip("mpickpt._rows_cpu was not built")
    src = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="inconsistent buffers"):
        row_gather.KERNEL.gather(src, np.zeros(2, np.int64), np.zeros(8, np.uint8), 6)
    with pytest.raises(ValueError, match="inconsistent buffers"):
        row_gather.KERNEL.scatter(src[:8], np.zeros(2, np.int64), np.zeros(64, np.uint8), 8)


def test_the_kernel_takes_index_arrays_and_large_masks_and_numpy_the_rest(monkeypatch):
    if row_gather.KERNEL is None:
        pytest.skip("mpickpt._rows_cpu was not built")
    calls = []
    real = row_gather.KERNEL

    class Counting:
        def gather(self, *args):
            calls.append("gather")
            return real.gather(*args)

        def scatter(self, *args):
            calls.append("scatter")
            return real.scatter(*args)

    monkeypatch.setattr(row_gather, "KERNEL", Counting())
    n = 4 * row_gather.KERNEL_MIN_ROWS
    a = np.arange(4 * n, dtype=np.float32).reshape(n, 4)
    take_rows(a, np.arange(0, n, 2))
    take_rows(a, np.arange(n) % 2 == 0)
    put_rows(a, np.arange(n // 2), np.zeros((n // 2, 4), np.float32))
    take_rows(a, np.arange(3))  # a few rows
    put_rows(a[:, 0].copy(), np.arange(3), np.ones(3, np.float32))  # 1-d
    assert calls == ["gather", "gather", "scatter", "gather", "scatter"]
    short = row_gather.KERNEL_MIN_ROWS - 1
    take_rows(a[:short], np.arange(short) % 2 == 0)  # a mask of too short an array
    take_rows(a[:, 0].copy(), np.arange(n) % 2 == 0)  # a mask of a 1-d array
    take_rows(a[:, :2], np.arange(n))  # strided
    with pytest.raises(IndexError, match=str(n)):
        take_rows(a, np.r_[np.arange(n // 2), n])  # the kernel's own check
    assert calls == ["gather", "gather", "scatter", "gather", "scatter", "gather"]
