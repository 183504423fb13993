"""Rank-based ROC AUC and log loss against hand-computed values."""
import math

import numpy as np
import pytest

from mpickpt.data.metrics import average_ranks, log_loss, roc_auc


def test_average_ranks_share_ties():
    assert average_ranks([10, 20, 20, 5]).tolist() == [2.0, 3.5, 3.5, 1.0]


def test_auc_perfect_inverted_and_hand_computed():
    assert roc_auc([0, 0, 1, 1], [0.1, 0.2, 0.8, 0.9]) == 1.0
    assert roc_auc([1, 1, 0, 0], [0.1, 0.2, 0.8, 0.9]) == 0.0
    # pairs (pos, neg): (0.35, 0.1) win, (0.35, 0.4) loss, (0.8, 0.1) win, (0.8, 0.4) win -> 3/4
    assert roc_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.75)


def test_auc_ties_count_half():
    # pos 0.5 vs neg 0.5 tie (1/2), pos 0.5 vs neg 0.2 win (1), pos 0.9 wins both (2) -> 3.5/4
    assert roc_auc([1, 0, 0, 1], [0.5, 0.5, 0.2, 0.9]) == pytest.approx(0.875)
    assert roc_auc([0, 1, 0, 1], [3, 3, 3, 3]) == pytest.approx(0.5)


def test_auc_matches_pair_count():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 300)
    s = rng.integers(0, 10, 300).astype(float)  # many ties
    pos, neg = s[y == 1], s[y == 0]
    diff = pos[:, None] - neg[None, :]
    expected = ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size
    assert roc_auc(y, s) == pytest.approx(expected)


def test_auc_rejects_single_class_and_bad_labels():
    with pytest.raises(ValueError, match="both classes"):
        roc_auc([1, 1], [0.2, 0.3])
    with pytest.raises(ValueError, match="0 or 1"):
        roc_auc([0, 2], [0.2, 0.3])
    with pytest.raises(ValueError, match="same length"):
        roc_auc([0, 1], [0.2])


def test_log_loss_hand_computed_and_clipped():
    expected = -(math.log(0.8) + math.log(1 - 0.4)) / 2
    assert log_loss([1, 0], [0.8, 0.4]) == pytest.approx(expected)
    assert log_loss([1, 0], [1.0, 0.0]) == pytest.approx(0.0, abs=1e-9)
    assert math.isfinite(log_loss([1], [0.0]))
