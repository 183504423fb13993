"""Evaluation metrics for click prediction: ROC AUC (rank based, ties averaged) and log loss."""
from __future__ import annotations

import numpy as np


def _check_pair(labels, values, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Return (labels, values) as flat float64 arrays after checking shapes and labels. Local."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    v = np.asarray(values, dtype=np.float64).ravel()
    if y.shape != v.shape:
        raise ValueError(f"labels and {name} must have the same length, got {y.size} and {v.size}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise ValueError(f"labels must be 0 or 1, got values {np.unique(y)[:5]}")
    return y, v


def average_ranks(values) -> np.ndarray:
    """1-based ranks of ``values`` with tied values sharing their mean rank (float64). Local."""
    _, inverse, counts = np.unique(np.asarray(values).ravel(), return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    mean_rank = ends - (counts - 1) / 2.0
    return mean_rank[inverse.ravel()]


def roc_auc(labels, scores) -> float:
    """Area under the ROC curve (Mann-Whitney U / (P N)); tied scores count one half. Local.

    Raises ValueError when ``labels`` hold only one class (AUC undefined).
    """
    y, s = _check_pair(labels, scores, "scores")
    positives = int(y.sum())
    negatives = y.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError(f"roc_auc needs both classes, got {positives} positives and "
                         f"{negatives} negatives")
    rank_sum = average_ranks(s)[y == 1].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))


def log_loss(labels, probs, eps: float = 1e-12) -> float:
    """Mean binary cross-entropy of probabilities ``probs`` clipped to [eps, 1 - eps]. Local."""
    y, p = _check_pair(labels, probs, "probs")
    if y.size == 0:
        raise ValueError("log_loss needs at least one sample, got none")
    p = np.clip(p, eps, 1.0 - eps)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log1p(-p)))
