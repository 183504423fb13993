"""Deadlines on the phases no death detector covers: a PhaseWatch ends its process with the
phase's status once the deadline passes, and a trainer whose peer hangs before the first step
leaves within --startup-timeout instead of waiting in MPI_Init forever."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.fault_jobs import Job, rank_of
from tests.launch import REPO, SMALL_MODEL
from mpickpt.mpiexec import mpiexec

_SCRIPT = """
import sys, time
from mpickpt.phase_watch import PhaseWatch
done = PhaseWatch("first", 0.3, 9)
done.phase("quick")
assert done.end() < 0.3
w = PhaseWatch("startup", float(sys.argv[1]), 42,
               before_exit=lambda: print("hooks ran", flush=True))
w.phase("waiting for a peer")
time.sleep(float(sys.argv[2]))
print("survived", flush=True)
"""


def _script(limit: float, sleep: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", _SCRIPT, str(limit), str(sleep)],
                          capture_output=True, text=True, timeout=60, env=env)


def test_an_expired_deadline_ends_the_process_with_its_status_after_the_hooks():
    start = time.monotonic()
    proc = _script(0.5, 30)
    assert proc.returncode == 42, proc.stdout + proc.stderr
    assert time.monotonic() - start < 15
    assert "startup did not finish within 0.5 s (stuck in waiting for a peer)" in proc.stderr
    assert "hooks ran" in proc.stdout and "survived" not in proc.stdout


def test_a_phase_that_ends_in_time_is_not_cut_short():
    proc = _script(5, 0.2)
    assert proc.returncode == 0 and "survived" in proc.stdout, proc.stderr


_ABANDONED = """
import time
from mpickpt.phase_watch import PhaseWatch
start = time.monotonic()
asked = []
def abandoned():
    asked.append(1)
    return "the job falls back" if time.monotonic() - start > 0.6 else None
w = PhaseWatch("joining", 60, 77, abandoned=abandoned)
w.phase("a group's rendezvous")
time.sleep(30)
print("survived", flush=True)
"""


def test_an_abandoned_phase_ends_the_process_long_before_its_deadline():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _ABANDONED], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 77, proc.stdout + proc.stderr
    assert "joining was abandoned (the job falls back) (stuck in a group's rendezvous)" \
        in proc.stderr and "survived" not in proc.stdout
    assert time.monotonic() - start < 10


def test_a_rank_whose_peer_hangs_in_startup_leaves_within_the_deadline(tmp_path):
    """Rank 1 is stopped (SIGSTOP) as soon as it exists: rank 0 waits for it in MPI_Init, which
    holds the GIL, so the faulthandler backstop ends it (status 1, its stack on stderr) within
    --startup-timeout + BACKSTOP."""
    job = Job([mpiexec(), "-disable-auto-cleanup", "-n", "2", sys.executable, "-m",
               "mpickpt.train", *SMALL_MODEL, "--num-batches", "5", "--startup-timeout", "2"])
    try:
        deadline = time.monotonic() + 30
        while len(job.ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        pids = {rank_of(p): p for p in job.ranks()}
        assert set(pids) == {0, 1}, job.output
        os.kill(pids[1], signal.SIGSTOP)
        start = time.monotonic()
        while os.path.exists(f"/proc/{pids[0]}") and time.monotonic() - start < 40:
            with open(f"/proc/{pids[0]}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        waited = time.monotonic() - start
        os.kill(pids[1], signal.SIGKILL)
        job.wait(60)
    finally:
        job.stop()
    out = job.output
    assert "Timeout (0:00:10)!" in out and "mpickpt/train.py" in out, out
    assert 9.0 < waited < 20, f"rank 0 left after {waited:.1f} s"
    assert "step 1/" not in out, out
