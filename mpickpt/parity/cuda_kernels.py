"""CuPy wrapper of kernels/parity_fold.cu: the parity fold for CUDA-resident shards.

`fold_cuda(parity, prow, coef, delta)` does what `StripeCode.fold` does, in one launch, for torch
CUDA tensors (zero-copy through DLPack, on torch's current stream) or CuPy arrays; repeated parity
rows are allowed (atomicXor). CuPy is imported lazily; without it or a GPU, `available()` is False
and callers keep the torch path.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpickpt.cupy_support import external_stream, is_torch
from mpickpt.cupy_support import gpu_available as available  # noqa: F401 (re-exported)
from mpickpt.parity import gf256

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "parity_fold.cu"
THREADS = 256
_cache: dict = {}


def _kernel_and_tables(cupy):
    dev = cupy.cuda.runtime.getDevice()
    if dev not in _cache:
        module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",))
        _cache[dev] = (module.get_function("fold_rows"), cupy.asarray(gf256.EXP),
                       cupy.asarray(gf256.LOG.astype(np.int32)))
    return _cache[dev]


def fold_cuda(parity, prow, coef, delta) -> None:
    """parity[prow[i]] ^= coef[i] * delta[i] on the GPU, in place. `parity` (rows, W) and `delta`
    (n, W) int32, `prow` (n) int64, `coef` (n) uint8; torch CUDA tensors (launched on torch's
    current stream of their device) or CuPy arrays (on CuPy's current stream). Local."""
    import cupy

    if is_torch(parity):
        import torch

        with cupy.cuda.Device(parity.device.index), \
                external_stream(cupy, torch.cuda.current_stream(parity.device)):
            _fold(cupy, *(cupy.from_dlpack(t.detach()) if is_torch(t) else cupy.asarray(t)
                          for t in (parity, prow, coef, delta)))
        return
    _fold(cupy, *(cupy.asarray(t) for t in (parity, prow, coef, delta)))


def _fold(cupy, p, r, c, d) -> None:
    if p.dtype != cupy.int32 or d.dtype != cupy.int32 or p.shape[1:] != d.shape[1:]:
        raise ValueError(f"parity and delta must be int32 with equal row width, got "
                         f"{p.dtype}{p.shape} and {d.dtype}{d.shape}")
    if not (p.flags.c_contiguous and d.flags.c_contiguous):
        raise ValueError("parity and delta must be contiguous")
    n, words = d.shape
    if n == 0:
        return
    kernel, gexp, glog = _kernel_and_tables(cupy)
    r = cupy.ascontiguousarray(r, dtype=cupy.int64)
    c = cupy.ascontiguousarray(c, dtype=cupy.uint8)
    blocks = -(-n * words // THREADS)
    kernel((blocks,), (THREADS,), (p, r, c, d, np.int64(n), np.int32(words), gexp, glog))
