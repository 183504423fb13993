"""bench/time_lost.py's paired estimate on hand-made run reports (the benchmark itself takes
minutes): the half interval after each checkpoint against the next, the run without checkpoints
taking out what the windows differ by anyway, the bootstrap interval and the verdict."""
import numpy as np
import pytest

from tests.bench_module import load_bench

INTERVAL, STEPS = 10, 200


@pytest.fixture(scope="module")
def bench():
    return load_bench("time_lost")


def _report(step_s, writes=None) -> dict:
    """A run report whose step s took step_s(s) seconds of loop time (ends accumulate)."""
    ends = np.cumsum([step_s(s) for s in range(1, STEPS + 1)])
    doc = {"steps": [[s, 1.0, 0.01, float(ends[s - 1])] for s in range(1, STEPS + 1)]}
    if writes is not None:
        doc["write_seconds"] = writes
    return doc


def _after_checkpoint(s: int) -> bool:
    """Step s lies in the first half interval after a checkpoint (its save call is in the first
    step's time)."""
    return s > INTERVAL and (s - 1) % INTERVAL < INTERVAL // 2


def test_the_windows_find_the_time_after_each_checkpoint_net_of_the_run_without(bench):
    rng = np.random.default_rng(1)
    jitter = {s: float(rng.normal(0, 0.001)) for s in range(1, STEPS + 1)}
    # the same periodic pattern in both runs (a slower step right after every 10th), which the
    # run without checkpoints must take out; 3 ms more per step for 5 steps after a checkpoint
    base_s = {s: 0.05 + (0.01 if s % INTERVAL == 1 else 0.0) + jitter[s] for s in jitter}
    ckpt_s = {s: base_s[s] + (0.003 if _after_checkpoint(s) else 0.0) for s in jitter}
    base, ckpt = _report(base_s.get), _report(ckpt_s.get, writes=[0.01] * 19 + [0.5])
    mine = {"window_diffs_s": bench.window_differences(ckpt, INTERVAL),
            "base_window_diffs_s": bench.window_differences(base, INTERVAL)}
    # checkpoints at 20, 30, ..., 190 (the first interval is warm-up, 200 has no windows after)
    assert len(mine["window_diffs_s"]) == STEPS // INTERVAL - bench.WARM_INTERVALS
    mean, low, high = bench.paired([mine])
    assert mean == pytest.approx(0.015, abs=0.003)
    assert low < mean < high and high - low < 0.01
    assert bench.verdict(low, high, 0.05) == "met"
    assert bench.verdict(low, high, 0.005) == "missed"
    assert bench.verdict(low, high, mean) == "not separated"
    # the 18 paired checkpoints' writes all fit in their 5-step half (the last, 0.5 s, is the
    # save at 200, which has no windows)
    assert bench.committed_within(ckpt, INTERVAL) == 1.0
    slow = _report(ckpt_s.get, writes=[0.01] * 9 + [0.5] * 11)
    assert bench.committed_within(slow, INTERVAL) == pytest.approx(8 / 18)


def test_reports_without_step_ends_give_no_paired_estimate(bench):
    old = {"steps": [[s, 1.0, 0.01] for s in range(1, STEPS + 1)]}
    mine = {"window_diffs_s": bench.window_differences(old, INTERVAL),
            "base_window_diffs_s": []}
    assert mine["window_diffs_s"] == []
    mean, low, high = bench.paired([mine])
    assert mean != mean and bench.verdict(low, high, 0.01) == "-"
