"""A writer's failed result is one line that names the file and the system's reason, also when
HDF5 fails deep in its I/O (its message carries a ctime with a newline); a small file's reserved
space stays held while it is written. In process, on a real tmpfs."""
from __future__ import annotations

import os

import pytest

from mpickpt.background import error_line
from mpickpt.store import reservation
from mpickpt.engine.staging import StagingArea
from mpickpt.engine.writer_process import run_job
from mpickpt.store.reservation import Reservation
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.store.file_spec import shard_attrs, shard_specs
from tests.test_direct_io import NAMES, shard_arrays


def one_rank_job(root: str):
    """A real shard file's job (about 0.5 MB) and its staging area."""
    plan = ShardPlan.build([6_000, 1_000], 1)
    gids, arrays = shard_arrays(plan, 0)
    area = StagingArea({k: (a.shape, a.dtype.str) for k, a in arrays.items()})
    for k, a in arrays.items():
        area.arrays[k][...] = a
    [spec] = shard_specs(root, plan, 0, gids, NAMES, lambda j: "s.h5", "shard",
                         lambda j: shard_attrs(7, "full", "fp32", 0, j, 1, 1))
    return spec, area


def take_all_space(folder: str) -> str:
    """What a writer beside this one does between a release and HDF5's write: fill the disk."""
    path = os.path.join(folder, "thief")
    with open(path, "ab") as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass
    return path


@pytest.mark.parametrize("when", ["release", "close"])  # before a dataset's write, before close
def test_space_taken_after_the_reservation_fails_the_job_on_one_line(small_tmpfs, monkeypatch,
                                                                     when):
    spec, area = one_rank_job(str(small_tmpfs / "ckpt"))
    real = getattr(Reservation, when)

    def then_taken(self, *args):
        real(self, *args)
        take_all_space(str(small_tmpfs))

    monkeypatch.setattr(Reservation, when, then_taken)
    try:
        answer = run_job({"step": 7, "files": [spec], "staging": area.describe()}, {})
    finally:
        area.close()
    assert not answer["ok"]
    error = answer["error"]
    assert "\n" not in error and "time =" not in error, error
    assert error.startswith(spec.path + ": OSError") and "No space left on device" in error, error
    assert sorted(os.listdir(os.path.dirname(spec.path))) == []  # no .tmp, no .reserve


def test_hdf5s_io_detail_is_cut_to_what_failed_and_why():
    """The text h5py raised on this VM when a tmpfs filled under a rank's shard file."""
    e = OSError(28, "Unable to synchronously create file (file write failed: time = Sat Nov 28 "
                    "09:56:16 2026\n, filename = '/m/ckpt/rank-00000-part-0.h5.tmp', file "
                    "descriptor = 7, errno = 28, error message = 'No space left on device', buf "
                    "= 0x563234bfb958, total write size = 48, bytes this sub-write = 48, offset "
                    "= 0)")
    assert error_line(e) == ("OSError: [Errno 28] Unable to synchronously create file (file write "
                             "failed: No space left on device)")
    assert error_line(OSError(5, "Can't write data")) == \
        "OSError: [Errno 5] Can't write data (Input/output error)"
    assert error_line(ValueError("two\n  lines")) == "ValueError: two lines"


def test_a_small_files_space_stays_held_while_it_is_written(tmp_path, monkeypatch):
    """Released ahead of the writes 1/8 at a time, not all at the first block (where the
    filesystem has little room to spare: here, a gigabyte short of what it has)."""
    free = reservation._free_bytes(str(tmp_path / "f.h5"))
    monkeypatch.setattr(reservation, "AMPLE_BYTES", free)
    r = Reservation(str(tmp_path / "f.h5"), 1 << 20)
    assert r.held
    held = os.path.getsize(r.path)
    try:
        r.release(4096)
        assert os.path.getsize(r.path) == held - r.quantum
        assert r.quantum == held // reservation.RELEASE_SHARE
        r.release(r.quantum - 4096)  # still ahead: no truncation
        assert os.path.getsize(r.path) == held - r.quantum
        r.release(held)  # more than is left: all of it
        assert os.path.getsize(r.path) == 0
    finally:
        r.close()
    assert not os.path.exists(r.path)


def test_a_small_file_with_ample_room_holds_nothing_and_a_large_one_holds_its_space(tmp_path):
    """No reservation file for a small file where the filesystem has a gigabyte more than it
    needs, and its job writes the file; a file above SMALL_FILE is reserved as before."""
    if reservation._free_bytes(str(tmp_path / "x")) < 2 * reservation.AMPLE_BYTES:
        pytest.skip("the filesystem of tmp_path has less than 2 GB free")
    r = Reservation(str(tmp_path / "small.h5"), 1 << 20)
    r.release(1 << 19)
    assert not r.held and not os.path.exists(r.path)
    r.close()
    big = Reservation(str(tmp_path / "big.h5"), reservation.SMALL_FILE)
    try:
        assert big.held and os.path.getsize(big.path) >= reservation.SMALL_FILE
    finally:
        big.close()
    assert not os.path.exists(big.path)
    spec, area = one_rank_job(str(tmp_path / "ckpt"))
    try:
        answer = run_job({"step": 7, "files": [spec], "staging": area.describe()}, {})
    finally:
        area.close()
    assert answer["ok"], answer
    assert sorted(os.listdir(os.path.dirname(spec.path))) == ["s.h5"]
