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
