"""The commit protocol's reports on 2+ ranks: rank 0 does not look at the store for other ranks'
reports (a round trip on its training thread each time) before its own writers reported the
checkpoint, and commits as soon as it has every report after that."""
import pytest

from mpickpt.engine.commit import CommitCoordinator, PendingCheckpoint
from mpickpt.store.manifest import list_manifests


def _report(rank: int, step: int) -> dict:
    return {"step": step, "rank": rank, "ok": True, "error": None, "files": {}, "bytes": 10,
            "seconds": 0.1, "stall_seconds": 0.001, "staged_bytes": 10, "rows": 1}


def _pending(step: int, world: int) -> PendingCheckpoint:
    fields = {"kind": "full", "world_size": world, "dim": 4, "plan": {}, "optimizer": "adagrad",
              "stats": {}}
    return PendingCheckpoint(step, f"step-{step}", {"kind": "synthetic"}, fields)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_rank_0_looks_for_reports_only_after_its_own(topology, shared_dir, monkeypatch):
    topo = topology
    coordinator = CommitCoordinator(topo, shared_dir, keep=5, log=lambda line: None)
    probes = []
    real = topo.control.iprobe
    monkeypatch.setattr(topo.control, "iprobe", lambda tag=0: probes.append(tag) or real(tag))
    try:
        step = 7
        if topo.rank == 0:
            coordinator.expect(_pending(step, topo.world_size))
        else:
            coordinator.report(_report(topo.rank, step))
        topo.control.Barrier()  # every other rank's report is in the store now
        if topo.rank == 0:
            for _ in range(5):
                coordinator.progress()
            assert probes == [] and step in coordinator.pending  # never looked
            coordinator.report(_report(0, step))  # its own writers are done
            while step in coordinator.pending:
                coordinator.progress()
            assert probes  # it looked, found the others' reports and committed
            for future in coordinator._io_futures:
                future.result()
            assert [m.step for m in list_manifests(shared_dir)] == [step]
            assert coordinator.committed == [step]
        topo.control.Barrier()
    finally:
        coordinator.close()
