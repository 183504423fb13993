"""Fixtures shared by the serial test modules, and the session's cleanup of the MPI
shared-memory segments its killed jobs left."""
import subprocess
import time

import pytest

from mpickpt.launch.mpich_shm import remove_orphans

_SESSION_START = time.time()


def pytest_sessionfinish(session, exitstatus):
    """Fault tests SIGKILL ranks of plain `mpiexec` jobs, whose MPI segments then stay in
    /dev/shm: delete those that appeared during this session and that no process holds (a job
    still running, the multi-rank session's own included, keeps its own)."""
    removed = remove_orphans(_SESSION_START)
    if removed:
        print(f"\nremoved {len(removed)} MPI shared-memory segment(s) the session's killed jobs "
              f"left in /dev/shm")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1.7 MB tmpfs (one checkpoint of the default model fits, a second does not), unmounted
    after the test; skips where mounting is not allowed."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1700k", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)
