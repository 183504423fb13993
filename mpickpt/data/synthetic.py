"""Criteo-like synthetic stream: every value is a pure function of (seed, global sample index, field).

Any rank can generate any slice of the global stream, so the stream seen by a data-parallel job does
not depend on its world size. Per sample:

- sparse: for each table and pooled slot, a popularity rank drawn from a bounded continuous power
  law (density ~ x^-alpha on [1, n + 1)) by inverting its CDF at a hashed uniform, then mapped to a
  row by a per-table affine bijection ``(a * rank + b) mod n`` so hot rows are scattered over the
  table (tables are split into contiguous row ranges across ranks);
- dense: Criteo-like nonnegative counts (Lomax-distributed with a per-column scale, some missing as
  0), transformed by log(1 + x);
- label: Bernoulli(sigmoid(logit)) of a planted model: a hidden normal weight per (table, row),
  summed over the sample's rows and scaled by signal / sqrt(T * L), plus a hashed linear function of
  the dense features, plus a bias calibrated so the positive rate is ``positive_rate``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mpickpt.counter_rng import hash_keys, normal, uniform
from mpickpt.data.batch import Batch
from mpickpt.data.position import SyntheticPosition
from mpickpt.data.source import local_slice

CRITEO_KAGGLE_CARDINALITIES = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
    5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
"""Rows per categorical feature C1..C26 in DLRM's Criteo Kaggle preprocessing."""

MAX_TABLE_ROWS = 1 << 31
CALIBRATION_SAMPLES = 8192

# Stream tags: the first key of every counter-RNG draw, one per kind of value.
(_SPARSE, _DENSE, _MISSING, _LABEL, _ROW_WEIGHT, _DENSE_WEIGHT, _SCALE, _MISS_RATE,
 _SCRAMBLE) = range(1, 10)


def criteo_kaggle_sizes(scale_down: int) -> tuple[int, ...]:
    """Criteo Kaggle cardinalities divided by ``scale_down`` (at least 2 rows each). Local."""
    if isinstance(scale_down, bool) or not isinstance(scale_down, int) or scale_down < 1:
        raise ValueError(f"scale_down must be an integer >= 1, got {scale_down!r}")
    return tuple(max(2, c // scale_down) for c in CRITEO_KAGGLE_CARDINALITIES)


@dataclass(frozen=True, kw_only=True, slots=True)
class SyntheticConfig:
    """Shape and statistics of the synthetic stream."""

    table_sizes: tuple[int, ...]
    """Rows per embedding table, each in [1, 2**31)."""
    num_dense: int = 13
    """Dense features per sample, >= 0."""
    pooling: int = 1
    """Row indices per table per sample (hotness L), >= 1."""
    zipf_alpha: float = 1.05
    """Power-law exponent of row popularity, > 0 (1 uses the logarithmic form)."""
    seed: int = 0
    """Seed of every counter-RNG draw."""
    signal: float = 1.0
    """Strength of the planted model (0 gives labels independent of the features), >= 0."""
    positive_rate: float = 0.25
    """Target fraction of positive labels, in (0, 1)."""

    def __post_init__(self):
        sizes = tuple(self.table_sizes)
        if not sizes or any(isinstance(n, bool) or not isinstance(n, (int, np.integer))
                            or not 1 <= n < MAX_TABLE_ROWS for n in sizes):
            raise ValueError(f"table_sizes must be a non-empty tuple of integers in [1, 2**31), "
                             f"got {sizes!r}")
        object.__setattr__(self, "table_sizes", tuple(int(n) for n in sizes))
        if not isinstance(self.num_dense, int) or self.num_dense < 0:
            raise ValueError(f"num_dense must be an integer >= 0, got {self.num_dense!r}")
        if not isinstance(self.pooling, int) or self.pooling < 1:
            raise ValueError(f"pooling must be an integer >= 1, got {self.pooling!r}")
        if not (math.isfinite(self.zipf_alpha) and self.zipf_alpha > 0):
            raise ValueError(f"zipf_alpha must be a finite number > 0, got {self.zipf_alpha!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not (math.isfinite(self.signal) and self.signal >= 0):
            raise ValueError(f"signal must be a finite number >= 0, got {self.signal!r}")
        if not 0 < self.positive_rate < 1:
            raise ValueError(f"positive_rate must be in (0, 1), got {self.positive_rate!r}")


def power_law_ranks(u: np.ndarray, sizes: np.ndarray, alpha: float) -> np.ndarray:
    """Popularity ranks in [0, n) from uniforms ``u`` by the bounded power law's inverse CDF. Local.

    ``x = F^-1(u)`` for density ~ x^-alpha on [1, n + 1); written with expm1/log1p so it is
    continuous through alpha = 1, where it becomes x = (n + 1)^u.
    """
    log_top = np.log(sizes.astype(np.float64) + 1.0)
    beta = 1.0 - alpha
    if abs(beta) < 1e-12:
        log_x = u * log_top
    else:
        log_x = np.log1p(u * np.expm1(beta * log_top)) / beta
    ranks = np.floor(np.exp(log_x)).astype(np.int64) - 1
    return np.clip(ranks, 0, sizes - 1)


def scramble_params(seed: int, sizes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per-table (a, b) with gcd(a, n) == 1, so rank -> (a * rank + b) mod n is a bijection. Local."""
    mults, shifts = [], []
    for t, n in enumerate(sizes):
        attempt, a = 0, 1
        while n > 2:
            a = 1 + int(hash_keys(seed, _SCRAMBLE, t, 0, attempt)) % (n - 1)
            if math.gcd(a, n) == 1:
                break
            attempt += 1
        mults.append(a)
        shifts.append(int(hash_keys(seed, _SCRAMBLE, t, 1)) % n)
    return np.array(mults, dtype=np.int64), np.array(shifts, dtype=np.int64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """Numerically safe logistic function. Local."""
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def calibrate_bias(logits: np.ndarray, rate: float) -> float:
    """Bias b with mean(sigmoid(b + logits)) == rate, by bisection. Local."""
    low, high = -40.0, 40.0
    for _ in range(80):
        mid = 0.5 * (low + high)
        if _sigmoid(mid + logits).mean() < rate:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


class SyntheticStream:
    """Generator of any slice of the global synthetic stream; stateless and thread-safe."""

    def __init__(self, config: SyntheticConfig):
        self.config = config
        self._sizes = np.array(config.table_sizes, dtype=np.int64)
        self._mult, self._shift = scramble_params(config.seed, config.table_sizes)
        columns = np.arange(config.num_dense)
        self._dense_scale = np.exp(uniform(config.seed, _SCALE, columns) * math.log(1000.0))
        self._missing_rate = 0.05 + 0.4 * uniform(config.seed, _MISS_RATE, columns)
        self._dense_weight = (normal(config.seed, _DENSE_WEIGHT, columns) * config.signal * 0.5
                              / math.sqrt(max(config.num_dense, 1)))
        calibration = self._unbiased_logits(self.sparse_rows(0, CALIBRATION_SAMPLES),
                                            self.dense_features(0, CALIBRATION_SAMPLES))
        self._bias = calibrate_bias(calibration, config.positive_rate)

    @property
    def bias(self) -> float:
        """The calibrated bias of the planted model. Local."""
        return self._bias

    def _indices(self, start: int, count: int) -> np.ndarray:
        """Global sample indices [start, start + count) as int64, checked. Local."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start}, count={count}")
        return np.arange(start, start + count, dtype=np.int64)

    def sparse_rows(self, start: int, count: int) -> np.ndarray:
        """Row indices (count, T, L) int64 of samples [start, start + count). Local."""
        i = self._indices(start, count)[:, None, None]
        t = np.arange(self._sizes.size)[None, :, None]
        slot = np.arange(self.config.pooling)[None, None, :]
        sizes = self._sizes[None, :, None]
        u = uniform(self.config.seed, _SPARSE, i, t, slot)
        ranks = power_law_ranks(u, sizes, self.config.zipf_alpha)
        return (self._mult[None, :, None] * ranks + self._shift[None, :, None]) % sizes

    def dense_features(self, start: int, count: int) -> np.ndarray:
        """log(1 + counts) (count, num_dense) float64 of samples [start, start + count). Local."""
        i = self._indices(start, count)[:, None]
        c = np.arange(self.config.num_dense)[None, :]
        u = uniform(self.config.seed, _DENSE, i, c)
        counts = np.floor(self._dense_scale * np.expm1(-np.log1p(-u) / 1.5))
        present = uniform(self.config.seed, _MISSING, i, c) >= self._missing_rate
        return np.log1p(counts * present)

    def _unbiased_logits(self, rows: np.ndarray, dense: np.ndarray) -> np.ndarray:
        """Planted logit minus the bias, for samples with these rows and dense features. Local."""
        cfg = self.config
        t = np.arange(self._sizes.size)[None, :, None]
        weights = normal(cfg.seed, _ROW_WEIGHT, t, rows)
        scale = cfg.signal / math.sqrt(self._sizes.size * cfg.pooling)
        # Row-wise sums, not a BLAS matmul: a sample's logit must not depend on the batch it is in.
        return scale * weights.sum(axis=(1, 2)) + (dense * self._dense_weight).sum(axis=1)

    def bayes_logits(self, start: int, count: int) -> np.ndarray:
        """Planted (ground-truth) logits float64 (count,) of samples [start, start + count). Local."""
        rows, dense = self.sparse_rows(start, count), self.dense_features(start, count)
        return self._bias + self._unbiased_logits(rows, dense)

    def batch(self, start: int, count: int) -> Batch:
        """Samples with global indices [start, start + count) as a Batch. Local."""
        rows = self.sparse_rows(start, count)
        dense = self.dense_features(start, count)
        prob = _sigmoid(self._bias + self._unbiased_logits(rows, dense))
        labels = uniform(self.config.seed, _LABEL, self._indices(start, count)) < prob
        return Batch(dense=torch.from_numpy(dense.astype(np.float32)),
                     sparse=torch.from_numpy(rows),
                     labels=torch.from_numpy(labels.astype(np.float32)))

    def read_slice(self, state: SyntheticPosition, global_batch: int, rank: int,
                   world: int) -> tuple[Batch, SyntheticPosition]:
        """This rank's slice of the global batch at ``state`` and the next state; never ends. Local."""
        part = local_slice(global_batch, rank, world)
        batch = self.batch(state.sample_index + part.start, len(part))
        return batch, SyntheticPosition(sample_index=state.sample_index + global_batch)
