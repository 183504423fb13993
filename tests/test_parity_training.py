"""Real 4-rank training jobs that lose ranks' shards mid-run: parity rebuilds them while training
continues and the final digest equals a failure-free run's; more failures than r in a group fall
back to the latest checkpoint and the run still ends with the same digest."""
import functools

import pytest

from tests.launch import SMALL_MODEL, digest_of, resumed_step, run_ranks

STEPS = ("--num-batches", "16", "--digest")


@functools.lru_cache(maxsize=None)
def _clean(optimizer: str) -> str:
    return digest_of(run_ranks(4, "mpickpt.train", *SMALL_MODEL, *STEPS, "--optimizer", optimizer))


@pytest.mark.slow  # CI time: the next test rebuilds a later single loss exactly from XOR parity,
# and test_in_place.py's parity cases read the group's memory to the failure-free digest
def test_one_lost_rank_is_rebuilt_from_xor_parity_exactly():
    proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, *STEPS, "--parity-k", "3",
                     "--inject-failure", "7:2")
    assert digest_of(proc) == _clean("adagrad")
    assert "parity: ranks [2] lost their shards after step 7" in proc.stdout
    rebuilt = next(line for line in proc.stdout.splitlines() if "parity: rebuilt ranks [2]" in line)
    assert "reading the group's memory" in rebuilt  # all 4 ranks share this host
    assert "falling back" not in proc.stdout


@pytest.mark.slow  # CI time: r = 2 rebuilds are exact in process (tests/mpi/test_parity.py)
def test_two_lost_ranks_are_rebuilt_from_reed_solomon_parity_exactly():
    proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, *STEPS, "--parity-k", "2", "--parity-r",
                     "2", "--optimizer", "momentum", "--inject-failure", "5:0,3",
                     "--rebuild-budget", "0.01", "--rebuild-transport", "network")
    assert digest_of(proc) == _clean("momentum")
    rebuilt = next(line for line in proc.stdout.splitlines() if "rebuilt ranks [0, 3]" in line)
    assert "memory" not in rebuilt


def test_more_failures_than_r_fall_back_to_the_checkpoint(tmp_path):
    """The fallback replaces rows with a checkpoint's; parity is re-encoded from them
    (`Recovery.rows_replaced`), so a later single loss is rebuilt exactly from that parity."""
    proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, *STEPS, "--parity-k", "3",
                     "--inject-failure", "8:1,2/12:3", "--ckpt-dir", str(tmp_path / "ck"),
                     "--ckpt-interval", "5")
    assert digest_of(proc) == _clean("adagrad")
    assert "lost ranks [1, 2], more than --parity-r 1 can rebuild; falling back to the latest " \
           "checkpoint" in proc.stdout
    assert resumed_step(proc.stdout) == 5
    assert "parity: ranks [3] lost their shards after step 12" in proc.stdout
    assert "parity: rebuilt ranks [3]" in proc.stdout


def test_unrecoverable_loss_stops_with_a_clear_error(tmp_path):
    """(The bad parity flags are refused in process: tests/test_train_flags.py.)"""
    proc = run_ranks(2, "mpickpt.train", *SMALL_MODEL, *STEPS, "--parity-k", "1",
                     "--inject-failure", "3:0,1")
    assert proc.returncode == 2
    assert "more than --parity-r 1 can rebuild, and there is no checkpoint to fall back to" \
        in proc.stderr


def test_a_loss_before_the_first_checkpoint_starts_over_from_the_initial_model(tmp_path):
    """Full recovery with nothing committed yet: every rank, the dense part and the reader go back
    to the start (a pure function of the seed) and the run still ends with the clean digest."""
    proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, *STEPS, "--recovery", "full",
                     "--inject-failure", "3:1", "--ckpt-dir", str(tmp_path / "ck"),
                     "--ckpt-interval", "10")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nothing committed yet: training starts over from the initial model" in proc.stdout
    assert digest_of(proc) == _clean("adagrad")
