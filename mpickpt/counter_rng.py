"""Counter-based random numbers: every value is a pure function of (seed, keys...).

Local (no communication). Used wherever a number must not depend on the world size or on the
order in which ranks ask for it: embedding initialisation keyed by global row id, and the synthetic
data stream keyed by global sample index. The mixer is SplitMix64 (Steele et al., 2014), applied to
numpy uint64 arrays; integer overflow wraps modulo 2**64 by design.
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Return SplitMix64's finaliser of ``x`` (uint64 array, same shape). Local."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def hash_keys(seed: int, *keys) -> np.ndarray:
    """Hash ``seed`` and broadcastable integer key arrays to uint64 (order-sensitive). Local."""
    h = splitmix64(np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    for k in keys:
        k = np.asarray(k).astype(np.uint64, copy=False)
        with np.errstate(over="ignore"):
            h = splitmix64(h ^ (k * _GOLDEN))
    return h


def uniform(seed: int, *keys) -> np.ndarray:
    """Uniform float64 in [0, 1) for every broadcast key combination. Local."""
    return (hash_keys(seed, *keys) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def normal(seed: int, *keys) -> np.ndarray:
    """Standard normal float64 (Box-Muller over two derived uniforms). Local."""
    u1 = uniform(seed, *keys, 1)
    u2 = uniform(seed, *keys, 2)
    return np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
