"""Optimizers: fused sparse updates for embedding shards, and their dense counterparts for the MLPs.

Sparse optimizers update only the rows that received a gradient in the step ("lazy" semantics, as in
FBGEMM's TBE kernels); their state lives beside the shard, row for row, so checkpoints and parity can
treat (weights, state) of a row as one unit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mpickpt.model.dense_optimizers import DenseAdagrad, DenseOptimizer, DenseSGD

OPTIMIZERS = ("adagrad", "sgd", "momentum")


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """One optimizer choice for both the sparse (embedding) and the dense (MLP) parameters."""

    kind: str = "adagrad"
    """'adagrad' (rowwise Adagrad for embeddings, Adagrad for MLPs), 'sgd', or 'momentum'."""
    lr: float = 0.01
    """Learning rate, > 0."""
    eps: float = 1e-8
    """Adagrad's denominator guard, > 0."""
    momentum: float = 0.9
    """Momentum factor for 'momentum', in [0, 1)."""

    def __post_init__(self):
        if self.kind not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.kind!r}")
        if not self.lr > 0:
            raise ValueError(f"learning rate must be > 0, got {self.lr!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")


class SparseOptimizer:
    """Row-sparse update of a (rows, dim) weight. `state` maps names to per-row tensors."""

    def __init__(self, config: OptimizerConfig, num_rows: int, dim: int, device):
        self.config = config
        self.state: dict[str, torch.Tensor] = self._init_state(num_rows, dim, device)

    def _init_state(self, num_rows, dim, device) -> dict[str, torch.Tensor]:
        return {}

    @torch.no_grad()
    def step(self, weight: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
        """Apply one update to `weight[rows]` given unique `rows` and their summed `grad`. Local."""
        raise NotImplementedError


class RowwiseAdagrad(SparseOptimizer):
    """Rowwise Adagrad: one accumulator per row, G += mean(g^2); w -= lr * g / (sqrt(G) + eps)."""

    def _init_state(self, num_rows, dim, device):
        return {"adagrad_sum": torch.zeros(num_rows, dtype=torch.float32, device=device)}

    @torch.no_grad()
    def step(self, weight, rows, grad):
        acc = self.state["adagrad_sum"]
        acc.index_add_(0, rows, grad.square().mean(dim=1))
        scale = self.config.lr / (acc[rows].sqrt() + self.config.eps)
        weight.index_add_(0, rows, grad * -scale.unsqueeze(1))


class SparseSGD(SparseOptimizer):
    """Plain SGD on the touched rows: w -= lr * g."""

    @torch.no_grad()
    def step(self, weight, rows, grad):
        weight.index_add_(0, rows, grad, alpha=-self.config.lr)


class SparseMomentum(SparseOptimizer):
    """SGD with momentum on the touched rows: m = mu * m + g; w -= lr * m."""

    def _init_state(self, num_rows, dim, device):
        return {"momentum": torch.zeros(num_rows, dim, dtype=torch.float32, device=device)}

    @torch.no_grad()
    def step(self, weight, rows, grad):
        buf = self.state["momentum"]
        new = buf[rows].mul_(self.config.momentum).add_(grad)
        buf[rows] = new
        weight.index_add_(0, rows, new, alpha=-self.config.lr)


def make_sparse_optimizer(config: OptimizerConfig, num_rows: int, dim: int, device) -> SparseOptimizer:
    """The sparse optimizer for `config.kind`. Local."""
    cls = {"adagrad": RowwiseAdagrad, "sgd": SparseSGD, "momentum": SparseMomentum}[config.kind]
    return cls(config, num_rows, dim, device)


def make_dense_optimizer(config: OptimizerConfig, params) -> DenseOptimizer:
    """The dense counterpart of `config.kind` for replicated MLP parameters: torch.optim's update
    and state names, without its import of torch._dynamo (see dense_optimizers). Local."""
    if config.kind == "adagrad":
        return DenseAdagrad(params, lr=config.lr, eps=config.eps)
    if config.kind == "momentum":
        return DenseSGD(params, lr=config.lr, momentum=config.momentum)
    return DenseSGD(params, lr=config.lr)
