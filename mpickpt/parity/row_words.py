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
        self.base = 0
        """The shard row that row 0 of `tensors` is (0 here; a `span` holds a later part)."""

    @classmethod
    def span(cls, tensors: list[torch.Tensor], base: int) -> "RowWords":
        """Rows base, base + 1, ... of a shard held in `tensors` (e.g. read from a peer), with
        the same row numbering as the shard's own RowWords. Local."""
        self = cls.__new__(cls)
        self.tensors, self.base = tensors, base
        self.widths = [int(t.shape[1]) if t.dim() > 1 else 1 for t in tensors]
        self.width, self.rows, self.device = sum(self.widths), len(tensors[0]), tensors[0].device
        return self

    def memory(self) -> list[tuple[int, int, int]] | None:
        """(address, row stride in bytes, row bytes) of each tensor, for a peer on this host to
        read rows from (`parity.cross_memory`); None where the rows are not in this process's
        host memory with each row's words contiguous. Local."""
        out = []
        for t, w in zip(self.tensors, self.widths):
            if t.device.type != "cpu" or (t.dim() > 1 and (t.dim() != 2 or t.stride(1) != 1)):
                return None
            out.append((t.data_ptr(), t.stride(0) * 4, w * 4))
        return out

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, W) int32 copy of `rows`."""
        parts = [t.index_select(0, rows).reshape(len(rows), w).view(torch.int32)
                 for t, w in zip(self.tensors, self.widths)]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].clone()

    def read_every(self, first: int, step: int, out: torch.Tensor) -> None:
        """Copy rows first, first + step, ... (len(out) of them) into `out` ((n, W) int32, any
        strides): slices, no index, no temporary."""
        n, c = len(out), 0
        first -= self.base
        for t, w in zip(self.tensors, self.widths) if n else ():
            rows = t[first:first + (n - 1) * step + 1:step]
            out[:, c:c + w] = rows.reshape(n, w).view(torch.int32)
            c += w

    def xor_every(self, first: int, step: int, out: torch.Tensor) -> None:
        """XOR rows first, first + step, ... into `out` ((n, W) int32, any strides)."""
        n, c = len(out), 0
        first -= self.base
        for t, w in zip(self.tensors, self.widths) if n else ():
            rows = t[first:first + (n - 1) * step + 1:step]
            out[:, c:c + w].bitwise_xor_(rows.reshape(n, w).view(torch.int32))
            c += w

    @torch.no_grad()
    def write_every(self, first: int, step: int, words: torch.Tensor) -> None:
        """Write (n, W) int32 `words` (any strides) into rows first, first + step, ..."""
        n, c = len(words), 0
        first -= self.base
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
