"""CuPy wrapper of kernels/quant_rows.cu: the range search of the uniform codecs on a GPU.

For GPU-resident snapshots: rows already on the device are searched there and only the float16
parameters need to leave it. The kernel mirrors the CPU kernel (kernels/quant_rows_cpu.c) bit for
bit: same order of operations, no FMA contraction, the CPU kernel's 8 accumulation lanes owned by
the 8 threads that share a row (tested in tests/test_quant_cuda.py). Without CuPy or a GPU, callers
use `mpickpt.quant.search.search`. CuPy is imported lazily, so this module imports without it; the
kernel is compiled once, on first use.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from mpickpt.cupy_support import external_stream, is_torch
from mpickpt.cupy_support import gpu_available as available  # noqa: F401 (re-exported)
from mpickpt.quant import search as rs

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "quant_rows.cu"
GROUP = 8
"""Threads per row (GROUP in kernels/quant_rows.cu)."""
THREADS = 256
"""Threads per block: 32 rows. A multiple of 32, as the kernel's warp shuffles need."""
_module = None


def _kernel():
    global _module
    import cupy

    if _module is None:
        # --fmad=false is a second guard: the source already spells every product and sum with
        # __fmul_rn/__fadd_rn (and double twins) so that nothing is contracted into an FMA.
        _module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17", "--fmad=false"))
    return _module.get_function("search_rows")


def search_rows_cuda(x, bits: int, search: str = "refined", num_bins: int | None = None,
                     ratio: float | None = None, polish_rounds: int = 2
                     ) -> tuple[np.ndarray, np.ndarray]:
    """float16 (scale, offset) numpy arrays per row of `x` (n, D), as `search.search` with
    backend="c" gives them. `x`: a numpy array (copied to the current CuPy device), a CuPy array,
    or a torch tensor (CUDA tensors zero-copy through DLPack, searched on torch's current stream of
    their device); converted to contiguous float32 where needed. Local."""
    num_bins, ratio = rs.walk_of(bits, search, num_bins, ratio)
    shape = tuple(x.shape)
    if len(shape) != 2:
        raise ValueError(f"rows must be 2-D (n, D), got shape {shape}")
    n, d = shape
    if n == 0:
        return np.empty(0, np.float16), np.empty(0, np.float16)
    if d < 1:
        raise ValueError(f"rows must have at least one column, got shape {shape}")
    args = (bits, int(search == "refined"), int(num_bins * ratio), int(num_bins),
            int(polish_rounds))
    import cupy

    if is_torch(x):
        import torch

        t = x.detach()
        if t.is_cuda:
            with cupy.cuda.Device(t.device.index), \
                    external_stream(cupy, torch.cuda.current_stream(t.device)):
                return _launch(cupy, cupy.from_dlpack(t), n, d, args)
        x = t.to(torch.float32).numpy()
    if isinstance(x, cupy.ndarray):
        with x.device:
            return _launch(cupy, x, n, d, args)
    return _launch(cupy, np.ascontiguousarray(x, dtype=np.float32), n, d, args)


def _launch(cupy, x, n: int, d: int, args: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Run the kernel on the current device and stream; the copies back wait for it."""
    bits, refine, steps, bins, rounds = args
    rows = cupy.ascontiguousarray(cupy.asarray(x), dtype=cupy.float32)
    scale = cupy.empty(n, dtype=cupy.float32)
    offset = cupy.empty(n, dtype=cupy.float32)
    blocks = -(-n * GROUP // THREADS)
    _kernel()((blocks,), (THREADS,),
              (rows, np.int64(n), np.int32(d), np.int32(bits), np.int32(refine), np.int32(steps),
               np.int32(bins), np.int32(rounds), scale, offset))
    return cupy.asnumpy(scale).astype(np.float16), cupy.asnumpy(offset).astype(np.float16)
