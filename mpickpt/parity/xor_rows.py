"""dest = XOR of several blocks of rows, each a strided 2-D int32 view: the r = 1 decode of a
rebuild read from memory. One call of `kernels/parity_fold_cpu.c`'s `xor_rows` (no GIL, one pass
over the sources) where it was built, torch's copy and XOR otherwise; `xor_many` does several by
address in one call of the kernel. Local."""
from __future__ import annotations

import numpy as np
import torch

try:
    from mpickpt._parity_cpu import xor_rows as _kernel
except ImportError:  # the C kernels are optional
    _kernel = None
try:
    from mpickpt._parity_cpu import xor_rows_many as _many
except ImportError:  # an older build of the kernels has no batch entry
    _many = None


def xor_views(dest: torch.Tensor, sources: list[torch.Tensor], kernel: bool = True) -> None:
    """dest[i] = XOR of sources[s][i] over the sources longer than i (zeros if none), each byte
    of `dest` written once, with its final value (a thread reading `dest` meanwhile sees old or
    new bytes, never a partial XOR). `dest`
    (n, w) and every source (m_s <= n, w): CPU int32 views whose rows are contiguous; they may
    not overlap `dest`. ValueError naming the view that is not."""
    n, w = dest.shape
    for name, t in [("destination", dest)] + [(f"source {i}", s) for i, s in enumerate(sources)]:
        if t.dim() != 2 or t.dtype != torch.int32 or t.device.type != "cpu" or \
                (t.shape[1] != w) or (w > 1 and t.stride(1) != 1) or len(t) > n:
            raise ValueError(f"xor_views: {name} must be a CPU int32 (rows <= {n}, {w}) view with "
                             f"contiguous rows, got {tuple(t.shape)} {t.dtype} strides "
                             f"{t.stride()} on {t.device}")
    if n == 0:
        return
    if kernel and _kernel is not None and w:
        triples = np.array([[s.data_ptr(), s.stride(0) * 4, len(s)] for s in sources],
                           dtype=np.int64).reshape(-1)
        _kernel(dest.data_ptr(), dest.stride(0) * 4, n, w * 4, triples.tobytes())
        return
    acc = torch.zeros_like(dest)  # formed aside, stored once: a reader sees no partial XOR
    for s in sources:
        if len(s):
            acc[:len(s)].bitwise_xor_(s)
    dest.copy_(acc)


def xor_many_built() -> bool:
    """Whether `xor_many` can run (the C kernel with its batch entry was built)."""
    return _many is not None


def xor_many(jobs: list[tuple[tuple[int, int, int], int, list[tuple[int, int, int]]]]) -> None:
    """For each job ((address, stride, rows) of the destination, row bytes, sources as
    (address, stride, rows)): destination row i = XOR of row i of the sources that have more
    than i rows (zeros if none), a source's rows beyond the destination's ignored. Addresses
    are raw: the caller has checked every extent (`period_slots.slot_extent` does). One call
    of the kernel, without the GIL; RuntimeError where it was not built."""
    if _many is None:
        raise RuntimeError("xor_many needs mpickpt._parity_cpu with xor_rows_many (rebuild the "
                           "C kernels: pip install -e .)")
    words = []
    for (address, stride, rows), width, sources in jobs:
        if rows and width:
            words += [address, stride, rows, width, len(sources)]
            for a, s, n in sources:
                words += [a, s, min(n, rows)]
    if words:
        _many(np.array(words, dtype=np.int64).tobytes())
