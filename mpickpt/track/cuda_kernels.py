"""CuPy wrappers of kernels/row_tracking.cu (compiled once, lazily, on first use)."""
from __future__ import annotations

from pathlib import Path

import torch

from mpickpt.cupy_support import external_stream

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "row_tracking.cu"
THREADS = 256


class RowTrackingKernels:
    """Launch the row-tracking kernels on torch CUDA tensors (zero-copy via DLPack). Local."""

    def __init__(self):
        import cupy

        self._cp = cupy
        module = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",))
        self._mark = module.get_function("mark_rows")
        self._count = module.get_function("count_words")
        self._extract = module.get_function("extract_rows")
        self.stream = torch.cuda.Stream()
        self._side = external_stream(cupy, self.stream)  # wrapped once, not per launch

    def _check(self, words: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        if words.dtype != torch.int64 or not words.is_cuda or not words.is_contiguous():
            raise ValueError(f"words must be a contiguous int64 CUDA tensor, got {words.dtype} "
                             f"on {words.device}")
        if rows is not None and (rows.dtype != torch.int64 or rows.device != words.device):
            raise ValueError(f"rows must be int64 on {words.device}, got {rows.dtype} on {rows.device}")

    def mark(self, words: torch.Tensor, rows: torch.Tensor) -> None:
        """atomicOr the bits of `rows` on a side stream that waits for the producer. Local."""
        self._check(words, rows)
        rows = rows.contiguous()
        self.stream.wait_stream(torch.cuda.current_stream())
        n = rows.numel()
        blocks = min(max(1, -(-n // THREADS)), 4096)
        with self._side:
            self._mark((blocks,), (THREADS,), (words.data_ptr(), rows.data_ptr(), n))
        rows.record_stream(self.stream)  # training goes on; `extract` waits for this stream

    def extract(self, words: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Sorted set rows: popcount, exclusive prefix sum, ordered scatter. Local."""
        self._check(words)
        torch.cuda.current_stream().wait_stream(self.stream)  # every mark lands first
        nw = words.numel()
        counts = torch.empty(nw, dtype=torch.int64, device=words.device)
        blocks = max(1, -(-nw // THREADS))
        stream = external_stream(self._cp, torch.cuda.current_stream())
        with stream:
            self._count((blocks,), (THREADS,), (words.data_ptr(), counts.data_ptr(), nw))
        offsets = torch.cumsum(counts, 0) - counts
        total = int(counts.sum()) if nw else 0
        rows = torch.empty(total, dtype=torch.int64, device=words.device)
        if total:
            with stream:
                self._extract((blocks,), (THREADS,),
                              (words.data_ptr(), offsets.data_ptr(), rows.data_ptr(), nw))
        return rows

