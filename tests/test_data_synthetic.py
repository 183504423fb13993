"""Synthetic Criteo-like stream: world-size independence, heavy tails, ranges, planted signal."""
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from mpickpt.data import (CRITEO_KAGGLE_CARDINALITIES, Batch, SyntheticConfig, SyntheticPosition,
                          SyntheticStream, criteo_kaggle_sizes, roc_auc)
from mpickpt.data.synthetic import power_law_ranks, scramble_params

SIZES = criteo_kaggle_sizes(1000)


@pytest.fixture(scope="module")
def stream():
    return SyntheticStream(SyntheticConfig(table_sizes=SIZES, seed=7))


def assert_same(a: Batch, b: Batch):
    assert torch.equal(a.dense, b.dense)
    assert torch.equal(a.sparse, b.sparse)
    assert torch.equal(a.labels, b.labels)


def test_criteo_sizes():
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26
    assert criteo_kaggle_sizes(1) == CRITEO_KAGGLE_CARDINALITIES
    sizes = criteo_kaggle_sizes(1000)
    assert sizes[2] == 10131 and sizes[8] == 2 and min(sizes) == 2
    with pytest.raises(ValueError, match="scale_down"):
        criteo_kaggle_sizes(0)


@pytest.mark.parametrize("kwargs, word", [
    (dict(table_sizes=()), "table_sizes"), (dict(table_sizes=(0, 5)), "table_sizes"),
    (dict(table_sizes=(5,), zipf_alpha=0.0), "zipf_alpha"),
    (dict(table_sizes=(5,), pooling=0), "pooling"),
    (dict(table_sizes=(5,), signal=-1.0), "signal"),
    (dict(table_sizes=(5,), positive_rate=1.0), "positive_rate"),
    (dict(table_sizes=(5,), num_dense=-1), "num_dense")])
def test_config_rejects_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SyntheticConfig(**kwargs)


def test_shapes_dtypes_and_ranges(stream):
    b = stream.batch(123, 500)
    assert b.size == 500
    assert b.dense.dtype == torch.float32 and b.dense.shape == (500, 13)
    assert b.sparse.dtype == torch.int64 and b.sparse.shape == (500, 26, 1)
    assert b.labels.dtype == torch.float32 and set(b.labels.unique().tolist()) <= {0.0, 1.0}
    assert (b.dense >= 0).all() and torch.isfinite(b.dense).all()
    assert (b.sparse >= 0).all() and (b.sparse < torch.tensor(SIZES)[None, :, None]).all()


def test_pooling_shape_and_range():
    s = SyntheticStream(SyntheticConfig(table_sizes=(50, 7), pooling=3, num_dense=4, seed=1))
    b = s.batch(0, 200)
    assert b.sparse.shape == (200, 2, 3) and b.dense.shape == (200, 4)
    assert (b.sparse[:, 0] < 50).all() and (b.sparse[:, 1] < 7).all()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_identical_across_world_sizes(stream, world):
    global_batch, start = 64, 1000
    whole = stream.batch(start, 3 * global_batch)
    parts = []
    for step in range(3):
        state = SyntheticPosition(sample_index=start + step * global_batch)
        for rank in range(world):
            batch, nxt = stream.read_slice(state, global_batch, rank, world)
            assert nxt.sample_index == state.sample_index + global_batch
            parts.append(batch)
    assert_same(Batch.cat(parts), whole)


def test_uneven_subslices_match_and_seed_matters(stream):
    whole = stream.batch(5, 100)
    assert_same(Batch.cat([stream.batch(5, 1), stream.batch(6, 37), stream.batch(43, 62)]), whole)
    assert_same(SyntheticStream(SyntheticConfig(table_sizes=SIZES, seed=7)).batch(5, 100), whole)
    other = SyntheticStream(SyntheticConfig(table_sizes=SIZES, seed=8)).batch(5, 100)
    assert not torch.equal(other.sparse, whole.sparse)


def test_read_slice_rejects_uneven_global_batch(stream):
    with pytest.raises(ValueError, match="multiple of the world size"):
        stream.read_slice(SyntheticPosition(), 10, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        stream.read_slice(SyntheticPosition(), 8, 4, 4)


def top_share(rows: np.ndarray, size: int, fraction: float) -> float:
    counts = np.sort(np.bincount(rows, minlength=size))[::-1]
    return counts[: max(1, int(size * fraction))].sum() / rows.size


@settings(max_examples=15, deadline=None)
@example(alpha=1.0)
@given(alpha=st.floats(min_value=0.8, max_value=3.0))
def test_popularity_is_heavy_tailed(alpha):
    size = 100_000
    s = SyntheticStream(SyntheticConfig(table_sizes=(size,), zipf_alpha=alpha, num_dense=0, seed=3))
    rows = s.sparse_rows(0, 20_000).ravel()
    assert top_share(rows, size, 0.01) > 0.3  # uniform rows would give about 0.1 here


def test_power_law_continuous_at_alpha_one():
    u = np.linspace(0, 1, 10_001, endpoint=False)
    sizes = np.array([1000])
    at_one = power_law_ranks(u, sizes, 1.0)
    near = power_law_ranks(u, sizes, 1.0 + 1e-9)
    assert (at_one == near).mean() > 0.999
    assert at_one.min() == 0 and at_one.max() <= 999
    # popularity decreases with rank: rank 0 is drawn most often
    assert np.bincount(at_one).argmax() == 0


def test_scramble_is_bijection_and_spreads_hot_rows():
    sizes = (1, 2, 97, 1000, 4096)
    mult, shift = scramble_params(11, sizes)
    for n, a, b in zip(sizes, mult, shift):
        assert math.gcd(int(a), n) == 1
        rows = (a * np.arange(n) + b) % n
        assert np.array_equal(np.sort(rows), np.arange(n))
    s = SyntheticStream(SyntheticConfig(table_sizes=(100_000,), num_dense=0))
    rows = s.sparse_rows(0, 20_000).ravel()
    hottest = np.argsort(np.bincount(rows, minlength=100_000))[::-1][:20]
    assert np.ptp(hottest) > 50_000  # hot rows are not packed into one contiguous range


def test_positive_rate_band(stream):
    rate = stream.batch(0, 20_000).labels.mean().item()
    assert 0.2 < rate < 0.3


def test_planted_logits_are_predictive(stream):
    start, count = 50_000, 20_000
    labels = stream.batch(start, count).labels.numpy()
    assert roc_auc(labels, stream.bayes_logits(start, count)) > 0.7


def test_zero_signal_gives_no_signal():
    s = SyntheticStream(SyntheticConfig(table_sizes=SIZES, signal=0.0))
    assert np.ptp(s.bayes_logits(0, 1000)) == 0.0
    labels = s.batch(0, 20_000).labels.numpy()
    assert abs(roc_auc(labels, s.dense_features(0, 20_000)[:, 0]) - 0.5) < 0.03


def test_position_round_trip():
    p = SyntheticPosition(sample_index=42)
    assert SyntheticPosition.from_dict(p.to_dict()) == p
    with pytest.raises(ValueError, match="sample_index"):
        SyntheticPosition(sample_index=-1)
