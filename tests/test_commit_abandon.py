"""Rank 0's abandonment of the checkpoints a broken generation left unfinished: their directories
stay until the next generation formed (other survivors' writers may still write into them until
they leave the old generation), then go, and the previous committed checkpoint stays the newest."""
import os
from types import SimpleNamespace

from mpickpt.engine.commit import CommitCoordinator, PendingCheckpoint
from mpickpt.store import leftovers
from mpickpt.store.manifest import Manifest, list_manifests, torn_dirs, write_manifest


def _pending(step: int) -> PendingCheckpoint:
    fields = {"kind": "full", "world_size": 2, "dim": 4, "plan": {}, "optimizer": "adagrad",
              "stats": {}}
    return PendingCheckpoint(step, f"step-{step:012d}-0000abcd", {"kind": "synthetic"}, fields)


def test_a_forgotten_checkpoint_keeps_its_directory_until_the_next_generation_formed(tmp_path):
    root, lines = str(tmp_path), []
    write_manifest(root, Manifest(step=10, kind="full", ckpt_id="step-000000000010-0000abcd",
                                  world_size=2, dim=4, plan={}, optimizer="adagrad", files={},
                                  reader_state={}))
    coordinator = CommitCoordinator(SimpleNamespace(rank=0, world_size=2), root, 5, lines.append)
    try:
        pending = _pending(20)
        coordinator.expect(pending)
        coordinator.report({"step": 20, "rank": 0, "ok": True, "files": {}})  # rank 1's missing
        folder = os.path.join(root, pending.ckpt_id)
        os.makedirs(folder)
        open(os.path.join(folder, "rank-00001-part-0.h5.tmp"), "w").close()  # rank 1 writing
        assert coordinator.forget_pending("a rank died before every rank had written it") == [20]
        assert not coordinator.pending
        for future in coordinator._io_futures:
            future.result()
        assert os.path.isdir(folder) and coordinator.abandoned == []  # a writer may be in it
        coordinator.remove_forgotten()  # the folder is set aside at once, deleted after
        assert not os.path.exists(folder) and coordinator.abandoned == [20]
        assert lines == ["checkpoint step 20 abandoned: a rank died before every rank had "
                         "written it (1 of 2 ranks failed); checkpoint step 10 stays valid"]
        assert [m.step for m in list_manifests(root)] == [10]
        coordinator.remove_forgotten()  # nothing left: nothing more said
        assert len(lines) == 1
    finally:
        coordinator.close()
    assert not [n for n in os.listdir(root) if ".abandoned-" in n]  # deleted on its thread


def test_a_checkpoint_set_aside_is_a_leftover_once_its_process_is_gone(tmp_path):
    """A rank 0 killed while deleting an abandoned checkpoint set aside leaves it: the next
    run's leftovers name it (not while its process lives); the name is no checkpoint's."""
    root = str(tmp_path)
    for pid in (os.getpid(), 2 ** 22 + 12345):  # alive; beyond Linux's pid_max: gone
        folder = os.path.join(root, f"step-000000000030-0000abcd.abandoned-{pid}")
        os.makedirs(folder)
        with open(os.path.join(folder, "rank-00000-part-0.h5"), "wb") as f:
            f.write(bytes(100))
    found = leftovers.find(root, [])
    assert [(os.path.basename(x.path), x.bytes, x.why) for x in found] == [
        (f"step-000000000030-0000abcd.abandoned-{2 ** 22 + 12345}", 100,
         f"an abandoned checkpoint whose removal was cut short (process {2 ** 22 + 12345} is "
         f"gone)")]
    assert torn_dirs(root, []) == []
    assert leftovers.set_aside(os.path.join(root, "step-000000000031-0000abcd")) is None


def test_the_same_step_set_aside_twice_takes_a_name_of_its_own(tmp_path):
    """A rollback saves the step again and that save is abandoned too, before the first copy
    set aside is deleted: the second takes the next free name, and neither is lost in the
    other (the rename onto a non-empty directory fails)."""
    path = os.path.join(str(tmp_path), "step-000000000040-0000abcd")
    names = []
    for attempt in range(2):
        os.makedirs(path)
        with open(os.path.join(path, "rank-00000-part-0.h5"), "w") as f:
            f.write(str(attempt))
        names.append(leftovers.set_aside(path))
    assert [os.path.basename(n) for n in names] == [
        f"step-000000000040-0000abcd.abandoned-{os.getpid()}-{n}" for n in (0, 1)]
    assert [open(os.path.join(n, "rank-00000-part-0.h5")).read() for n in names] == ["0", "1"]
    assert not os.path.exists(path) and leftovers.find(str(tmp_path), []) == []  # mine: alive


def test_a_checkpoint_that_cannot_be_set_aside_is_deleted_before_training_goes_on(
        tmp_path, monkeypatch):
    """Where no rename succeeds, the directory keeps the checkpoint's own name, which a
    rollback's save of the same step writes again: it is deleted before `remove_forgotten`
    returns, not queued behind it."""
    from mpickpt.engine import commit

    import shutil
    import time

    monkeypatch.setattr(commit, "set_aside", lambda path: path)  # e.g. a rename refused
    rmtree = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (time.sleep(0.3), rmtree(*a, **k)))
    root = str(tmp_path)
    coordinator = CommitCoordinator(SimpleNamespace(rank=0, world_size=2), root, 5, [].append)
    try:
        pending = _pending(20)
        coordinator.expect(pending)
        coordinator.report({"step": 20, "rank": 0, "ok": True, "files": {}})
        os.makedirs(os.path.join(root, pending.ckpt_id))
        coordinator.forget_pending("a rank died")
        coordinator.remove_forgotten()
        assert not os.path.exists(os.path.join(root, pending.ckpt_id))
        assert coordinator.abandoned == [20]
    finally:
        coordinator.close()
