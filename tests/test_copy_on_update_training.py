"""Copy-on-update snapshots in real 2-rank training jobs (`--ckpt-snapshot copy-on-update`, the
copier slowed by `--inject-slow-copy` so that a checkpoint's rows stay pending across steps):

- a rank SIGKILLed right after a checkpoint started (its rows still pending or being copied)
  leaves that checkpoint uncommitted and the previous one the newest; the relaunch resumes from
  it, and a SIGTERM while the relaunch's first checkpoint is still being copied stops the job
  (exit 75) with a committed checkpoint of the step reached, from which a second relaunch ends
  with the uninterrupted digest;
- (slow) the survivor of such a kill dumps its state (`--survivor-dumps shm`, under mpickpt-run)
  while its own copy is in flight: nothing of that checkpoint commits, and the relaunch restores
  the survivor from its dump, rebuilds the dead rank from parity and ends with the uninterrupted
  digest. (CI: the same in process, tests/mpi/test_copy_on_update.py.)
(Byte equality with stop-the-world copies under every kind, with parity: tests/mpi/
test_copy_on_update.py.)"""
import re
import signal

import pytest

from mpickpt.store.manifest import list_manifests
from tests.fault_jobs import Job, digest_in, mpickpt_run, survivor_steps
from tests.launch import SMALL_MODEL, digest_of, resumed_step, run_ranks

RUN = (*SMALL_MODEL, "--num-batches", "24", "--digest")
SLOW = ("--inject-slow-copy", "0.02")
"""About 0.45 s per checkpoint's rows here (350 and 300 rows a rank, 16 rows a chunk)."""


@pytest.fixture(scope="module")
def uninterrupted():
    return digest_of(run_ranks(2, "mpickpt.train", *RUN))


def test_a_kill_or_a_stop_signal_during_the_copy_keeps_the_previous_checkpoint_and_resumes(
        tmp_path, uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    args = (*RUN, "--ckpt-dir", ckpt, "--ckpt-interval", "4", "--ckpt-kind", "incrcp",
            "--ckpt-snapshot", "copy-on-update")
    killed = run_ranks(2, "mpickpt.train", *args, *SLOW, "--inject-kill", "12:1")
    assert killed.returncode != 0 and "digest" not in killed.stdout, killed.stdout
    steps = sorted(m.step for m in list_manifests(ckpt))
    # the checkpoint being copied never commits (8's commit may still have been in flight)
    assert 12 not in steps and steps[-1] in (4, 8), steps
    # the relaunch resumes from it; SIGTERM once its first checkpoint (12) started copying
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "0", "--", *args, *SLOW, "--in-place",
                          "off"))  # mpickpt-run: the exit status 75 of both ranks, as is
    try:
        assert job.wait_for_line(r"^checkpoint step 12 \("), job.output[-3000:]
        signalled = job.signal_ranks(signal.SIGTERM)
        code = job.wait(120)
    finally:
        job.stop()
    out = job.output
    assert resumed_step(out) == steps[-1], out[-3000:]
    stopped = re.search(r"stopping on SIGTERM after step (\d+): checkpoint step (\d+) "
                        r"(?:\(the interval's\) )?committed", out)
    assert len(signalled) == 2 and code == 75 and stopped, out[-3000:]
    step = int(stopped.group(1))
    assert int(stopped.group(2)) == step and 12 < step <= 24, out[-3000:]
    # a copy was in flight at the stop: the interval's own (its step), else the stop's checkpoint
    # waited for the previous one
    assert step % 4 == 0 or f"checkpoint step {step}: waited" in out, out[-3000:]
    assert max(m.step for m in list_manifests(ckpt)) == step
    resumed = run_ranks(2, "mpickpt.train", *args)
    assert resumed_step(resumed.stdout) == step, resumed.stdout
    assert digest_of(resumed) == uninterrupted


@pytest.mark.slow  # CI time (about 11 s): tests/mpi/test_copy_on_update.py has it in process
def test_a_survivor_dump_during_the_copy_commits_nothing_and_resumes_exactly(tmp_path,
                                                                           uninterrupted):
    ckpt = str(tmp_path / "ckpt")
    # mpickpt-run: hydra alone would kill the survivor before its dump; --in-place off: the
    # survivor dumps and exits, and the relaunch restores it
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "1", "--", *RUN, "--ckpt-dir", ckpt,
                          "--ckpt-interval", "4", "--ckpt-snapshot", "copy-on-update",
                          "--survivor-dumps", "shm", "--in-place", "off", "--parity-k", "1",
                          *SLOW, "--inject-kill", "12:1"))
    try:
        code = job.wait(120)
    finally:
        job.stop()
    out = job.output
    assert code == 0 and "relaunching (restart 1 of 1)" in out, out[-3000:]
    first, second = out.split("relaunching (restart 1 of 1)", 1)
    # rank 0 dumped step 12 while its rows of checkpoint 12 were still being copied: nothing of
    # that checkpoint committed, the previous one stayed the newest
    assert survivor_steps(first) == {0: 12}, first[-3000:]
    assert "survivor state of step 12 dumped" in first, first[-3000:]
    assert "checkpoint step 8 (" in first and "checkpoint step 12 committed" not in first
    assert "ranks [0] restored from their survivor dumps at step 12" in second, second
    assert "parity: rebuilt ranks [1]" in second and resumed_step(second) is None, second
    assert digest_in(second) == uninterrupted
    assert sorted(m.step for m in list_manifests(ckpt))[-1] == 24
