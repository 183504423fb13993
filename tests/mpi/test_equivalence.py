"""Sharded training equals a single-process dense reference, at every world size."""
import numpy as np
import pytest
import torch

from mpickpt.data.batch import Batch
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.model.shard_plan import ShardPlanOptions
from tests.reference_dlrm import ReferenceDLRM

LAYOUTS = {
    # name: (table sizes, pooling, row-wise threshold)
    "table-wise": ((50, 7, 120, 33, 9), 1, 10**9),
    "row-wise": ((50, 7, 120, 33, 9), 1, 40),
    "multi-hot": ((64, 200, 5), 3, 60),
}
STEPS = 5
GLOBAL_BATCH = 16


def global_batches(table_sizes, pooling, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        dense = torch.rand(GLOBAL_BATCH, 13, generator=g)
        cols = [torch.randint(0, n, (GLOBAL_BATCH, 1, pooling), generator=g) for n in table_sizes]
        labels = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g).float()
        yield dense, torch.cat(cols, dim=1), labels


def local_slice(rank, world, dense, sparse, labels):
    b = GLOBAL_BATCH // world
    s = slice(rank * b, (rank + 1) * b)
    return Batch(dense=dense[s], sparse=sparse[s], labels=labels[s])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", ["adagrad", "sgd", "momentum"])
def test_sharded_matches_dense_reference(topology, layout, kind):
    sizes, pooling, threshold = LAYOUTS[layout]
    arch = DenseArch(num_dense=13, num_tables=len(sizes), dim=4, bottom=(13, 8, 4), top=(8, 1))
    optim = OptimizerConfig(kind=kind, lr=0.05)
    model = HybridDLRM(topology, arch, sizes, optim, seed=7,
                       plan_options=ShardPlanOptions(row_wise_threshold=threshold))
    ref = ReferenceDLRM(arch, sizes, optim, seed=7)
    for dense, sparse, labels in global_batches(sizes, pooling, seed=3):
        expect = ref.step(dense, sparse, labels)
        got = model.train_step(local_slice(topology.rank, topology.world_size, dense, sparse, labels))
        assert got == pytest.approx(expect, abs=1e-5)
    tables = model.gather_tables(root=0)
    if topology.rank == 0:
        for t, w in enumerate(ref.tables):
            np.testing.assert_allclose(tables[t]["weight"], w.detach().numpy(), atol=1e-5)
            for name, value in ref.state[t].items():
                np.testing.assert_allclose(tables[t][name], value.numpy(), atol=1e-5)
    for p, q in zip(model.dense.parameters(), ref.dense.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), atol=1e-5, rtol=0)
    assert model.steps_done == STEPS


@pytest.mark.mpi(min_size=2)
def test_training_actually_changes_rows_on_every_owner(topology):
    sizes = (40, 40, 40, 40)
    arch = DenseArch(num_dense=13, num_tables=4, dim=4, bottom=(13, 4), top=(1,))
    model = HybridDLRM(topology, arch, sizes, OptimizerConfig(kind="sgd", lr=0.5), seed=1,
                       plan_options=ShardPlanOptions(row_wise_threshold=10))
    before = model.embeddings.weight.clone()
    seen = []
    model.embeddings.add_index_hook(lambda rows: seen.append(rows.clone()))
    dense, sparse, labels = next(global_batches(sizes, 1, seed=5))
    model.train_step(local_slice(topology.rank, topology.world_size, dense, sparse, labels))
    rows = torch.unique(torch.cat(seen))
    changed = torch.nonzero((model.embeddings.weight != before).any(dim=1)).flatten()
    assert torch.equal(rows, changed)
    expected = set()
    gids = sparse + torch.tensor(model.plan.table_offsets[:-1]).view(1, 4, 1)
    owner, lrow = model.plan.owner_of(gids.flatten())
    expected = set(lrow[owner == topology.rank].tolist())
    assert set(rows.tolist()) == expected
