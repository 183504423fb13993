"""bench/partial_recovery.py's metrics on hand-made series (the benchmark itself takes 35 minutes):
SCAR's rework, whose smoothing must not start the run as back on track, and the PLS-AUC
correlation, against the AUC loss as CPR reports it."""
import pytest

from tests.bench_module import load_bench



@pytest.fixture(scope="module")
def bench():
    return load_bench("partial_recovery")


def _report(losses: dict[int, float], after_step: int, executed_before: int) -> dict:
    """A run report: `executed_before` steps on the failure-free loss 1.0, a failure after
    `after_step`, then steps (in execution order) with the given losses."""
    steps = [[s, 1.0, 0.01] for s in range(1, executed_before + 1)]
    steps += [[s, loss, 0.01] for s, loss in losses.items()]
    return {"steps": steps, "recoveries": [{"after_step": after_step,
                                            "executed": executed_before}]}


CLEAN = {"steps": [[s, 1.0, 0.01] for s in range(1, 201)]}


def test_rework_does_not_count_the_first_step_back_within_one_percent(bench):
    # partial recovery after step 50: the loss stays 0.9 % above the failure-free one. A moving
    # average started at 0 read 0.09 % at the first step (under the 0.1 % tolerance): rework 1
    above = _report({s: 1.009 for s in range(51, 201)}, 50, 50)
    assert bench.rework(above, CLEAN) == [150]  # never back: cut at the end of the run
    # 0.5 % above for two steps, then on track: the bias-corrected average of (0.005, 0.005, 0,
    # ...) is 0.00107 after 7 steps and 0.00089 after 8
    two = {s: 1.005 if s <= 52 else 1.0 for s in range(51, 201)}
    assert bench.rework(_report(two, 50, 50), CLEAN) == [8]
    # on the failure-free loss at once: one step
    assert bench.rework(_report({s: 1.0 for s in range(51, 201)}, 50, 50), CLEAN) == [1]


def test_rework_of_a_rollback_counts_its_replayed_steps(bench):
    # full rollback after step 50 to the checkpoint of step 40: steps 41..50 replay exactly
    replay = _report({s: 1.0 for s in range(41, 201)}, 50, 50)
    assert bench.rework(replay, CLEAN) == [10]
    # two failures: the first one's count is cut at the second
    steps = [[s, 1.0, 0.01] for s in range(1, 51)] + [[s, 1.02, 0.01] for s in range(51, 61)] \
        + [[s, 1.0, 0.01] for s in range(61, 201)]
    two = {"steps": steps, "recoveries": [{"after_step": 50, "executed": 50},
                                          {"after_step": 55, "executed": 55}]}
    # the second: 2 % above for steps 56..60, then on track; the average of five 0.02 and k
    # zeros is 0.0081902 x 0.9^k / (1 - 0.9^(5 + k)): 0.00107 at k = 20, 0.00096 at k = 21
    assert bench.rework(two, CLEAN) == [5, 5 + 21]


def test_pls_auc_correlation_is_against_the_auc_loss(bench):
    # more lost samples, lower AUC: CPR's positive correlation
    rows = [{"config": "vanilla@0.1", "pls_values": [0.01, 0.05, 0.1, 0.2],
             "auc_deltas": [-0.0001, -0.0004, -0.0009, -0.002]},
            {"config": "full", "pls_values": [0.0, 0.0], "auc_deltas": [0.01, -0.01]}]
    r = bench.pls_auc_loss_correlation(rows)
    assert 0.99 < r <= 1.0
    rows[0]["auc_deltas"] = [-d for d in rows[0]["auc_deltas"]]  # more PLS, better AUC
    assert bench.pls_auc_loss_correlation(rows) == pytest.approx(-r)
    assert bench.pls_auc_loss_correlation([{**rows[0], "pls_values": [0.1, 0.2],
                                            "auc_deltas": [0.0, 0.1]}]) is None  # two runs
    assert bench.verdict([{**rows[0], "fraction": 0.25}])["pls_auc_loss_correlation"] == \
        pytest.approx(-r)
