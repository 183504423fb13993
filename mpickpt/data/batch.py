"""One rank's mini-batch: dense features, per-table row indices, labels."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """A batch of ``n`` samples as CPU (or device) tensors, checked on construction."""

    dense: torch.Tensor
    """float32 (n, num_dense): log(1 + count) features."""
    sparse: torch.Tensor
    """int64 (n, T, L): row index in each of the T tables, L = pooling factor (1 for Criteo)."""
    labels: torch.Tensor
    """float32 (n,): click labels in {0, 1}."""

    def __post_init__(self):
        if self.labels.dtype != torch.float32 or self.labels.dim() != 1:
            raise ValueError(f"Batch.labels must be a 1-D float32 tensor, got {self.labels.dtype} of "
                             f"shape {tuple(self.labels.shape)}")
        n = self.labels.shape[0]
        for tensor, dtype, dim, name in ((self.dense, torch.float32, 2, "dense"),
                                         (self.sparse, torch.int64, 3, "sparse")):
            if tensor.dtype != dtype or tensor.dim() != dim or tensor.shape[0] != n:
                raise ValueError(f"Batch.{name} must be {dtype} with {dim} dims and {n} rows (one per "
                                 f"label), got {tensor.dtype} of shape {tuple(tensor.shape)}")

    @property
    def size(self) -> int:
        """Number of samples. Local."""
        return int(self.labels.shape[0])

    def to(self, device, non_blocking: bool = False) -> Batch:
        """Return a Batch whose tensors are on ``device`` (tensors already there are shared). Local."""
        return Batch(dense=self.dense.to(device, non_blocking=non_blocking),
                     sparse=self.sparse.to(device, non_blocking=non_blocking),
                     labels=self.labels.to(device, non_blocking=non_blocking))

    @staticmethod
    def cat(batches: list[Batch]) -> Batch:
        """Concatenate batches sample-wise, in order (at least one batch). Local."""
        if not batches:
            raise ValueError("Batch.cat needs at least one batch, got an empty list")
        return Batch(dense=torch.cat([b.dense for b in batches]),
                     sparse=torch.cat([b.sparse for b in batches]),
                     labels=torch.cat([b.labels for b in batches]))
