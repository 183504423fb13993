"""Copy-on-update snapshots on 2+ ranks in process: a checkpoint at step s whose rows are copied
slowly in the background while later steps update many of them first (the update hook copies
those before the update) writes exactly what a stop-the-world copy at s writes, byte for byte,
for a full checkpoint, an incrcp increment and a 4-bit one; the race really happened (rows copied
by the hook, and rows changed after s)."""
import dataclasses
import shutil
import tempfile

import numpy as np
import pytest

from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.manager import CheckpointManager
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.quant.config import QuantConfig
from mpickpt.store.manifest import list_manifests
from tests.launch import h5_datasets

SIZES, B = (3000, 2000, 500, 40), 64


def _model(topo):
    arch = DenseArch(num_dense=13, num_tables=len(SIZES), dim=8, bottom=(13, 8), top=(8, 1))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.05), seed=1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind,bits", [("full", "32"), ("incrcp", "32"), ("full", "4")])
def test_a_copy_on_update_checkpoint_equals_a_stop_the_world_one(topology, kind, bits):
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
    assert all(topology.control.allgather(hooked > 0))  # the race happened on every rank
    problems = _compare(root, list(models), saves, kind) if topology.is_root else None
    problems = topology.control.bcast(problems, root=0)  # every rank fails, none hangs
    assert problems == []


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
