"""Real failures under mpiexec: a rank SIGKILLed from outside the job at a random moment, a stop
signal to every rank at a random moment, and the relaunch that follows.

- parity (4 ranks, --parity-k 3): the survivors exit within 30 s of the kill, their dumps and
  parity carry the relaunch to the failure-free digest, and at most one step is replayed;
- partial recovery (no parity): after the relaunch, the survivors' rows are their rows at the
  agreed step (the failure-free rows there) and the dead rank's rows are its checkpoint's;
- SIGTERM, SIGUSR1 and SIGINT: the emergency checkpoint's step is the step reached, the job exits
  75, and the resumed run ends with the uninterrupted digest; when that checkpoint cannot be
  written (a full disk), the job says so, names the last valid checkpoint and exits 74.
Each trial asserts that its kill or signal happened (the process was alive and is gone, the job
said so)."""
import os
import random
import re
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from mpickpt.exit_codes import EXIT_SAVED
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.store.manifest import list_manifests
from mpickpt.survivors.dump import job_key
from tests.fault_jobs import (OPEN_MPI, Job, digest_in, mpickpt_run, open_mpi_skip,
                              relaunch_step, survivor_steps)
from tests.launch import SMALL_MODEL, digest_of, run_ranks

STEPS, INTERVAL = 100, 30
FOLLOW = ("--print-freq", "1", "--ckpt-interval", str(INTERVAL), "--survivor-dumps", "shm",
          "--in-place", "off")  # the relaunch path (in-place recovery: tests/test_in_place.py)
PARITY = ("--parity-k", "3")
TABLES = (300, 200, 100, 50)


@pytest.fixture(scope="module")
def parity_reference():
    proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, *PARITY, "--num-batches", str(STEPS),
                     "--digest")
    return digest_of(proc)


def parity_trial(ckpt, seed: int, reference: str) -> None:
    """One randomized trial: kill a random rank at a random moment, relaunch, compare."""
    rng = random.Random(seed)
    target = rng.randint(8, STEPS - 12)
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--", *SMALL_MODEL, *FOLLOW,
                          *PARITY, "--num-batches", str(STEPS), "--digest", "--ckpt-dir",
                          str(ckpt)))
    try:
        assert job.wait_for_step(target), job.output
        time.sleep(rng.uniform(0.0, 0.03))  # anywhere inside a step
        rank, exited, code = job.kill_one_and_wait(rng.choice)
    finally:
        job.stop()
    out = job.output
    assert code == 0, out[-4000:]
    assert f"rank(s) [{rank}] died after step" in out  # the kill happened and was seen
    assert "relaunching (restart 1 of 1)" in out and "run 2 finished" in out
    steps = survivor_steps(out)
    assert sorted(steps) == sorted(set(range(4)) - {rank}), out[-4000:]
    agreed = relaunch_step(out)
    assert agreed == min(steps.values()) and max(steps.values()) - agreed <= 1, (steps, agreed)
    assert f"rank {rank} lost" in out and f"parity: rebuilt ranks [{rank}]" in out
    assert digest_in(out) == reference
    assert exited < 30
    dropped = re.search(rf"survivor dumps of step {agreed} removed: (checkpoint step (\d+) "
                        rf"committed|the job completed)", out)
    assert dropped, out[-3000:]  # once a newer checkpoint committed, else at the job's end
    if agreed < STEPS // INTERVAL * INTERVAL:
        assert int(dropped.group(2)) > agreed and int(dropped.group(2)) % INTERVAL == 0
    assert not os.path.exists(f"/dev/shm/mpickpt-survivors-{job_key(str(ckpt))}")
    with open(os.path.join(ckpt, "mpickpt-restarts.log")) as f:
        assert f"rank(s) [{rank}] died" in f.read()


@pytest.mark.slow  # CI time: CI relaunches from survivor dumps in the partial-recovery test below
@pytest.mark.parametrize("seed", [11])  # and rebuilds from parity in place (test_in_place.py)
def test_parity_relaunch_after_a_random_sigkill(tmp_path, parity_reference, seed):
    parity_trial(tmp_path / "ckpt", seed, parity_reference)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100, 120))
def test_parity_relaunch_after_a_random_sigkill_many(tmp_path, parity_reference, seed):
    parity_trial(tmp_path / "ckpt", seed, parity_reference)


def _export(ckpt, step: int, out) -> h5py.File:
    subprocess.run([sys.executable, "-m", "mpickpt.cli", "export", str(ckpt), "--step",
                    str(step), "-o", str(out), "--with-optimizer"], check=True)
    return h5py.File(out, "r")


def _rows(f: h5py.File, table: int) -> np.ndarray:
    """A table's weights with its sparse optimizer state beside them."""
    state = [f[f"optimizer/table_{table}/{k}"][...].reshape(TABLES[table], -1)
             for k in sorted(f[f"optimizer/table_{table}"])]
    return np.concatenate([f[f"embeddings/table_{table}"][...], *state], axis=1)


def test_partial_recovery_after_a_sigkill_and_relaunch(tmp_path):
    rng = random.Random(5)
    ckpt, ref = tmp_path / "ckpt", tmp_path / "ref"
    flags = (*SMALL_MODEL, *FOLLOW, "--recovery", "partial", "--ckpt-dir", str(ckpt))
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "0", "--", *flags,
                          "--num-batches", str(STEPS)))
    try:  # a kill well past the first checkpoint, so the dead rank's shard has changed since
        assert job.wait_for_step(INTERVAL + rng.randint(5, INTERVAL - 8))
        pid, rank = job.kill_rank(pick=rng.choice)
        assert job.wait(120) != 0
    finally:
        job.stop()
    assert survivor_steps(job.output), job.output[-3000:]
    # mpickpt-run, out of restarts, says where the dumps the hand relaunch below uses stay
    assert re.search(r"mpickpt-run: 3 survivor dump\(s\), [0-9.]+ MB, stay in /dev/shm/mpickpt-"
                     r"survivors-[0-9a-f]{16} on this node", job.output), job.output[-3000:]
    agreed = min(survivor_steps(job.output).values())
    committed = max(m.step for m in list_manifests(str(ckpt)))
    assert committed < agreed, (committed, agreed)
    # the relaunch, by hand: it stops at the agreed step and checkpoints what it recovered
    proc = run_ranks(4, "mpickpt.train", *flags, "--num-batches", str(agreed), "--ckpt-final")
    assert proc.returncode == 0, proc.stderr
    assert f"rank {rank} lost" in proc.stdout and "partial recovery" in proc.stdout
    proc = run_ranks(4, "mpickpt.train", *SMALL_MODEL, "--num-batches", str(agreed),
                     "--ckpt-dir", str(ref), "--ckpt-interval", str(10 ** 6), "--ckpt-final")
    assert proc.returncode == 0, proc.stderr
    got, want, old = (_export(d, s, tmp_path / f"{n}.h5") for d, s, n in
                      ((ckpt, agreed, "got"), (ref, agreed, "want"), (ckpt, committed, "old")))
    plan = ShardPlan.build(TABLES, 4)
    assert plan.describe() == list_manifests(str(ckpt))[-1].plan
    dead = np.zeros(plan.total_rows, dtype=bool)
    dead[plan.rank_global_ids(rank)] = True
    offsets = np.cumsum((0,) + TABLES)
    changed = 0
    for t in range(len(TABLES)):
        mine = dead[offsets[t]:offsets[t + 1]]
        g, w, o = _rows(got, t), _rows(want, t), _rows(old, t)
        np.testing.assert_array_equal(g[~mine], w[~mine])  # survivors: as at the agreed step
        np.testing.assert_array_equal(g[mine], o[mine])  # the dead rank: its checkpoint
        changed += int((w[mine] != o[mine]).any(axis=1).sum())
    assert changed > 0  # the dead rank's rows did change after the checkpoint: not vacuous
    for name in want["dense"]:
        np.testing.assert_array_equal(got[f"dense/{name}"][...], want[f"dense/{name}"][...])


@pytest.fixture(scope="module")
def uninterrupted():
    return digest_of(run_ranks(2, "mpickpt.train", *SMALL_MODEL, "--num-batches", str(STEPS),
                               "--digest"))


def stop_trial(tmp_path, sig: int, seed: int, uninterrupted: str) -> None:
    """One randomized trial: `sig` to every rank at a random moment; the emergency checkpoint
    holds the step reached, the job exits 75, and the resumed run ends uninterrupted."""
    rng = random.Random(seed)
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.json"
    flags = (*SMALL_MODEL, *FOLLOW, "--ckpt-dir", str(ckpt), "--num-batches", str(STEPS),
             "--digest")
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "0", "--", *flags, "--run-report",
                          str(report)))
    try:
        assert job.wait_for_step(rng.randint(5, STEPS - 10))
        time.sleep(rng.uniform(0.0, 0.03))
        signalled = job.signal_ranks(sig)
        code = job.wait(120)
    finally:
        job.stop()
    name = signal.Signals(sig).name
    assert len(signalled) == 2 and code == 75, job.output[-3000:]
    m = re.search(rf"stopping on {name} after step (\d+): checkpoint step (\d+) "
                  r"(?:\(the interval's\) )?committed ([0-9.]+) s after the signal", job.output)
    assert m, job.output[-3000:]
    reached = job.step
    assert int(m.group(1)) == int(m.group(2)) == reached
    assert max(s.step for s in list_manifests(str(ckpt))) == reached
    assert "stopped on a signal with its checkpoint committed" in job.output  # mpickpt-run
    resumed = run_ranks(2, "mpickpt.train", *flags)
    assert f"resumed from checkpoint step {reached}" in resumed.stdout, resumed.stdout
    assert digest_of(resumed) == uninterrupted


# SIGUSR1 (`--signal=USR1@T`, the time limit's warning) in CI: SIGTERM runs in CI through the
# Slurm tests (scancel --signal=TERM, scontrol requeue); every signal here under slow.
def _signals(pairs):
    return [pytest.param(sig, seed, id=f"{sig.name}-{seed}") for sig, seed in pairs]


@pytest.mark.parametrize("sig,seed", _signals([(signal.SIGUSR1, 7)]))
def test_a_stop_signal_at_a_random_moment_commits_the_step_reached(tmp_path, uninterrupted,
                                                                   sig, seed):
    stop_trial(tmp_path, sig, seed, uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("sig,seed", _signals([(s, seed) for seed in (21, 22) for s in (
    signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)]))
def test_a_stop_signal_at_a_random_moment_commits_the_step_reached_many(tmp_path,
                                                                        uninterrupted, sig, seed):
    stop_trial(tmp_path, sig, seed, uninterrupted)


def test_a_stop_whose_checkpoint_cannot_be_written_says_so_and_exits_74(small_tmpfs):
    """The default model's checkpoint (1.1 MB) fits the 1.7 MB tmpfs once: step 10's commits
    and stays (retention deletes only after a newer commit), so no emergency checkpoint can."""
    ckpt = small_tmpfs / "ckpt"
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "0", "--", "--num-batches", "2000",
                          "--mini-batch-size", "32", "--print-freq", "1", "--test-num-batches",
                          "0", "--ckpt-dir", str(ckpt), "--ckpt-interval", "10",
                          "--ckpt-keep", "1"))
    try:
        assert job.wait_for_step(12)
        deadline = time.monotonic() + 60
        while "checkpoint step 10 committed" not in job.output:
            assert time.monotonic() < deadline and job.proc.poll() is None, job.output[-3000:]
            time.sleep(0.05)
        signalled = job.signal_ranks(signal.SIGINT)
        code = job.wait(120)
    finally:
        job.stop()
    out = job.output
    assert len(signalled) == 2 and code == 74, out[-3000:]
    m = re.search(r"stopping on SIGINT after step (\d+): the emergency checkpoint of step \d+ "
                  r"FAILED .*the last valid checkpoint in (\S+): step (\d+); exit status 74",
                  out)
    assert m, out[-3000:]
    step = int(m.group(1))
    assert step > 10 and m.group(2) == str(ckpt) and int(m.group(3)) == 10
    assert f"checkpoint step {step} committed" not in out
    assert "No space left on device" in out
    assert "stopped on a signal but its emergency checkpoint failed" in out  # mpickpt-run
    assert [s.step for s in list_manifests(str(ckpt))] == [10]


@pytest.mark.slow
def test_survivors_exit_and_the_relaunch_recovers_under_open_mpi(tmp_path, parity_reference):
    """--in-place off: Open MPI's mpirun kills the job when a rank exits with a failure status
    (SIGTERM, then SIGKILL): the survivors dump first, and mpickpt-run relaunches to the
    failure-free digest. (In place, the default, is tests/test_in_place.py's.)"""
    reason = open_mpi_skip()
    if reason:
        pytest.skip(reason)
    rng = random.Random(3)
    job = Job(mpickpt_run("-n", "4", "--max-restarts", "1", "--launcher-path", OPEN_MPI,
                          "--launcher-arg=--allow-run-as-root", "--launcher-arg=--oversubscribe",
                          "--", *SMALL_MODEL, *FOLLOW, *PARITY, "--num-batches", str(STEPS),
                          "--digest", "--ckpt-dir", str(tmp_path / "ckpt"), "--in-place", "off"),
              env=dict(os.environ, MPI4PY_MPIABI="openmpi"))
    try:
        assert job.wait_for_step(rng.randint(10, STEPS - 20))
        rank, exited, code = job.kill_one_and_wait(rng.choice)
    finally:
        job.stop()
    out = job.output
    assert code == 0 and exited < 30, out[-4000:]
    assert f"rank(s) [{rank}] died after step" in out and "relaunching (restart 1 of 1)" in out
    assert digest_in(out) == parity_reference


def test_a_second_ctrl_c_to_mpickpt_run_leaves_no_trainer_and_no_staging_area(tmp_path):
    """Hydra, told to stop twice, kills its ranks and leaves at once: the trainers are zombies
    of init when mpickpt-run removes what they left (their staging areas were kept as a live
    process's before), so no trainer and no staging area outlives it."""
    from mpickpt.owned_names import running
    from tests.launch import descendants

    job = Job(mpickpt_run("-n", "2", "--max-restarts", "0", "--", *SMALL_MODEL, *FOLLOW,
                          "--num-batches", "400", "--ckpt-dir", str(tmp_path / "ckpt")))
    try:
        assert job.wait_for_step(15), job.output
        run = [pid for pid, _ in descendants(job.proc.pid)]  # agents, trainers, writers
        areas = [n for n in os.listdir("/dev/shm")
                 if any(n.startswith(f"mpickpt-staging-{p}-") for p in run)]
        assert len(areas) == 2, (run, areas)  # one per trainer
        job.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # a second Ctrl-C: not the first one relayed (relaunch.RELAYED_S)
        job.proc.send_signal(signal.SIGINT)
        job.wait(60)
    finally:
        job.stop()
    assert not [p for p in run if running(p)], job.output  # zombies hold no memory
    assert not [n for n in areas if os.path.exists(f"/dev/shm/{n}")], job.output


def test_one_sigint_to_mpickpt_runs_process_group_stops_the_job_with_its_checkpoint(tmp_path):
    """A terminal's Ctrl-C reaches its whole foreground process group, and so does a SIGINT to
    mpickpt-run's group: the launcher, in a group of its own, hears of it once, from mpickpt-run
    (hydra took the second delivery for a forced abort in 2 of 5 tries before), and the same
    SIGINT relayed to mpickpt-run a second time (as `timeout` in the group does) is forwarded
    once. The job ends with the emergency checkpoint and status 75."""
    ckpt = tmp_path / "ckpt"
    job = Job(mpickpt_run("-n", "2", "--max-restarts", "0", "--", *SMALL_MODEL, *FOLLOW,
                          "--num-batches", "400", "--ckpt-dir", str(ckpt)))
    try:
        assert job.wait_for_step(15), job.output
        os.killpg(job.proc.pid, signal.SIGINT)
        job.proc.send_signal(signal.SIGINT)  # the same Ctrl-C, relayed
        code = job.wait(120)
    finally:
        job.stop()
    stopped = re.search(r"stopping on SIGINT after step (\d+)", job.output)
    assert code == EXIT_SAVED and stopped, job.output
    assert [m.step for m in list_manifests(str(ckpt))][-1] == int(stopped.group(1))
