"""Launch real MPI jobs from serial tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_CRITEO = REPO.parent / "shared" / "data" / "criteo" / "sample_200.tsv"


def mpiexec() -> str:
    """The mpiexec next to this Python (the venv's MPICH wheel) or on PATH."""
    local = Path(sys.executable).with_name("mpiexec")
    return str(local) if local.exists() else "mpiexec"


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
