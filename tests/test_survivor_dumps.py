"""Survivor dumps without a model: a dump is whole or absent, checked by size and CRC, its half-
written leftovers go with it, and `decide` (the relaunch's agreement) picks the earliest step,
undoes one step where a survivor got further, and counts every other rank as lost, with why; a
relaunch that found no dump says that it falls back to the checkpoint."""
import os

import numpy as np
import pytest

from mpickpt.survivors.dump import (DumpError, DumpHeader, dump_dirs, read_array, read_header,
                                    remove_dumps, write_dump)
from mpickpt.survivors.state import decide
from mpickpt.survivors.survival import fallback_message, restart_count


def _header(step=7):
    return DumpHeader(rank=1, world_size=4, plan_id="p", step=step, reader_state={"i": 3},
                      pls={"lost": 0.0})


def test_dump_round_trip_and_checks(tmp_path):
    arrays = {"row/w": np.arange(12, dtype=np.float32).reshape(3, 4), "dense/b": np.ones(2)}
    d = str(tmp_path / "rank-00001")
    total = write_dump(d, _header(), arrays, durable=True)
    assert total == sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)
                        if f.endswith(".npy"))
    header = read_header(d)
    assert (header.step, header.reader_state, sorted(header.files)) == \
        (7, {"i": 3}, ["dense/b", "row/w"])
    np.testing.assert_array_equal(read_array(d, "row/w"), arrays["row/w"])
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_damaged_or_truncated_dump_is_refused(tmp_path):
    d = str(tmp_path / "rank-00001")
    write_dump(d, _header(), {"row/w": np.arange(4096, dtype=np.float32)}, durable=False)
    path = os.path.join(d, "row__w.npy")
    with open(path, "r+b") as f:
        f.seek(2000)
        f.write(b"\x01\x02")
    with pytest.raises(DumpError, match="CRC32"):
        read_header(d)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DumpError, match="missing or truncated"):
        read_header(d)
    with pytest.raises(DumpError, match="no survivor dump"):
        read_header(str(tmp_path / "nothing"))


def test_remove_takes_half_written_dumps_too(tmp_path, monkeypatch):
    monkeypatch.setattr("mpickpt.survivors.dump.SHM_ROOT", str(tmp_path / "shm"))
    shm, ckpt = dump_dirs("k", 2, str(tmp_path / "ckpt"))
    write_dump(shm, _header(), {"a": np.zeros(3)}, durable=False)
    os.makedirs(shm + ".tmp-12345")  # a survivor killed while writing
    write_dump(ckpt, _header(), {"a": np.zeros(3)}, durable=True)
    remove_dumps("k", 2, str(tmp_path / "ckpt"))
    assert not os.path.exists(os.path.dirname(shm))  # the job's shm folder went once empty
    assert not os.path.exists(ckpt)


def test_the_line_on_dumps_left_counts_those_cut_short(tmp_path, monkeypatch):
    """mpickpt-run's line on dumps a job leaves in shared memory: whole ones, those a kill cut
    short while written (their memory is held all the same), both, or none."""
    from mpickpt.launch.relaunch import say_dumps_left
    from mpickpt.survivors.dump import job_key

    monkeypatch.setattr("mpickpt.survivors.dump.SHM_ROOT", str(tmp_path / "shm"))
    root, said = str(tmp_path / "ckpt"), []
    say_dumps_left(root, said.append)
    assert said == []
    shm = dump_dirs(job_key(root), 1, None)[0]
    os.makedirs(shm + ".tmp-12345")  # a survivor killed while writing
    with open(os.path.join(shm + ".tmp-12345", "row__w.npy"), "wb") as f:
        f.write(bytes(300000))
    say_dumps_left(root, said.append)
    write_dump(dump_dirs(job_key(root), 2, None)[0], _header(), {"a": np.zeros(3)}, False)
    say_dumps_left(root, said.append)
    assert said[0].startswith("0 survivor dump(s) and 1 cut short while written, 0.3 MB, stay "
                              f"in {os.path.dirname(shm)} on this node"), said
    assert said[1].startswith("1 survivor dump(s) and 1 cut short while written, 0.3 MB"), said


def _s(step, undo=True, incomplete=False, parity=False):
    return {"step": step, "undo": undo, "incomplete": incomplete, "parity": parity}


def test_decide_agrees_on_the_earliest_step_and_undoes_one():
    everyone = [(_s(10), ""), (_s(11), ""), (None, "no survivor dump"), (_s(10), "")]
    plan = decide(everyone, newest_committed=8, parity=False)
    assert plan.usable and plan.step == 10
    assert plan.survivors == [0, 1, 3] and plan.undo == [1]
    assert plan.lost == {2: "no survivor dump"}


def test_decide_counts_unreachable_and_partial_dumps_as_lost():
    everyone = [(_s(10), ""), (_s(11, undo=False), ""), (_s(12), ""),
                (_s(10, incomplete=True), ""), (None, "x: fails its CRC32 (damaged)")]
    plan = decide(everyone, newest_committed=None, parity=False)
    assert plan.usable and plan.survivors == [0] and plan.step == 10
    assert set(plan.lost) == {1, 2, 3, 4}
    assert "step 11" in plan.lost[1] and "step 12" in plan.lost[2]
    assert "rebuilt" in plan.lost[3] and "CRC32" in plan.lost[4]


@pytest.mark.parametrize("everyone,newest,parity,reason", [
    ([(None, "no survivor dump")] * 2, None, False, ""),
    ([(None, "d: fails its CRC32 (damaged)"), (None, "no survivor dump")], None, False, "CRC32"),
    ([(_s(10), ""), (_s(10), "")], 10, False, "newest checkpoint (step 10)"),
    ([(_s(10, parity=True), ""), (_s(10, parity=True), "")], None, False, "parity setting"),
    ([(_s(10, incomplete=True), ""), (None, "no survivor dump")], None, False, "common step"),
])
def test_decide_refuses_with_the_reason(everyone, newest, parity, reason):
    plan = decide(everyone, newest, parity)
    assert not plan.usable
    assert (reason in plan.reason) if reason else plan.reason == ""


def test_a_relaunch_without_dumps_says_it_falls_back_and_a_first_launch_says_nothing():
    nothing = decide([(None, "no survivor dump")] * 3, None, False)
    assert fallback_message(nothing.reason, restart=0) is None
    text = fallback_message(nothing.reason, restart=1)
    assert text.startswith("relaunch (restart 1): no rank found a survivor dump")
    assert "other nodes" in text and "falling back to the newest checkpoint" in text
    damaged = decide([(None, "d: fails its CRC32 (damaged)")], None, False)
    assert "CRC32" in fallback_message(damaged.reason, restart=0)


@pytest.mark.parametrize("value,count", [("3", 3), ("0", 0), ("", 0), ("x", 0)])
def test_restart_count_is_read_from_mpickpt_run(value, count):
    assert restart_count({"MPICKPT_RESTART": value}) == count
    assert restart_count({}) == 0
