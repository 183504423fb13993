"""Fixtures shared by the serial test modules."""
import subprocess

import pytest


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
