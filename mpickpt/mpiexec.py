"""Where `mpiexec` is: beside this Python (the venv of the pip `mpich` wheel) or on PATH. Used by the
benchmarks and tests that launch real MPI jobs. Local."""
from __future__ import annotations

import sys
from pathlib import Path


def mpiexec() -> str:
    """The mpiexec next to this Python (the venv's MPICH wheel), else `mpiexec` from PATH. Local."""
    local = Path(sys.executable).with_name("mpiexec")
    return str(local) if local.exists() else "mpiexec"
