"""A shard's rows (fp32 weights + sparse optimizer state) seen as int32 words: the parity unit."""
from __future__ import annotations

import torch


class RowWords:
    """Gather and scatter the W words of local rows. Local."""

    def __init__(self, embeddings):
        state = embeddings.optimizer.state
        self.tensors = [embeddings.weight] + [state[k] for k in sorted(state)]
        for t in self.tensors:
            if t.dtype != torch.float32:
                raise TypeError(f"parity needs float32 row state, got {t.dtype}")
        self.widths = [t[0].numel() if t.dim() > 1 else 1 for t in self.tensors]
        self.width = sum(self.widths)
        self.rows = len(embeddings.weight)
        self.device = embeddings.weight.device

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, W) int32 copy of `rows`."""
        parts = [t.index_select(0, rows).reshape(len(rows), w).view(torch.int32)
                 for t, w in zip(self.tensors, self.widths)]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()

    def read_every(self, first: int, step: int, out: torch.Tensor) -> None:
        """Copy rows first, first + step, ... (len(out) of them) into `out` ((n, W) int32, any
        strides): slices, no index, no temporary."""
        n, c = len(out), 0
        for t, w in zip(self.tensors, self.widths) if n else ():
            rows = t[first:first + (n - 1) * step + 1:step]
            out[:, c:c + w] = rows.reshape(n, w).view(torch.int32)
            c += w

    @torch.no_grad()
    def write_every(self, first: int, step: int, words: torch.Tensor) -> None:
        """Write (n, W) int32 `words` (any strides) into rows first, first + step, ..."""
        n, c = len(words), 0
        for t, w in zip(self.tensors, self.widths) if n else ():
            part = t[first:first + (n - 1) * step + 1:step]
            part.copy_(words[:, c:c + w].view(torch.float32).reshape(part.shape))
            c += w

    @torch.no_grad()
    def scatter(self, rows: torch.Tensor, words: torch.Tensor) -> None:
        """Write (n, W) int32 `words` into `rows`."""
        a = 0
        for t, w in zip(self.tensors, self.widths):
            part = words[:, a:a + w].contiguous().view(torch.float32)
            t.index_copy_(0, rows, part.reshape((len(rows),) + tuple(t.shape[1:])))
            a += w

    def nbytes(self) -> int:
        return self.rows * self.width * 4
