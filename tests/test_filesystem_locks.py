"""Filesystems without working locks (NFS without lockd, some Lustre mounts): a preloaded library
makes every flock() fail with ENOLCK, as such a mount does. Checkpoints (full and IncrCP, so the
extractor's bundles too) commit, `mpickpt verify` passes, and the resumed run ends with the
uninterrupted digest. A lock error that still surfaces is named as one, not as damage."""
import errno
import os
import shutil
import subprocess
import sys

import h5py
import pytest

from mpickpt.store.manifest import list_manifests
from mpickpt.store.shard_file import LockingError, is_lock_error
from tests.launch import REPO, SMALL_MODEL, digest_of, finish, resumed_step, run_ranks, start_ranks

NOLOCK_C = """
#define _GNU_SOURCE
#include <errno.h>
#include <sys/file.h>
int flock(int fd, int operation) { (void)fd; (void)operation; errno = ENOLCK; return -1; }
"""


@pytest.fixture(scope="module")
def nolock(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the flock-refusing library")
    folder = tmp_path_factory.mktemp("nolock")
    (folder / "nolock.c").write_text(NOLOCK_C)
    lib = folder / "libnolock.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(folder / "nolock.c")],
                   check=True, capture_output=True)
    return str(lib)


def test_the_library_makes_hdf5_locks_fail(nolock, tmp_path):
    """Without this the test below could pass on a filesystem whose locks simply work."""
    code = (f"import h5py\ntry:\n    h5py.File({str(tmp_path / 'a.h5')!r}, 'w')\n"
            f"except OSError as e:\n    print('refused', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, LD_PRELOAD=nolock), timeout=60)
    assert "refused" in proc.stdout and "errno = 37" in proc.stdout, proc.stdout + proc.stderr


def test_checkpoints_commit_verify_and_resume_without_locks(nolock, tmp_path, monkeypatch):
    straight = start_ranks(2, "mpickpt.train", *SMALL_MODEL, "--num-batches", "24", "--digest")
    monkeypatch.setenv("LD_PRELOAD", nolock)  # the uninterrupted run above keeps its locks
    ckpt = tmp_path / "ckpt"
    common = (*SMALL_MODEL, "--ckpt-dir", str(ckpt), "--ckpt-interval", "4", "--ckpt-kind",
              "incrcp", "--ckpt-keep", "3", "--digest")
    first = run_ranks(2, "mpickpt.train", *common, "--num-batches", "14")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "abandoned" not in first.stdout.split("checkpoints:")[0], first.stdout
    manifests = list_manifests(str(ckpt))
    assert [m.step for m in manifests][-1] == 12 and {m.kind for m in manifests} >= {"incrcp"}
    verify = subprocess.run([sys.executable, "-m", "mpickpt.cli", "verify", str(ckpt)],
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert verify.returncode == 0 and "0 with problems" in verify.stdout, verify.stdout
    resumed = run_ranks(2, "mpickpt.train", *common, "--num-batches", "24")
    assert resumed_step(resumed.stdout) == 12
    assert digest_of(resumed) == digest_of(finish(straight))


def test_a_lock_error_is_named_as_one():
    assert is_lock_error(OSError(errno.ENOLCK, "No locks available"))
    assert is_lock_error(OSError("unable to lock file, errno = 37"))
    assert not is_lock_error(OSError(errno.EIO, "Input/output error"))
    message = str(LockingError("/ckpt/x.h5", OSError(errno.ENOLCK, "No locks available")))
    assert "/ckpt/x.h5" in message and "HDF5_USE_FILE_LOCKING=FALSE" in message
    assert "corrupt" not in message


def test_files_open_without_asking_for_a_lock(nolock, tmp_path):
    """open_shard on a file written by the writers' path, in a process whose flock fails."""
    code = ("import numpy as np\nfrom mpickpt.store.shard_file import open_hdf5, open_shard, "
            "seal_attributes, write_dataset, FORMAT_VERSION\n"
            f"p = {str(tmp_path / 's.h5')!r}\n"
            "with open_hdf5(p, 'w') as f:\n    f.attrs['format_version'] = FORMAT_VERSION\n"
            "    write_dataset(f, 'x', np.arange(10))\n    seal_attributes(f)\n"
            "with open_shard(p) as f:\n    print('read', int(f['x'][9]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, LD_PRELOAD=nolock,
                                               PYTHONPATH=str(REPO)))
    assert proc.stdout.strip() == "read 9", proc.stderr[-2000:]
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert "_attrs" in f
