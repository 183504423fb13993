"""Row tracking attached to the owner's index hook marks exactly the rows the batches touched."""
import pytest
import torch

from mpickpt.data.position import SyntheticPosition
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.model.shard_plan import ShardPlanOptions
from mpickpt.track.bitvector import RowBitVector

SIZES = (5000, 700, 90, 3)


@pytest.mark.mpi(min_size=1)
def test_tracking_marks_exactly_the_touched_owned_rows(topology):
    world, rank = topology.world_size, topology.rank
    arch = DenseArch(num_dense=13, num_tables=4, dim=4, bottom=(13, 4), top=(1,))
    model = HybridDLRM(topology, arch, SIZES, OptimizerConfig(kind="sgd", lr=0.1), seed=0,
                       plan_options=ShardPlanOptions(row_wise_threshold=1000))
    tracker = RowBitVector(model.plan.local_rows(rank))
    tracker.attach(model.embeddings)
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2))
    gb, state = 16 * world, SyntheticPosition()
    for interval in range(2):
        touched = set()
        before = model.embeddings.weight.clone()
        for _ in range(3):
            full, _ = stream.read_slice(state, gb, 0, 1)  # the global batch, to compute the truth
            batch, state = stream.read_slice(state, gb, rank, world)
            model.train_step(batch)
            gids = full.sparse + torch.as_tensor(model.plan.table_offsets[:-1]).view(1, 4, 1)
            owner, local = model.plan.owner_of(gids.flatten())
            touched |= set(local[owner == rank].tolist())
        rows = tracker.extract()
        assert rows.tolist() == sorted(touched)
        changed = torch.nonzero((model.embeddings.weight != before).any(dim=1)).flatten()
        assert set(changed.tolist()) <= touched  # tracked rows cover every changed row
