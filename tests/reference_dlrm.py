"""A single-process, unsharded DLRM used as the ground truth for the sharded trainer.

Independent of mpickpt's embedding and sparse-optimizer code: full tables, autograd for every gradient,
and the sparse optimizer rules written out here. Shares only the pure initialisation function and the
dense module definition, so both start from the same parameters."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mpickpt.model.dense import DenseArch, DLRMDense
from mpickpt.model.embedding import init_rows
from mpickpt.model.optimizers import OptimizerConfig


def torch_dense_optimizer(optim: OptimizerConfig, params) -> torch.optim.Optimizer:
    """torch.optim's own optimizer for `optim` (mpickpt's dense optimizers reimplement it)."""
    if optim.kind == "adagrad":
        return torch.optim.Adagrad(params, lr=optim.lr, eps=optim.eps)
    if optim.kind == "momentum":
        return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum)
    return torch.optim.SGD(params, lr=optim.lr)


class ReferenceDLRM:
    def __init__(self, arch: DenseArch, table_sizes, optim: OptimizerConfig, seed: int):
        self.optim = optim
        offsets = np.concatenate([[0], np.cumsum(table_sizes)])
        self.tables = []
        for t, n in enumerate(table_sizes):
            gids = np.arange(offsets[t], offsets[t + 1], dtype=np.int64)
            w = init_rows(seed, gids, np.full(n, n), arch.dim)
            self.tables.append(torch.nn.Parameter(torch.from_numpy(w)))
        self.state = [self._zero_state(n, arch.dim) for n in table_sizes]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.dense = DLRMDense(arch)
        self.dense_optimizer = torch_dense_optimizer(optim, self.dense.parameters())

    def _zero_state(self, n, dim):
        if self.optim.kind == "adagrad":
            return {"adagrad_sum": torch.zeros(n)}
        if self.optim.kind == "momentum":
            return {"momentum": torch.zeros(n, dim)}
        return {}

    def step(self, dense, sparse, labels) -> float:
        pooled = torch.stack([F.embedding_bag(sparse[:, t, :], w, mode="sum")
                              for t, w in enumerate(self.tables)], dim=1)
        loss = F.binary_cross_entropy_with_logits(self.dense(dense, pooled), labels)
        loss.backward()
        self.dense_optimizer.step()
        self.dense_optimizer.zero_grad()
        with torch.no_grad():
            for t, w in enumerate(self.tables):
                self._sparse_update(w, self.state[t], torch.unique(sparse[:, t, :]))
                w.grad = None
        return float(loss)

    def _sparse_update(self, w, state, rows):
        g = w.grad[rows]
        cfg = self.optim
        if cfg.kind == "adagrad":
            state["adagrad_sum"][rows] += g.pow(2).mean(dim=1)
            w[rows] -= cfg.lr * g / (state["adagrad_sum"][rows].sqrt() + cfg.eps).unsqueeze(1)
        elif cfg.kind == "momentum":
            state["momentum"][rows] = cfg.momentum * state["momentum"][rows] + g
            w[rows] -= cfg.lr * state["momentum"][rows]
        else:
            w[rows] -= cfg.lr * g
