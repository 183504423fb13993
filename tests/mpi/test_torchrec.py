"""A TorchRec DMP model (torchrec's DLRM over an EmbeddingBagCollection, fused optimizer)
under mpickpt on 2+ ranks: checkpointed by CheckpointManager and restored by Restorer into a
freshly built DMP, training on from the checkpoint gives the digest and predictions of the
uninterrupted run, bit for bit, under table-wise and row-wise plans and with fused row-wise
Adagrad, Adagrad and SGD (the dense part averaged by the adapter's own allreduce: DDP's rebuilt
buckets change the summation order at 4 ranks); the row hooks see exactly the rows the fused
update changes; the step undo takes a fused step back; column-wise tables are refused. The
trainer's jobs with every feature are in tests/test_torchrec_training.py. Skipped where torchrec
is not installed."""
import threading

import pytest
import torch

from mpickpt.model.torchrec_support import installed_version

pytestmark = pytest.mark.skipif(installed_version("torchrec") is None,
                                reason="torchrec is not installed (.ci/run installs it)")
ROWS, DIM, B = (100, 60, 40, 20), 8, 16


def build(topo, sharding: str, seed: int, fused: str = "RowWiseAdagrad", kernel: str = "fused",
          rows=ROWS, dense=torch.optim.Adagrad):
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
                                 feature_names=[f"f{i}"]) for i, n in enumerate(rows)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRM(embedding_bag_collection=ebc, dense_in_features=13,
                 dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
                 dense_device=torch.device("cpu"))
    apply_optimizer_in_backward(getattr(torchrec.optim, fused), ebc.parameters(), {"lr": 0.1})
    world = topo.world_size
    spec = (lambda i: row_wise(compute_kernel=kernel)) if sharding == "row_wise" else \
        (lambda i: table_wise(rank=i % world, compute_kernel=kernel))
    sharder = CpuRowWise()
    plan = ShardingPlan({"sparse_arch.embedding_bag_collection": construct_module_sharding_plan(
        ebc, {f"t{i}": spec(i) for i in range(len(rows))}, sharder=sharder, local_size=world,
        world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                   env=ShardingEnv.from_process_group(topo.pg),
                                   sharders=[sharder],
                                   data_parallel_wrapper=dense_allreduce_wrapper())
    return TorchRecModel(dmp, topo, lambda params: dense(params, lr=0.05))


def batch(rank: int, step: int, rows=ROWS):
    from torchrec.datasets.utils import Batch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths = torch.randint(1, 3, (len(rows) * B,), generator=g)
    values = torch.cat([torch.randint(0, n, (int(lengths[t * B:(t + 1) * B].sum()),),
                                      generator=g) for t, n in enumerate(rows)])
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{i}" for i in range(len(rows))],
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


def _by_gid(topo, model, name: str) -> torch.Tensor:
    """Every rank's rows of `row_state()[name]` in global id order. Collective."""
    parts = topo.control.allgather((model.embeddings.local_gids,
                                    model.row_state()[name].detach().clone()))
    gids = torch.cat([torch.as_tensor(g) for g, _ in parts])
    return torch.cat([t for _, t in parts])[torch.argsort(gids)]


def _take(lock) -> bool:
    if lock.acquire(blocking=False):
        lock.release()
        return True
    return False


class Recorder:
    """An update hook and index/count hooks that keep what they were told."""

    def __init__(self, model):
        self.model, self.seen, self.counts, self.calls = model, [], [], []
        emb = model.embeddings
        emb.add_index_hook(self.seen.append)
        emb.add_count_hook(lambda rows, counts: self.counts.append((rows, counts)))
        emb.add_update_hook(self)
        emb.add_gradient_hook(self.gradient)

    def gradient(self):
        """Keeps the rows as they are when the gradient hook runs, and whether another thread
        (a survivor dump) could take the state lock then."""
        self.calls.append("gradient")
        self.rows_at_gradient = self.model.embeddings.weight.clone()
        free = []
        probe = threading.Thread(target=lambda: free.append(_take(self.model.state_lock)))
        probe.start()
        probe.join()
        self.lock_free_at_gradient = free == [True]

    def before_update(self, rows):
        self.calls.append("before")
        return self.model.embeddings.weight[rows].clone()

    def after_update(self, rows, old):
        self.calls.append("after")
        self.changed = ~(self.model.embeddings.weight[rows] == old).all(dim=1)

    def step_done(self):
        self.calls.append("done")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sharding", ["table_wise", "row_wise"])
def test_row_hooks_see_exactly_the_rows_a_step_updates(topology, sharding):
    """The ids after the input distribution, mapped to local rows, are the rows the fused
    backward changes: no changed row is missed, every seen row changed (row-wise Adagrad moves
    every row with a gradient), the update hooks bracket it, the gradient hooks run between
    the lookup and the update, outside the update lock, predictions call no hook."""
    from mpickpt.model.contract import CAPABILITIES, capabilities_of

    model = build(topology, sharding, seed=0)
    # every capability; the initial rows only with init_seed (TorchRec's own are not recomputable)
    assert capabilities_of(model) == [c.name for c in CAPABILITIES if c.name != "initial rows"]
    rec = Recorder(model)
    model.predict(batch(topology.rank, 7))
    assert rec.seen == [] and rec.calls == []
    before = model.embeddings.weight.clone()
    model.train_step(batch(topology.rank, 0))
    assert rec.calls == ["before", "gradient", "after", "done"]
    assert torch.equal(rec.rows_at_gradient, before) and rec.lock_free_at_gradient
    (rows,) = rec.seen
    changed = torch.nonzero(~(model.embeddings.weight == before).all(dim=1)).flatten()
    assert torch.equal(rows, changed) and bool(rec.changed.all())
    (count_rows, counts), = rec.counts
    assert torch.equal(count_rows, rows) and int(counts.min()) >= 1
    assert len(rows) > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_the_step_undo_takes_a_fused_step_back(topology):
    """StepUndo records the rows' old values from the lookup's ids (the fused update leaves no
    other point) and the dense part before its step: undoing the last step restores the digest
    of the step before, bit for bit."""
    from mpickpt.survivors.undo import StepUndo

    model = build(topology, "row_wise", seed=0)
    undo = StepUndo(model)
    model.train_step(batch(topology.rank, 0))
    expected = model.digest()
    undo.begin(1, {"at": 1})
    model.train_step(batch(topology.rank, 1))
    undo.complete()
    assert model.digest() != expected
    assert undo.undo_last() == {"at": 1}
    assert model.digest() == expected


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_kernel_without_a_fused_optimizer_is_refused_naming_it(topology):
    from mpickpt.model.torchrec import TorchRecContractError

    with pytest.raises(TorchRecContractError, match=r"tables \['t\d'(, 't\d')*\] use "
                                                    r"BatchedDenseEmbeddingBag .*mpickpt maps "
                                                    r"fused kernels"):
        build(topology, "table_wise", seed=0, kernel="dense")


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_column_wise_table_is_refused_naming_it(topology):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    import torchrec.optim
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from mpickpt.model.torchrec import TorchRecContractError, TorchRecModel
    from mpickpt.model.torchrec_dlrm import cpu_capable_sharder

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="wide", embedding_dim=8, num_embeddings=50, feature_names=["f"])],
        device=torch.device("meta"))
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {"lr": 0.1})
    sharder = cpu_capable_sharder()
    world = topology.world_size
    plan = ShardingPlan({"": construct_module_sharding_plan(
        ebc, {"wide": column_wise(ranks=list(range(world)), compute_kernel="fused")},
        sharder=sharder, local_size=world, world_size=world, device_type="cpu")})
    dmp = DistributedModelParallel(module=torch.nn.Sequential(ebc), device=torch.device("cpu"),
                                   plan=ShardingPlan({"0": plan.plan[""]}),
                                   env=ShardingEnv.from_process_group(topology.pg),
                                   sharders=[sharder])
    with pytest.raises(TorchRecContractError, match=r"tables \{'wide': .*column_wise.*\} are "
                                                    r"sharded in a way mpickpt does not map"):
        TorchRecModel(dmp, topology)


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


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_row_wise_plan_that_leaves_a_rank_no_rows_of_a_table_trains_and_restores(
        topology, shared_dir):
    """Row-wise, torchrec gives each rank ceil(rows / world) rows of a table, so the last ranks
    get none of a small one (a 1-row table here, as Criteo's presets have): those empty pieces
    are no shards of the plan, and the model trains, checkpoints and restores under a
    table-wise plan to the same rows and dense part."""
    from mpickpt.engine.config import CheckpointConfig
    from mpickpt.engine.manager import CheckpointManager
    from mpickpt.engine.restorer import Restorer

    rank, tiny = topology.rank, (3, 1, 2, 50)
    first = build(topology, "row_wise", seed=0, rows=tiny)
    shards = first.plan.shards
    assert all(s.row_end > s.row_start for s in shards)
    assert sum(s.row_end - s.row_start for s in shards if s.table == 1) == 1
    mgr = CheckpointManager(topology, CheckpointConfig(directory=shared_dir, interval=1000,
                                                       resume="none"), first, log=lambda l: None)
    for step in range(3):
        first.train_step(batch(rank, step, tiny))
    assert mgr.save(3, {"kind": "synthetic", "sample_index": 3 * B})
    mgr.close()
    second = build(topology, "table_wise", seed=1, rows=tiny)
    assert Restorer(topology, shared_dir, second, lambda line: None).restore().step == 3
    assert second.digest() == first.digest()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_an_export_to_dcp_loads_into_a_fresh_dmp_with_plain_dcp_load(topology, shared_dir):
    """What a TorchRec user does with the export: `dcp.load` of `dmp.state_dict()` and of the
    fused optimizer's state into a DMP under another plan; it predicts what the exported model
    did. mpickpt's own import (`load_dcp`) also brings the dense optimizer: the same digest."""
    import torch.distributed.checkpoint as dcp

    from mpickpt.model.torchrec_dcp import load_dcp, save_dcp

    rank = topology.rank
    first = build(topology, "table_wise", seed=0)
    for step in range(3):
        first.train_step(batch(rank, step))
    save_dcp(first, f"{shared_dir}/dcp", 3, {"kind": "synthetic", "sample_index": 48})
    probe = first.predict(batch(rank, 9))
    user = build(topology, "row_wise", seed=1)
    state = {"model": user.dmp.state_dict(), "fused_optimizer":
             user.dmp.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=f"{shared_dir}/dcp", process_group=topology.pg)
    user.dmp.fused_optimizer.load_state_dict(state["fused_optimizer"])
    assert torch.allclose(user.predict(batch(rank, 9)), probe, rtol=0, atol=1e-6)
    for name in ("weight", "state/momentum1"):  # the fused optimizer state came back too
        assert torch.equal(_by_gid(topology, user, name), _by_gid(topology, first, name)), name
    ours = build(topology, "row_wise", seed=2)
    assert load_dcp(ours, f"{shared_dir}/dcp") == {"step": 3, "reader": {
        "kind": "synthetic", "sample_index": 48}}
    assert ours.digest() == first.digest()
    for sharding in ("table_wise", "row_wise"):  # a run of plain SGD has no optimizer state
        sgd, said = build(topology, sharding, seed=3, fused="SGD", dense=torch.optim.SGD), []
        assert load_dcp(sgd, f"{shared_dir}/dcp", said.append)["step"] == 3
        assert [s.split(": ")[1] for s in said] == [
            "its fused_optimizer state is not loaded", "its dense_optimizer state is not loaded"]
        assert torch.allclose(sgd.predict(batch(rank, 9)), probe, rtol=0, atol=1e-6)
        assert torch.equal(_by_gid(topology, sgd, "weight"), _by_gid(topology, first, "weight"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_sharded_module_it_does_not_map_is_refused_naming_it(topology):
    """A sequence EmbeddingCollection beside the bag collection (as a managed-collision
    wrapper would be): refused at construction, never checkpointed partly."""
    from torchrec import (EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection,
                          EmbeddingConfig)
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    import torchrec.optim
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from mpickpt.model.torchrec import TorchRecContractError, TorchRecModel
    from mpickpt.model.torchrec_dlrm import cpu_capable_sharder

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
                name="a", embedding_dim=8, num_embeddings=50, feature_names=["fa"])],
                device=torch.device("meta"))
            self.ec = EmbeddingCollection(tables=[EmbeddingConfig(
                name="s", embedding_dim=8, num_embeddings=40, feature_names=["fs"])],
                device=torch.device("meta"))

    model, world = Both(), topology.world_size
    for module in (model.ebc, model.ec):
        apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, module.parameters(),
                                    {"lr": 0.1})
    bags, seqs = cpu_capable_sharder(), EmbeddingCollectionSharder()
    plan = ShardingPlan({name: construct_module_sharding_plan(
        module, {table: table_wise(rank=rank, compute_kernel="fused")}, sharder=sharder,
        local_size=world, world_size=world, device_type="cpu")
        for name, module, table, rank, sharder in (("ebc", model.ebc, "a", 0, bags),
                                                    ("ec", model.ec, "s", 1, seqs))})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"), plan=plan,
                                   env=ShardingEnv.from_process_group(topology.pg),
                                   sharders=[bags, seqs])
    with pytest.raises(TorchRecContractError, match=r"sharded modules \{'ec': "
                                                    r"'ShardedEmbeddingCollection'\} are not "
                                                    r"mapped by mpickpt"):
        TorchRecModel(dmp, topology)
