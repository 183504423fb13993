"""Partial recovery in real jobs: the reader never replays or skips a sample, the PLS is logged,
recorded in the manifests and continued by a resumed job; `--recovery auto` picks parity, partial
or full recovery as its inputs say; prioritized saves and the failure emulator run end to end."""
import re

import pytest

from mpickpt.store.manifest import list_manifests
from tests.launch import SMALL_MODEL, read_trace, resumed_step, run_ranks

STEPS = 30


@pytest.fixture(scope="module")
def straight_trace(tmp_path_factory):
    trace = tmp_path_factory.mktemp("straight") / "trace"
    proc = run_ranks(2, "mpickpt.train", *SMALL_MODEL, "--num-batches", str(STEPS),
                     "--trace-samples", str(trace))
    assert proc.returncode == 0, proc.stderr
    return read_trace(trace)


def _steps_in_order(path) -> list[int]:
    """The steps of the trace in the order they were trained (a replay shows a step again)."""
    return [int(line.split(" ", 1)[0]) for line in path.read_text().splitlines()]


def _pls(stdout: str) -> float:
    return float(re.findall(r"PLS \+[0-9.]+ = ([0-9.]+)", stdout)[-1])


def test_partial_recovery_replays_nothing_and_carries_its_pls(tmp_path, straight_trace):
    ckpt, trace = tmp_path / "ckpt", tmp_path / "trace"
    args = (*SMALL_MODEL, "--ckpt-dir", str(ckpt), "--ckpt-interval", "10", "--recovery",
            "partial", "--trace-samples", str(trace))
    proc = run_ranks(2, "mpickpt.train", *args, "--num-batches", str(STEPS), "--inject-failure",
                     "15:1")
    assert proc.returncode == 0, proc.stderr
    assert "ranks [1] lost their shards after step 15" in proc.stdout
    assert "reloaded from checkpoint step 10" in proc.stdout
    assert resumed_step(proc.stdout) is None  # nothing rolled back
    got = read_trace(trace)
    assert _steps_in_order(trace) == list(range(1, STEPS + 1))  # no replayed or skipped step
    assert got == straight_trace  # ... nor sample: the reader positions are the failure-free run's
    # eq. 3 by hand: rank 1 holds 300 of the 650 rows (tables 300-200-100-50 over 2 ranks)
    share = 300 / 650
    expected = share * (15 - 10) / STEPS
    assert _pls(proc.stdout) == pytest.approx(expected, abs=2e-5), proc.stdout
    pls = {m.step: m.stats["pls"]["value"] for m in list_manifests(str(ckpt))}
    assert pls[30] == pytest.approx(expected, abs=1e-9) and pls[20] == pls[30]
    resumed = run_ranks(2, "mpickpt.train", *args, "--num-batches", "40")
    assert resumed_step(resumed.stdout) == 30
    assert re.search(rf"PLS {expected:.5f} after 1 partial recoveries", resumed.stdout), \
        resumed.stdout
    assert list_manifests(str(ckpt))[-1].stats["pls"]["value"] == pytest.approx(expected)


@pytest.mark.slow  # CI time: the 2-rank test above replays nothing either, and
# test_real_failures.py recovers a real death's shard partially on 4 ranks, row by row
def test_partial_recovery_of_a_middle_rank_on_4_ranks_replays_nothing(tmp_path):
    steps, common = 12, (*SMALL_MODEL, "--num-batches", "12")
    straight, trace = tmp_path / "straight", tmp_path / "trace"
    proc = run_ranks(4, "mpickpt.train", *common, "--trace-samples", str(straight))
    assert proc.returncode == 0, proc.stderr
    proc = run_ranks(4, "mpickpt.train", *common, "--ckpt-dir", str(tmp_path / "ckpt"),
                     "--ckpt-interval", "4", "--recovery", "partial", "--inject-failure", "6:1",
                     "--trace-samples", str(trace))
    assert proc.returncode == 0, proc.stderr
    assert "ranks [1] lost their shards after step 6" in proc.stdout, proc.stdout
    assert "reloaded from checkpoint step 4" in proc.stdout and resumed_step(proc.stdout) is None
    assert _steps_in_order(trace) == list(range(1, steps + 1))  # no replayed or skipped step
    assert read_trace(trace) == read_trace(straight)  # the failure-free run's reader positions


@pytest.mark.parametrize("case", ["parity", "partial", "full", "fixed"])
def test_recovery_auto_picks_what_its_inputs_say(tmp_path, case):
    common = ("--ckpt-dir", str(tmp_path / "ckpt"), "--recovery", "auto")
    if case == "fixed":  # the user's interval: both modes weighed there, after every save
        proc = run_ranks(2, "mpickpt.train", *SMALL_MODEL, *common, "--mtbf", "100",
                         "--ckpt-interval", "4", "--num-batches", "16", "--inject-failure",
                         "10:1")
        decided = re.search(r"recovery auto: (\w+) recovery for this loss \((.*)\)",
                            proc.stdout)
        assert decided and "at the fixed interval 4 steps" in decided.group(2), proc.stdout
        assert "nothing measured yet" not in proc.stdout
        return
    if case == "parity":
        proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, *common, "--mtbf", "100",
                         "--num-batches", "16", "--parity-k", "3", "--inject-failure", "8:2")
        assert "parity: ranks [2] lost their shards after step 8" in proc.stdout, proc.stdout
        assert "parity: rebuilt ranks [2]" in proc.stdout  # (exactly: test_parity_training.py)
        assert "recovery for this loss" not in proc.stdout  # parity covered it
        return
    # partial pays at a PLS target of 0.1 with MTBF 100 steps (its 40-step interval wins for any
    # O_save under 25 steps); a target of 1e-7 with MTBF 1e6 steps means a checkpoint every step,
    # O_save per step, against full recovery's sqrt(2 O_save / T_fail): full recovery wins for any
    # O_save above 2e-6 steps, whatever this machine measures
    pls, mtbf = ("0.1", "100") if case == "partial" else ("1e-7", "1000000")
    proc = run_ranks(2, "mpickpt.train", *SMALL_MODEL, *common, "--mtbf", mtbf, "--target-pls",
                     pls, "--num-batches", "20", "--inject-failure", "12:1")
    assert proc.returncode == 0, proc.stderr
    decided = re.search(r"recovery auto: (\w+) recovery for this loss \((.*)\)", proc.stdout)
    assert decided and decided.group(1) == case, proc.stdout
    assert "O_save" in decided.group(2) and "T_fail" in decided.group(2)  # logged with inputs
    if case == "partial":
        assert "partial recovery:" in proc.stdout and resumed_step(proc.stdout) is None
    else:
        assert resumed_step(proc.stdout) is not None and "partial recovery:" not in proc.stdout


def test_prioritized_saves_and_emulated_failures_end_to_end(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_ranks(2, "mpickpt.train", "--arch-embedding-size", "3000-2000-1000-500",
                     "--arch-sparse-feature-size", "8", "--arch-mlp-bot", "13-16-8",
                     "--arch-mlp-top", "16-1", "--mini-batch-size", "64", "--print-freq", "0",
                     "--test-num-batches", "2", "--num-batches", "120", "--ckpt-dir", str(ckpt),
                     "--ckpt-priority", "scar", "--ckpt-save-fraction", "0.25",
                     "--ckpt-interval", "5", "--recovery", "partial", "--failure-model",
                     "exponential:40", "--failure-fraction", "0.125", "--failure-seed", "3")
    assert proc.returncode == 0, proc.stderr
    fired = re.findall(r"shards (\d)\[(\d+):(\d+)\) lost their shards after step (\d+)",
                       proc.stdout)
    assert fired and all(int(b) - int(a) in (750, 875) for _, a, b, _ in fired)  # 1/8 of rows
    assert "prioritized saves (scar, r = 0.25)" in proc.stdout and "tracker memory" in proc.stdout
    kinds = {m.kind for m in list_manifests(str(ckpt))}
    assert kinds == {"full", "priority"} or kinds == {"priority"}, kinds
    assert f"{len(fired)} failures in 120 executed steps" in proc.stdout
