"""Rank 0's abandonment of the checkpoints a broken generation left unfinished: their directories
stay until the next generation formed (other survivors' writers may still write into them until
they leave the old generation), then go, and the previous committed checkpoint stays the newest."""
import os
from types import SimpleNamespace

from mpickpt.engine.commit import CommitCoordinator, PendingCheckpoint
from mpickpt.store.manifest import Manifest, list_manifests, write_manifest


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
        coordinator.remove_forgotten()
        for future in coordinator._io_futures:
            future.result()
        assert not os.path.exists(folder) and coordinator.abandoned == [20]
        assert lines == ["checkpoint step 20 abandoned: a rank died before every rank had "
                         "written it (1 of 2 ranks failed); checkpoint step 10 stays valid"]
        assert [m.step for m in list_manifests(root)] == [10]
        coordinator.remove_forgotten()  # nothing left: nothing more said
        assert len(lines) == 1
    finally:
        coordinator.close()
