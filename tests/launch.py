"""Launch real MPI jobs from serial tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mpickpt.mpiexec import mpiexec

REPO = Path(__file__).resolve().parents[1]
SHARED_CRITEO = REPO.parent / "shared" / "data" / "criteo" / "sample_200.tsv"


def run_ranks(n: int, module: str, *args: str, timeout: float = 180, cwd=None) -> subprocess.CompletedProcess:
    """Run `python -m module args` on n ranks; returns the finished process (text output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", module, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def digest_of(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    lines = [l for l in proc.stdout.splitlines() if l.startswith("digest ")]
    assert len(lines) == 1, proc.stdout
    return lines[0].split()[1]


SMALL_MODEL = ("--arch-embedding-size", "300-200-100-50", "--arch-sparse-feature-size", "8",
               "--arch-mlp-bot", "13-16-8", "--arch-mlp-top", "16-1", "--mini-batch-size", "32",
               "--test-num-batches", "0", "--print-freq", "0")


def start_ranks(n: int, module: str, *args: str, cwd=None) -> subprocess.Popen:
    """Start `python -m module args` on n ranks without waiting (text pipes)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", module, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    """Wait for a started job (text pipes); killed after `timeout` s. Returns it finished."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live descendant of `pid`, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((p, cmd))
        todo.extend(children.get(p, []))
    return out


def resumed_step(stdout: str) -> int | None:
    """The step a relaunch resumed from, parsed from its log (None: started fresh)."""
    for line in stdout.splitlines():
        if line.startswith("resumed from checkpoint step "):
            return int(line.split()[4])
    return None


def read_trace(path) -> dict[int, str]:
    """step -> reader position before that step; later lines (after a resume) win."""
    trace: dict[int, str] = {}
    for line in Path(path).read_text().splitlines():
        step, position = line.split(" ", 1)
        trace[int(step)] = position
    return trace


def h5_datasets(path) -> dict:
    """Every dataset of an HDF5 file (an export) by its path, read whole."""
    import h5py

    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
        return out
