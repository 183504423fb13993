"""dest = XOR of several blocks of rows, each a strided 2-D int32 view: the r = 1 decode of a
rebuild read from memory. One call of `kernels/parity_fold_cpu.c`'s `xor_rows` (no GIL, one pass
over the sources) where it was built, torch's copy and XOR otherwise. Local."""
from __future__ import annotations

import numpy as np
import torch

try:
    from mpickpt._parity_cpu import xor_rows as _kernel
except ImportError:  # the C kernels are optional
    _kernel = None


def xor_views(dest: torch.Tensor, sources: list[torch.Tensor], kernel: bool = True) -> None:
    """dest[i] = XOR of sources[s][i] over the sources longer than i (zeros if none). `dest`
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
    dest.zero_()
    for s in sources:
        if len(s):
            dest[:len(s)].bitwise_xor_(s)
