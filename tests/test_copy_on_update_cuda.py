"""Copy-on-update snapshots of CUDA-resident rows (kernels/pending_rows.cu): the rows staged for a
snapshot at step s equal the rows at s byte for byte, while later steps update a random part of
the pending rows before the slowed copier reaches them (the hook's kernels copy those first, in
stream order) — for every word width of the kernels (16, 8, 4, 2, 1 bytes), for all rows and for a selection (the
incremental kinds), and after a cancel no kernel writes into staging any more. End to end: a
HybridDLRM on CUDA (1 rank, NCCL) checkpointed with copy-on-update, full and incrcp, restores
exactly the state of its save step. Needs CuPy and a CUDA GPU; skipped otherwise."""
import time

import numpy as np
import pytest
import torch

from tests.gpu import cupy_with_gpu
from tests.row_tables import RowTables

cupy = cupy_with_gpu("copy-on-update of CUDA rows")

from mpickpt.engine.copy_on_update import CopyOnUpdate  # noqa: E402
from mpickpt.engine.pending_rows_cuda import unusable, word_bytes  # noqa: E402
from mpickpt.engine.snapshot import numpy_dtype  # noqa: E402
from mpickpt.engine.staging import StagingArea  # noqa: E402

if unusable(torch.device("cuda", 0)) is not None:
    pytest.skip(unusable(torch.device("cuda", 0)), allow_module_level=True)

ROWS = 60_000
LAYOUTS = {
    "fp32-16+rowwise": {"weight": ((ROWS, 16), torch.float32), "state/sum": ((ROWS,), torch.float32)},
    "fp32-37+fp16-3+u8-5": {"weight": ((ROWS, 37), torch.float32),
                            "state/m": ((ROWS, 3), torch.float16),
                            "state/b": ((ROWS, 5), torch.uint8)},
    "fp32-2": {"weight": ((ROWS, 2), torch.float32)},  # 8-byte words
}


def _tables(layout, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, (shape, dtype) in LAYOUTS[layout].items():
        if dtype == torch.uint8:
            out[name] = torch.randint(0, 250, shape, generator=g, device="cuda", dtype=dtype)
        else:
            out[name] = torch.randn(shape, generator=g, device="cuda").to(dtype)
    return out


def _staging(tables):
    specs = {n: (tuple(t.shape), numpy_dtype(t)) for n, t in tables.items()}
    area = StagingArea(specs, pin_for_cuda=True)
    assert area.mapped
    return area, area.tensors()


def _bytes(t):
    return t.cpu().contiguous().view(torch.uint8).numpy()


def test_word_widths():
    assert word_bytes(64, 0, 4096) == 16 and word_bytes(148, 0, 4096) == 4
    assert word_bytes(6, 0, 4096) == 2 and word_bytes(5, 0, 4096) == 1 and word_bytes(8, 0, 64) == 8
    assert word_bytes(64, 0, 4100) == 4  # an address that is not 16-aligned narrows the word


@pytest.mark.parametrize("selected", [False, True], ids=["all-rows", "selected"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_rows_are_the_rows_at_the_snapshot(layout, selected):
    tables = _tables(layout, seed=1)
    model = RowTables(tables)
    area, staging = _staging(tables)
    cou = CopyOnUpdate(model, chunk_rows=2000, pause_s=0.002)  # slow: steps overtake it
    try:
        rng = np.random.default_rng(2)
        chosen = np.sort(rng.choice(ROWS, ROWS // 3, replace=False)) if selected else None
        torch.cuda.synchronize()
        want = {n: t.clone() for n, t in tables.items()}  # the state at step s
        cou.start(tables, staging, chosen)
        cou.go()
        for _ in range(12):  # later steps, each updating 5000 random rows
            model.update(torch.randperm(ROWS, device="cuda")[:5000])
        copying = cou.active
        cou.finish()
        rows = slice(None) if chosen is None else torch.from_numpy(chosen)
        for name, t in tables.items():
            assert not torch.equal(t, want[name])  # the rows did change after s
            assert np.array_equal(_bytes(staging[name][rows]), _bytes(want[name].cpu()[rows])), name
        # the race happened: the hook copied rows the copier had not reached yet
        assert copying and 0 < cou.by_hook < (ROWS if chosen is None else len(chosen))
    finally:
        cou.close()
        area.close()


def test_after_a_cancel_no_kernel_writes_into_staging():
    tables = _tables("fp32-16+rowwise", seed=3)
    model = RowTables(tables)
    area, staging = _staging(tables)
    cou = CopyOnUpdate(model, chunk_rows=500, pause_s=0.005)
    try:
        cou.start(tables, staging)
        cou.go()
        for _ in range(3):
            model.update(torch.randperm(ROWS, device="cuda")[:5000])
        cou.cancel()
        assert cou._pending is None and not cou.active
        frozen = {n: t.clone() for n, t in staging.items()}
        for _ in range(5):
            model.update(torch.randperm(ROWS, device="cuda")[:5000])
        time.sleep(0.05)
        torch.cuda.synchronize()
        assert all(torch.equal(staging[n], frozen[n]) for n in staging)
        assert not all(torch.equal(staging[n], tables[n].cpu()) for n in staging)
        # and the next snapshot is whole again
        torch.cuda.synchronize()
        want = {n: t.cpu() for n, t in tables.items()}
        cou.start(tables, staging)
        cou.go()
        model.update(torch.randperm(ROWS, device="cuda")[:5000])
        cou.finish()
        assert all(np.array_equal(_bytes(staging[n]), _bytes(want[n])) for n in staging)
    finally:
        cou.close()
        area.close()


# ---- end to end: HybridDLRM on CUDA, NCCL, one rank -----------------------------------------
SIZES, B = (30_000, 20_000, 5_000, 400), 512


@pytest.fixture(scope="module")
def topology():
    from mpi4py import MPI

    from mpickpt.topology import Topology

    topo = Topology.from_mpi(MPI.COMM_SELF.Dup(), backend="nccl", timeout_s=120)
    yield topo
    topo.close()


def _model(topo):
    from mpickpt.model.dense import DenseArch
    from mpickpt.model.hybrid import HybridDLRM
    from mpickpt.model.optimizers import OptimizerConfig

    arch = DenseArch(num_dense=13, num_tables=len(SIZES), dim=16, bottom=(13, 16), top=(16, 1))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.05), seed=1)


@pytest.mark.parametrize("kind", ["full", "incrcp"])
def test_a_cuda_model_restores_exactly_its_copy_on_update_checkpoint(topology, tmp_path, kind):
    from mpickpt.data.position import SyntheticPosition
    from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
    from mpickpt.engine.config import CheckpointConfig
    from mpickpt.engine.manager import CheckpointManager
    from mpickpt.engine.restorer import Restorer

    model = _model(topology)
    assert model.topo.device.type == "cuda"
    config = CheckpointConfig(directory=str(tmp_path), interval=1000, resume="none", kind=kind,
                              keep=10, snapshot="copy-on-update")
    mgr = CheckpointManager(topology, config, model, log=lambda line: None)
    assert mgr.copier is not None
    mgr.copier.chunk_rows, mgr.copier.pause_s = 1000, 0.005  # the steps overtake the copier
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=4, seed=4))
    state, saves, want = SyntheticPosition(), (3, 6) if kind == "incrcp" else (6,), None
    for step in range(1, 13):
        batch, state = stream.read_slice(state, B, 0, 1)
        model.train_step(batch)
        if step in saves:
            torch.cuda.synchronize()
            want = {n: t.cpu().clone() for n, t in model.row_state().items()}
            dense = {n: t.cpu().clone() for n, t in model.dense_state().items()}
            assert mgr.save(step, state.to_dict())
        mgr.poll()
    hooked = mgr.copier.by_hook
    mgr.close()
    assert hooked > 0  # rows were copied by the hook ahead of their update
    fresh = _model(topology)
    restored = Restorer(topology, str(tmp_path), fresh, lambda line: None, "latest").restore()
    assert restored is not None and restored.step == saves[-1]
    for name, t in fresh.row_state().items():
        assert torch.equal(t.cpu(), want[name]), name
    for name, t in fresh.dense_state().items():
        assert torch.equal(t.cpu(), dense[name]), name
