"""Test-set evaluation: AUC and log loss over a fixed number of global batches."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpickpt.data.metrics import log_loss, roc_auc


@dataclass(frozen=True)
class TestResult:
    auc: float
    logloss: float
    samples: int


def evaluate(model, source, start_state, *, global_batch: int, num_batches: int) -> TestResult | None:
    """Predict `num_batches` global batches from `start_state` and score them on rank 0.

    Collective (lookups over the process group, a gather over the control channel). Returns the
    result on every rank, or None when there is no test data."""
    topo = model.topo
    state, labels, probs = start_state, [], []
    for _ in range(num_batches):
        batch, state = source.read_slice(state, global_batch, topo.rank, topo.world_size)
        if batch is None:
            break
        probs.append(model.predict(batch).cpu().numpy())
        labels.append(batch.labels.numpy())
    local = (np.concatenate(labels) if labels else np.zeros(0),
             np.concatenate(probs) if probs else np.zeros(0))
    parts = topo.control.gather(local, root=0)
    result = None
    if topo.rank == 0:
        y = np.concatenate([p[0] for p in parts])
        p = np.concatenate([p[1] for p in parts])
        if y.size and 0 < y.sum() < y.size:
            result = TestResult(roc_auc(y, p), log_loss(y, p), int(y.size))
    return topo.control.bcast(result, root=0)
