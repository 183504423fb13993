"""Real jobs that real failures happen to: start a launch, follow its output, kill one of its
ranks with a real signal at a chosen step, and read what the job said about it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from tests.launch import REPO, descendants

_STEP = re.compile(r"^step (\d+)/")


class Job:
    """One launched job (mpiexec, mpickpt-run or srun) whose output is followed line by line."""

    def __init__(self, cmd: list[str], env: dict | None = None, cwd=None):
        env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=cwd, start_new_session=True)
        self.lines: list[str] = []
        self.step = 0
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                m = _STEP.match(line)
                if m:
                    self.step = max(self.step, int(m.group(1)))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self.lines)

    def wait_for_step(self, step: int, timeout: float = 120) -> bool:
        """True once the job printed a step >= `step`; False if it ended first."""
        return self._wait_until(lambda: self.step >= step, f"step {step}", timeout)

    def wait_for_line(self, pattern: str, timeout: float = 120) -> bool:
        """True once a line of the job's output matched `pattern` (re.search); False if it
        ended first."""
        found = re.compile(pattern)
        return self._wait_until(lambda: any(found.search(x) for x in self.lines),
                                repr(pattern), timeout)

    def _wait_until(self, done, what: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not done():
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return False
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what} not reached in {timeout} s:\n"
                                       + "".join(self.lines[-30:]))
                self._changed.wait(min(left, 0.5))
        return True

    def ranks(self) -> list[int]:
        """Pids of the trainer processes of this job (not launchers, not their workers, not
        warm standbys: `--warm-respawn`'s, even once one took over)."""
        return sorted(pid for pid, cmd in descendants(self.proc.pid)
                      if " -m mpickpt.train" in f" {cmd}" and "multiprocessing" not in cmd
                      and "mpickpt.launch.rank_wrapper" not in cmd
                      and not os.path.basename(cmd.split()[0]).startswith(("mpiexec", "srun"))
                      and not _is_standby(pid))

    def kill_rank(self, sig: int = signal.SIGKILL, pick=None) -> tuple[int, int]:
        """Send `sig` to one trainer process (`pick` chooses from the sorted pids); returns its
        (pid, MPI rank) after checking that it was alive and, for SIGKILL, is gone."""
        pids = self.ranks()
        assert pids, "no trainer process to kill:\n" + self.output[-3000:]
        pid = pick(pids) if pick else pids[0]
        rank = rank_of(pid)
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            wait_gone([pid], 10)
        return pid, rank

    def kill_one_and_wait(self, pick, timeout: float = 300) -> tuple[int, float, int]:
        """SIGKILL one trainer process (`pick` chooses it); returns its MPI rank, the seconds
        until every other trainer process had exited, and the job's exit code."""
        pids = self.ranks()
        pid, rank = self.kill_rank(pick=pick)
        exited = wait_gone([p for p in pids if p != pid], 30)
        return rank, exited, self.wait(timeout)

    def signal_ranks(self, sig: int) -> list[int]:
        pids = self.ranks()
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def wait(self, timeout: float = 300) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"job did not end in {timeout} s:\n" + self.output[-4000:])
        self._reader.join(10)
        return code

    def stop(self) -> None:
        """Kill the job's whole session (a test that failed midway)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _is_standby(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0MPICKPT_STANDBY=1\0" in b"\0" + f.read()
    except OSError:
        return False


def rank_of(pid: int) -> int:
    """The MPI rank of a launched process, from the launcher's variables in its environment."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    for name in (b"PMI_RANK", b"SLURM_PROCID", b"OMPI_COMM_WORLD_RANK"):
        if name in env:
            return int(env[name])
    raise AssertionError(f"process {pid} has no rank in its environment")


def wait_gone(pids, timeout: float = 30) -> float:
    """Seconds until every pid has exited (AssertionError past `timeout`)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not [p for p in pids if alive(p)]:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"processes {[p for p in pids if alive(p)]} still alive after "
                         f"{timeout} s")


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def mpickpt_run(*args: str) -> list[str]:
    """The mpickpt-run command line (its module, from this checkout)."""
    return [sys.executable, "-m", "mpickpt.launch.relaunch", *args]


def digest_in(output: str) -> str | None:
    found = re.findall(r"^digest ([0-9a-f]+)$", output, re.M)
    return found[-1] if found else None


def survivor_steps(output: str) -> dict[int, int]:
    """Rank -> the step it said it completed when a peer died."""
    return {int(r): int(s) for r, s in
            re.findall(r"mpickpt: rank (\d+): peer rank\(s\) \[[0-9, ]+\] died after step (\d+)",
                       output)}


def relaunch_step(output: str) -> int | None:
    m = re.search(r"restored from their survivor dumps at step (\d+)", output)
    return int(m.group(1)) if m else None


OPEN_MPI = "/usr/bin/mpirun.openmpi"
OPEN_MPI_ARGS = ("--launcher-path", OPEN_MPI, "--launcher-arg=--allow-run-as-root",
                 "--launcher-arg=--oversubscribe")
"""mpickpt-run's arguments for a job under Open MPI's mpirun (as root, more ranks than cores)."""


def open_mpi_skip() -> str | None:
    """Why a test under Open MPI cannot run here (not installed, or mpi4py does not run under
    it with MPI4PY_MPIABI=openmpi), or None."""
    if not os.path.exists(OPEN_MPI):
        return f"Open MPI is not installed ({OPEN_MPI}; Debian: apt-get install openmpi-bin)"
    probe = subprocess.run([OPEN_MPI, "--allow-run-as-root", "--oversubscribe", "-n", "1",
                            sys.executable, "-c", "from mpi4py import MPI; "
                            "print(MPI.Get_library_version())"], capture_output=True, text=True,
                           env=dict(os.environ, MPI4PY_MPIABI="openmpi"), timeout=60)
    if "Open MPI" not in probe.stdout:
        return f"mpi4py does not run under {OPEN_MPI}: {probe.stderr.strip()[-300:]}"
    return None
