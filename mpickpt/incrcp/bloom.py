"""Bloom filter over int64 keys (global row ids): positions by double hashing, vectorized with
numpy, and counted and set by a C kernel (`kernels/bloom_cpu.c`, `mpickpt._bloom_cpu`: the same
bits, stopping at a key's first clear bit) where it was built. Local."""
from __future__ import annotations

import math

import numpy as np

try:
    from mpickpt import _bloom_cpu as KERNEL
except ImportError:  # built without a C compiler: numpy only
    KERNEL = None

_MUL1 = np.uint64(0x9E3779B97F4A7C15)
_MUL2 = np.uint64(0xBF58476D1CE4E5B9)
_MUL3 = np.uint64(0x94D049BB133111EB)


def _mix(keys: np.ndarray, salt: np.uint64) -> np.ndarray:
    """splitmix64 finaliser of key+salt. Local."""
    with np.errstate(over="ignore"):
        z = keys.astype(np.uint64) + salt * _MUL1
        z = (z ^ (z >> np.uint64(30))) * _MUL2
        z = (z ^ (z >> np.uint64(27))) * _MUL3
        return z ^ (z >> np.uint64(31))


def key_hashes(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two base hashes of each key (double hashing), the same for every filter. Local."""
    return _mix(keys, np.uint64(1)), _mix(keys, np.uint64(2)) | np.uint64(1)


class BloomFilter:
    """`bits_per_key` bits per expected key and the optimal number of hashes (double hashing)."""

    def __init__(self, expected: int, bits_per_key: int = 10):
        self.num_bits = max(64, int(expected) * bits_per_key)
        self.num_hashes = max(1, round(bits_per_key * math.log(2)))
        self.bits = np.zeros(-(-self.num_bits // 8), dtype=np.uint8)

    @classmethod
    def of(cls, keys: np.ndarray, bits_per_key: int = 10) -> "BloomFilter":
        f = cls(len(keys), bits_per_key)
        f.add(keys)
        return f

    def _positions(self, keys: np.ndarray, hashed: tuple | None = None) -> np.ndarray:
        h1, h2 = hashed if hashed is not None else key_hashes(keys)
        i = np.arange(self.num_hashes, dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):
            return ((h1[None, :] + i * h2[None, :]) % np.uint64(self.num_bits)).astype(np.int64)

    def add(self, keys: np.ndarray) -> None:
        """Set the keys' bits (the kernel's, or through one flag per bit and back: bit j of byte
        b is position 8b + j, several times faster than an unbuffered bitwise_or.at). Local."""
        keys = np.asarray(keys)
        if KERNEL is not None:
            if keys.size:
                KERNEL.set_bits(self.bits, self.num_bits, self.num_hashes, *key_hashes(keys))
            return
        pos = self._positions(keys).ravel()
        flags = np.unpackbits(self.bits, count=self.num_bits, bitorder="little").view(bool)
        flags[pos] = True
        self.bits = np.packbits(flags, bitorder="little")

    def count(self, keys: np.ndarray, hashed: tuple | None = None) -> int:
        """How many of `keys` are possibly present (`contains(...).sum()`, without the
        per-key array where the kernel was built). `hashed`: as `contains`'. Local."""
        keys = np.asarray(keys)
        if KERNEL is None or keys.size == 0:
            return int(self.contains(keys, hashed).sum())
        h1, h2 = hashed if hashed is not None else key_hashes(keys)
        return KERNEL.count_present(self.bits, self.num_bits, self.num_hashes,
                                    np.ascontiguousarray(h1), np.ascontiguousarray(h2))

    def contains(self, keys: np.ndarray, hashed: tuple | None = None) -> np.ndarray:
        """Boolean per key: possibly present (no false negatives). `hashed`: the keys'
        `key_hashes`, when the caller tests the same keys against many filters. Local."""
        keys = np.asarray(keys)
        if keys.size == 0:
            return np.zeros(0, dtype=bool)
        pos = self._positions(keys, hashed)
        hit = (self.bits[pos >> 3] >> (pos & 7).astype(np.uint8)) & 1
        return hit.all(axis=0)
