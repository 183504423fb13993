"""A TorchRec DMP model (torchrec's DLRM over an EmbeddingBagCollection, fused optimizer)
under mpickpt on 2+ ranks: checkpointed by CheckpointManager and restored by Restorer into a
freshly built DMP, training on from the checkpoint gives the digest and predictions of the
uninterrupted run, bit for bit, under table-wise and row-wise plans and with fused row-wise
Adagrad, Adagrad and SGD (the dense part averaged by the adapter's own allreduce: DDP's rebuilt
buckets change the summation order at 4 ranks); a model whose features need row hooks is
refused by the contract. Skipped where torchrec is not installed."""
import pytest
import torch

from mpickpt.model.torchrec_support import installed_version

pytestmark = pytest.mark.skipif(installed_version("torchrec") is None,
                                reason="torchrec is not installed (.ci/run installs it)")
ROWS, DIM, B = (100, 60, 40, 20), 8, 16


def build(topo, sharding: str, seed: int, fused: str = "RowWiseAdagrad"):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_wise)
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM
    import torchrec.optim
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from mpickpt.model.torchrec import TorchRecModel, dense_allreduce_wrapper

    class CpuRowWise(EmbeddingBagCollectionSharder):  # the stock sharder offers row-wise on
        def sharding_types(self, compute_device_type):  # "cuda" only; it runs on CPU
            return super().sharding_types("cuda")

    torch.manual_seed(seed)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n,
                                 feature_names=[f"f{i}"]) for i, n in enumerate(ROWS)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                 dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
                 dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(getattr(torchrec.optim, fused), ebc.parameters(), {"lr": 0.1})
    world = topo.world_size
    spec = (lambda i: row_wise(compute_kernel="fused")) if sharding == "row_wise" else \
        (lambda i: table_wise(rank=i % world, compute_kernel="fused"))
    sharder = CpuRowWise()
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {f"t{i}": spec(i) for i in range(len(ROWS))}, sharder=sharder, local_size=world,
        world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                   env=ShardingEnv.from_process_group(topo.pg),
                                   sharders=[sharder],
                                   data_parallel_wrapper=dense_allreduce_wrapper())
    return TorchRecModel(dmp, topo, lambda params: torch.optim.Adagrad(params, lr=0.05))


def batch(rank: int, step: int):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 3, (len(ROWS) * B,), generator=g)
    values = torch.cat([torch.randint(0, n, (int(lengths[t * B:(t + 1) * B].sum()),),
                                      generator=g) for t, n in enumerate(ROWS)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(ROWS))],
                                              values=values, lengths=lengths)
    return Batch(dense_features=torch.randn(B, 13, generator=g), sparse_features=kjt,
                 labels=torch.randint(0, 2, (B,), generator=g).float())


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding,fused,states", [
    ("table_wise", "RowWiseAdagrad", ["state/momentum1", "weight"]),
    ("row_wise", "RowWiseAdagrad", ["state/momentum1", "weight"]),
    ("table_wise", "Adagrad", ["state/momentum1", "weight"]),
    ("row_wise", "SGD", ["weight"])])
def test_a_restored_dmp_trains_on_to_the_uninterrupted_digest(topology, shared_dir, sharding,
                                                              fused, states):
    from mpickpt.engine.config import CheckpointConfig
    from mpickpt.engine.manager import CheckpointManager
    from mpickpt.engine.restorer import Restorer

    rank = topology.rank
    first = build(topology, sharding, seed=0, fused=fused)
    assert first.plan.total_rows == sum(ROWS)
    assert sorted(first.row_state()) == states
    config = CheckpointConfig(directory=shared_dir, interval=1000, resume="none")
    mgr = CheckpointManager(topology, config, first, log=lambda line: None)
    for step in range(3):
        first.train_step(batch(rank, step))
    assert mgr.save(3, {"kind": "synthetic", "sample_index": 3 * B})
    mgr.close()
    for step in range(3, 5):
        first.train_step(batch(rank, step))
    expected, probe = first.digest(), first.predict(batch(rank, 9))

    second = build(topology, sharding, seed=1, fused=fused)  # other initial rows and dense
    assert second.digest() != expected
    restored = Restorer(topology, shared_dir, second, lambda line: None).restore()
    assert restored is not None and restored.step == 3
    for step in range(3, 5):
        second.train_step(batch(rank, step))
    assert second.digest() == expected
    assert torch.equal(second.predict(batch(rank, 9)), probe)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_features_that_need_row_hooks_refuse_the_adapter(topology):
    from mpickpt.model.contract import ModelContractError
    from mpickpt.parity.guard import ParityConfig, ParityGuard

    model = build(topology, "table_wise", seed=0)
    with pytest.raises(ModelContractError, match=r"TorchRecModel cannot be used with parity "
                                                 r"\(--parity-k\): it lacks "
                                                 r"embeddings.add_index_hook"):
        ParityGuard(topology, model, ParityConfig(k=1), print)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_table_wise_checkpoint_restores_into_a_row_wise_plan(topology, shared_dir):
    """Checkpoints are keyed by global row id, so another sharding plan restores them: the
    row-wise model predicts what the table-wise one did (to float rounding: row-wise pooling
    sums partial bags across ranks)."""
    from mpickpt.engine.config import CheckpointConfig
    from mpickpt.engine.manager import CheckpointManager
    from mpickpt.engine.restorer import Restorer

    rank = topology.rank
    first = build(topology, "table_wise", seed=0)
    mgr = CheckpointManager(topology, CheckpointConfig(directory=shared_dir, interval=1000,
                                                       resume="none"), first, log=lambda l: None)
    for step in range(3):
        first.train_step(batch(rank, step))
    assert mgr.save(3, {"kind": "synthetic", "sample_index": 3 * B})
    mgr.close()
    probe = first.predict(batch(rank, 9))
    second = build(topology, "row_wise", seed=1)
    assert second.plan.describe() != first.plan.describe()
    assert not torch.allclose(second.predict(batch(rank, 9)), probe)
    assert Restorer(topology, shared_dir, second, lambda line: None).restore().step == 3
    assert torch.allclose(second.predict(batch(rank, 9)), probe, rtol=0, atol=1e-6)
    assert second.digest() == first.digest()  # the same rows by global id, the same dense part
