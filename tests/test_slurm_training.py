"""slurm/train.sbatch as shipped, on a real single-node Slurm cluster (tests/slurm_cluster.py):
a 2-rank job trains to the same digest as `mpiexec -n 2`, and with no MPI plugin
(SRUN_MPI=none) it stops at the launch check with exit 2; `scontrol requeue` mid-run resumes to the
uninterrupted digest; `scancel --signal=TERM` commits an emergency checkpoint at the step reached
and the job's own requeue replays no step; a rank SIGKILLed under srun is replaced in place by its
agent (the survivors keep their processes; with --in-place off, slow: relaunched inside the
allocation) and the job ends with the failure-free digest (parity on). Skipped with the reason
where Slurm is not installed or this is not root."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpickpt.store.manifest import list_manifests
from tests.fault_jobs import digest_in, rank_of, relaunch_step, wait_gone
from tests.launch import REPO, digest_of, run_ranks
from tests.slurm_cluster import slurm_cluster_fixture

slurm = slurm_cluster_fixture(scope="module")
SCRIPT = REPO / "slurm" / "train.sbatch"
MODEL_ENV = {"EMBEDDINGS": "300-200-100-50", "EMB_DIM": "8", "MLP_BOT": "13-16-8",
             "MLP_TOP": "16-1", "BATCH": "32", "LR": "0.05", "OPTIMIZER": "adagrad",
             "BACKEND": "auto", "DATA": "synthetic", "OMP_NUM_THREADS": "1"}
TRAIN_ARGS = ("--test-num-batches", "0", "--print-freq", "1", "--digest")


def trainer_flags(steps: int) -> list[str]:
    """The flags the script gives mpickpt-train for MODEL_ENV (for the mpiexec reference)."""
    return ["--arch-embedding-size", "300-200-100-50", "--arch-sparse-feature-size", "8",
            "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--mini-batch-size", "32",
            "--num-batches", str(steps), "--learning-rate", "0.05", "--optimizer", "adagrad",
            "--backend", "auto", "--data-generation", "synthetic", *TRAIN_ARGS]


def submit(slurm, tmp_path, ranks: int, steps: int, *args: str, **env) -> tuple[int, Path]:
    out = tmp_path / "job.out"
    job_env = dict(MODEL_ENV, VENV=str(Path(sys.executable).parents[1]),
                   NUM_BATCHES=str(steps), CKPT_DIR=str(tmp_path / "ckpt"),
                   PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    job_env.update(env)
    job = slurm.sbatch(SCRIPT, "-N", "1", f"--ntasks={ranks}", f"--ntasks-per-node={ranks}",
                       "--cpus-per-task=1",
                       f"--output={out}", "--time=10", script_args=[*TRAIN_ARGS, *args],
                       env=job_env)
    return job, out


def wait_for(out: Path, pattern: str, timeout: float = 120) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(pattern, out.read_text(), re.M) if out.exists() else None
        if m:
            return m
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in {out} after {timeout} s:\n"
                         + (out.read_text()[-3000:] if out.exists() else "<missing>"))


def last_step(text: str) -> int:
    return max(int(s) for s in re.findall(r"^step (\d+)/", text, re.M))


def trainer_pids(ckpt: Path) -> list[int]:
    """The job's trainer processes (found by their checkpoint directory on the command line; not
    srun, not the tasks' agents)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if " -m mpickpt.train " in cmd and str(ckpt) in cmd and "multiprocessing" not in cmd \
                and "rank_wrapper" not in cmd \
                and os.path.basename(cmd.split()[0]).startswith("python"):  # not srun
            pids.append(int(entry))
    return sorted(pids)


@pytest.fixture(scope="module")
def reference():
    """Failure-free digests under mpiexec, by (ranks, steps, parity)."""
    cache = {}

    def digest(ranks: int, steps: int, *extra: str) -> str:
        key = (ranks, steps, extra)
        if key not in cache:
            cache[key] = digest_of(run_ranks(ranks, "mpickpt.train", *trainer_flags(steps),
                                             *extra))
        return cache[key]
    return digest


@pytest.mark.slow  # CI time: the scancel test below runs the script as shipped to mpiexec's digest
def test_the_script_as_shipped_trains_like_mpiexec(slurm, tmp_path, reference):
    job, out = submit(slurm, tmp_path, 2, 40)
    result = slurm.wait_job(job, timeout=180)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), text[-3000:]
    assert digest_in(text) == reference(2, 40)
    assert "world of 1" not in text and text.count("digest ") == 1  # one 2-rank job


def test_srun_without_an_mpi_plugin_stops_with_the_fix_and_no_requeue(slurm, tmp_path):
    """SRUN_MPI=none: srun starts 2 singletons; every one stops before training with exit 2,
    which mpickpt-run and the script pass on (a requeue would fail the same way). An MPI plugin
    srun does not have: srun refuses to start the step, twice alike, and mpickpt-run ends with
    exit 2 instead of relaunching and requeueing; so does a VENV without an activate script."""
    job, out = submit(slurm, tmp_path, 2, 40, SRUN_MPI="none")
    result = slurm.wait_job(job, timeout=120)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("FAILED", 2), text[-3000:]
    assert "launched as 2 separate 1-rank jobs: srun (SLURM_STEP_NUM_TASKS=2)" in text
    assert "srun --mpi=pmi2" in text and "refused its input" in text
    assert "digest " not in text and "requeueing" not in text and "step 1/" not in text
    assert "can't honor" not in text  # the segment clean-up step asks one task per node
    assert slurm.job_info(job)["Restarts"] == "0"
    (tmp_path / "plugin").mkdir()
    job, out = submit(slurm, tmp_path / "plugin", 2, 40, SRUN_MPI="bogus")
    result = slurm.wait_job(job, timeout=120)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("FAILED", 2), text[-3000:]
    assert text.count("no node agent started (srun: error:") == 2, text[-3000:]
    assert "a fault of the launcher's command, which a relaunch or a requeue repeats" in text
    assert "requeueing" not in text and "restart 2 of" not in text
    (tmp_path / "venv").mkdir()
    job, out = submit(slurm, tmp_path / "venv", 2, 40, VENV="/nonexistent")
    result = slurm.wait_job(job, timeout=120)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("FAILED", 2), text
    assert "error: VENV=/nonexistent has no bin/activate" in text and "requeue" not in text


@pytest.mark.slow  # CI time: scancel's requeue test covers the requeue path
def test_scontrol_requeue_mid_run_resumes_to_the_uninterrupted_digest(slurm, tmp_path,
                                                                      reference):
    job, out = submit(slurm, tmp_path, 2, 150, CKPT_INTERVAL="20")
    wait_for(out, r"^step 60/", 120)
    slurm.requeue(job)
    result = slurm.wait_job(job, timeout=240)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), text[-3000:]
    assert slurm.job_info(job)["Restarts"] == "1"
    # the requeue's SIGTERM reaches the ranks from slurmd and, forwarded by mpickpt-run (which
    # gets it too) as srun's SIGUSR1, through srun: either may come first
    stopped = re.search(r"stopping on SIG(?:TERM|USR1) after step (\d+): checkpoint step \d+ "
                        r"(?:\(the interval's\) )?committed", text)
    assert stopped, text[-4000:]  # the ranks saved at the requeue's signal
    assert f"resumed from checkpoint step {stopped.group(1)}" in text
    assert digest_in(text) == reference(2, 150)


def test_scancel_term_saves_the_step_reached_and_the_requeue_replays_none(slurm, tmp_path,
                                                                          reference):
    job, out = submit(slurm, tmp_path, 2, 150, CKPT_INTERVAL="1000")
    wait_for(out, r"^step 50/", 120)
    slurm.run(["scancel", "--signal=TERM", str(job)])
    m = wait_for(out, r"stopping on SIGTERM after step (\d+): checkpoint step (\d+) committed "
                      r"([0-9.]+) s after the signal", 60)
    step = int(m.group(1))
    assert int(m.group(2)) == step and float(m.group(3)) < 30  # well within KillWait
    before = out.read_text().split(m.group(0))[0]
    assert last_step(before) == step  # the checkpoint holds the step reached
    result = slurm.wait_job(job, timeout=240)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), text[-3000:]
    assert "requeueing (requeue 1 of 5)" in text
    assert f"resumed from checkpoint step {step}" in text
    after = text.split(f"resumed from checkpoint step {step}")[1]
    assert min(int(s) for s in re.findall(r"^step (\d+)/", after, re.M)) == step + 1
    assert digest_in(text) == reference(2, 150)
    assert "world of 1" not in text and text.count("digest ") == 1  # 2-rank jobs; one finished
    log = (tmp_path / "ckpt" / "mpickpt-restarts.log").read_text()
    assert "stopped on a signal with its checkpoint committed; requeueing" in log


def test_sigterm_to_mpickpt_run_under_srun_stops_the_ranks_with_their_checkpoint(slurm,
                                                                                 tmp_path):
    """srun kills its step on SIGTERM and only prints its tasks' states on one SIGINT: a stop
    sent to mpickpt-run reaches the ranks as SIGUSR1, which srun passes on, and they commit the
    step they reached (no checkpoint was written before, and the steps were lost)."""
    job, out = submit(slurm, tmp_path, 2, 400, CKPT_INTERVAL="1000", MAX_REQUEUES="0")
    wait_for(out, r"^step 30/", 120)
    ckpt = str(tmp_path / "ckpt")
    found = subprocess.run(["pgrep", "-f", f"bin/mpickpt-run --launcher srun .*{ckpt}"],
                           capture_output=True, text=True)
    runs = [int(p) for p in found.stdout.split()]
    assert len(runs) == 1, runs
    os.kill(runs[0], signal.SIGTERM)
    m = wait_for(out, r"stopping on SIGUSR1 after step (\d+): checkpoint step (\d+) committed",
                 60)
    assert m.group(1) == m.group(2), m.group(0)
    slurm.wait_job(job, timeout=120)
    text = out.read_text()
    assert "(SIGTERM received)" in text and "Killed" not in text, text[-3000:]
    assert [m.step for m in list_manifests(ckpt)] == [int(m.group(1))], text[-3000:]


def test_a_trainer_killed_during_startup_under_srun_is_relaunched_at_once(slurm, tmp_path,
                                                                          reference):
    """srun goes on when a task fails (--kill-on-bad-exit=0), so the other ranks waited in
    their startup for its deadline (300 s); mpickpt-run ends the launcher once the agent said
    its trainer died in startup, and the relaunch trains to the failure-free digest."""
    ckpt = tmp_path / "ckpt"
    job, out = submit(slurm, tmp_path, 2, 40, CKPT_INTERVAL="20")
    deadline, pids = time.monotonic() + 60, []
    while len(pids) < 2 and time.monotonic() < deadline:
        pids = trainer_pids(ckpt)
        time.sleep(0.02)
    assert len(pids) == 2 and "step 1/" not in out.read_text(), pids
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    wait_for(out, r"relaunching \(restart 1 of", 120)
    took = time.monotonic() - killed
    result = slurm.wait_job(job, timeout=240)
    text = out.read_text()
    assert "was killed by SIGKILL during startup" in text and took < 60, (took, text[-3000:])
    assert (result.state, result.exit_code) == ("COMPLETED", 0), text[-3000:]
    assert digest_in(text) == reference(2, 40)


@pytest.mark.parametrize("spares", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_rank_sigkilled_under_srun_is_replaced_in_place(slurm, tmp_path, reference, spares):
    """In place is the default under the script: the dead task's agent respawns its trainer
    inside the step (or, with a fifth task and --spares 1, the waiting spare takes the rank), the
    survivors keep their processes, parity rebuilds the lost shard."""
    ckpt = tmp_path / "ckpt"
    job, out = submit(slurm, tmp_path, 4 + spares, 120, "--parity-k", "3", "--spares",
                      str(spares), CKPT_INTERVAL="40")
    wait_for(out, r"^step 60/", 180)
    pids = trainer_pids(ckpt)
    assert len(pids) == 4 + spares, pids
    victim = [p for p in pids if rank_of(p) < 4][2]
    rank = rank_of(victim)
    os.kill(victim, signal.SIGKILL)
    found = wait_for(out, r"in-place recovery: generation 1 at step (\d+): rank\(s\) "
                          r"\[(\d+)\] replaced", 120)
    assert int(found.group(2)) == rank
    after = trainer_pids(ckpt)
    result = slurm.wait_job(job, timeout=240)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), text[-4000:]
    assert slurm.job_info(job)["Restarts"] == "0"
    assert "relaunching" not in text and f"parity: rebuilt ranks [{rank}]" in text, text[-4000:]
    assert set(pids) - {victim} <= set(after) and victim not in after, (pids, after)
    assert (f"spare: took rank {rank} of generation 1" in text) == bool(spares), text[-4000:]
    assert digest_in(text) == reference(4, 120, "--parity-k", "3")
    assert "in-place recovery" in (ckpt / "mpickpt-restarts.log").read_text()


@pytest.mark.slow
def test_a_rank_sigkilled_under_srun_is_relaunched_in_the_allocation(slurm, tmp_path, reference):
    """--in-place off: the survivors dump and exit, mpickpt-run relaunches the step."""
    ckpt = tmp_path / "ckpt"
    job, out = submit(slurm, tmp_path, 4, 120, "--parity-k", "3", "--in-place", "off",
                      CKPT_INTERVAL="40")
    wait_for(out, r"^step 60/", 180)
    pids = trainer_pids(ckpt)
    assert len(pids) == 4, pids
    victim = pids[2]
    rank = rank_of(victim)
    os.kill(victim, signal.SIGKILL)
    exited = wait_gone([p for p in pids if p != victim], 30)  # the survivors exit in order
    result = slurm.wait_job(job, timeout=240)
    text = out.read_text()
    assert (result.state, result.exit_code) == ("COMPLETED", 0), text[-4000:]
    assert slurm.job_info(job)["Restarts"] == "0"  # relaunched inside the allocation
    assert f"rank(s) [{rank}] died after step" in text and "relaunching (restart 1 of 3)" in text
    assert relaunch_step(text) is not None and f"parity: rebuilt ranks [{rank}]" in text
    assert digest_in(text) == reference(4, 120, "--parity-k", "3")
    assert exited < 30
