"""Copy-on-update snapshots on 2+ ranks in process: a checkpoint at step s whose rows are copied
slowly in the background while later steps update many of them first (the update hook copies
those before the update) writes exactly what a stop-the-world copy at s writes, byte for byte,
for a full checkpoint, an incrcp increment, a 4-bit full one and a 4-bit incrcp increment, and
with in-memory parity kept up beside it (its update hook after the copier's, as in the trainer;
the parity stays equal to a fresh encode); the race really happened (rows copied by the hook on
every rank). (Real jobs: a kill, a survivor dump and a stop signal during the copy,
tests/test_copy_on_update_training.py.)"""
import dataclasses
import shutil
import tempfile

import numpy as np
import pytest
import torch

from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.manager import CheckpointManager
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.parity.guard import ParityConfig, ParityGuard
from mpickpt.quant.config import QuantConfig
from mpickpt.store.manifest import list_manifests
from tests.launch import h5_datasets

SIZES, B = (3000, 2000, 500, 40), 64


def _model(topo):
    arch = DenseArch(num_dense=13, num_tables=len(SIZES), dim=8, bottom=(13, 8), top=(8, 1))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.05), seed=1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,bits,parity", [
    ("full", "32", False), ("incrcp", "32", False), ("full", "4", False), ("incrcp", "4", False),
    ("full", "32", True)], ids=["full-32", "incrcp-32", "full-4", "incrcp-4", "full-32-parity"])
def test_a_copy_on_update_checkpoint_equals_a_stop_the_world_one(topology, kind, bits, parity):
    if topology.world_size != 2:
        pytest.skip("CI time: 2 ranks show it (the copy is local to each rank)")
    root = topology.control.bcast(tempfile.mkdtemp(prefix="mpickpt-cou-")
                                  if topology.is_root else None)
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=4))
    saves = (2, 5) if kind == "incrcp" else (5,)  # incrcp: a baseline, then an increment
    models = {}
    for snapshot in ("stop-the-world", "copy-on-update"):  # one manager at a time
        model = models[snapshot] = _model(topology)
        config = CheckpointConfig(directory=f"{root}/{snapshot}", interval=1000, resume="none",
                                  kind=kind, keep=10, snapshot=snapshot,
                                  quant=dataclasses.replace(QuantConfig(), bits=bits))
        mgr = CheckpointManager(topology, config, model, log=lambda line: None)
        guard = None
        if parity:  # built after the manager, as the trainer does: its hook runs second
            guard = ParityGuard(topology, model, ParityConfig(k=topology.world_size - 1, r=1),
                                say=lambda line: None)
            guard.encode()
        if mgr.copier is not None:  # slow: the steps below reach rows before it does
            mgr.copier.chunk_rows, mgr.copier.pause_s = 50, 0.01
        for step in range(1, 9):
            batch, _ = stream.read_slice(_position(step, topology), B * topology.world_size,
                                         topology.rank, topology.world_size)
            model.train_step(batch)
            if step in saves:
                assert mgr.save(step, {"kind": "synthetic", "sample_index": 0})
                assert mgr.copier is None or mgr.copier.active
            mgr.poll()
        hooked = mgr.copier.by_hook if mgr.copier is not None else 0
        mgr.close()
        if guard is not None:  # the parity upkeep went on, untouched by the copies
            kept = guard.store.parity.clone()
            guard.store.encode_all()
            assert all(topology.control.allgather(torch.equal(kept, guard.store.parity)))
    assert all(topology.control.allgather(hooked > 0))  # the race happened on every rank
    problems = _compare(root, list(models), saves, kind) if topology.is_root else None
    problems = topology.control.bcast(problems, root=0)  # every rank fails, none hangs
    assert problems == []


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_survivor_dump_during_the_copy_commits_nothing_and_restores_the_step_reached(topology):
    """Rank 1 dies after step 8 while both ranks still copy checkpoint 5 (copy-on-update): the
    survivor dumps as `Survival.survive` does (under the state lock, the copier running), neither
    manager closes (a dead rank and a survivor that exits), so 5 never commits and 2 stays the
    newest; the relaunch restores the survivor's dump and rebuilds rank 1 from parity to exactly
    the state of step 8 on both ranks (not the snapshot's step 5)."""
    if topology.world_size != 2:
        pytest.skip("CI time: 2 ranks show it (one survivor, one dead rank)")
    from mpickpt.data.position import SyntheticPosition
    from mpickpt.survivors.state import SurvivorDumps

    topo, dead = topology, 1
    root = topo.control.bcast(tempfile.mkdtemp(prefix="mpickpt-cou-") if topo.is_root else None)
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=4))

    def protect(model):  # built after the manager, as the trainer does
        guard = ParityGuard(topo, model, ParityConfig(k=1, r=1), say=lambda line: None)
        return guard, SurvivorDumps(topo, model, guard, root, "shm", lambda line: None)

    model = _model(topo)
    config = CheckpointConfig(directory=root, interval=1000, resume="none", keep=10,
                              snapshot="copy-on-update")
    mgr = CheckpointManager(topo, config, model, log=lambda line: None)
    guard, dumps = protect(model)
    guard.encode()
    dumps.survey(None)  # a first launch: this directory's lineage, no dump found
    state = SyntheticPosition()
    for step in range(1, 9):
        dumps.undo.begin(step, state.to_dict())
        batch, state = stream.read_slice(state, B * topo.world_size, topo.rank, topo.world_size)
        model.train_step(batch)
        dumps.undo.complete()
        if step == 5:  # slow (about 3 s, cancelled below): still copying at the dump
            mgr.copier.chunk_rows, mgr.copier.pause_s = 50, 0.05
        if step in (2, 5):
            assert mgr.save(step, {"kind": "synthetic", "sample_index": 0})
        if step == 2:
            mgr.settle()  # committed: the valid checkpoint before the one in flight
        mgr.poll()
    at = {k: v.clone() for k, v in (*model.row_state().items(), *model.dense_state().items())}
    copying = mgr.copier.active
    if topo.rank != dead:
        with model.state_lock:
            dumps.write(8, state.to_dict(), {}, {dead})
    mid_copy = copying and mgr.copier.active and mgr.copier.by_hook > 0
    assert all(topo.control.allgather(mid_copy))  # the dump was taken mid-copy, after updates
    mgr.abort()  # neither rank closes its manager: the survivor exits, rank 1 is gone
    topo.control.Barrier()
    assert [m.step for m in list_manifests(root)] == [2]
    model = _model(topo)  # the relaunch: fresh models, nothing encoded
    guard, dumps = protect(model)
    survey = dumps.survey(newest_committed=2)
    assert survey.usable and survey.step == 8 and survey.survivors == [0], survey
    assert list(survey.lost) == [dead], survey
    reader, _ = dumps.restore(survey)
    guard.start_rebuild([dead], step=8)
    guard.settle()
    got = {**model.row_state(), **model.dense_state()}
    same = sorted(got) == sorted(at) and all(torch.equal(got[k], at[k]) for k in at)
    assert all(topo.control.allgather(same)) and reader == state.to_dict()
    dumps.remove()
    topo.control.Barrier()
    if topo.is_root:
        shutil.rmtree(root, ignore_errors=True)


def _compare(root: str, snapshots, saves, kind) -> list[str]:
    """What differs between the two managers' last checkpoints (exports). Rank 0."""
    exports = {}
    for snapshot in snapshots:
        manifests = {m.step: m for m in list_manifests(f"{root}/{snapshot}")}
        if sorted(manifests) != list(saves) or manifests[saves[-1]].kind != kind:
            return [f"{snapshot}: checkpoints {sorted(manifests)}"]
        out = f"{root}/{snapshot}.h5"
        export_checkpoint(f"{root}/{snapshot}", manifests[saves[-1]], out, with_optimizer=True)
        exports[snapshot] = h5_datasets(out)
    shutil.rmtree(root, ignore_errors=True)
    a, b = exports["stop-the-world"], exports["copy-on-update"]
    if sorted(a) != sorted(b):
        return [f"arrays {sorted(a)} != {sorted(b)}"]
    return [name for name in a if not np.array_equal(a[name], b[name])]


def _position(step: int, topo):
    from mpickpt.data.position import SyntheticPosition

    return SyntheticPosition(sample_index=(step - 1) * B * topo.world_size)
