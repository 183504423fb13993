"""Partial recovery in process on 1, 2 and 4 ranks: the lost shard (rank 1's where there are two
ranks or more, a middle rank on 4) reloads exactly the latest checkpoint's rows and optimizer state
(full, quantized incrcp and prioritized kinds, row-wise split tables, a whole rank or half of one);
every other row, the dense part and the step stay as they were; the PLS grows by eq. 3, and a full
rollback inside the job returns it to the restored checkpoint's; the failure emulator draws the
same failures on every rank; the prioritized kinds report their trackers' memory."""
import math
import re

import numpy as np
import pytest
import torch

from mpickpt.checkpoint.load import load_checkpoint, load_row_range
from mpickpt.data.position import SyntheticPosition
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.manager import CheckpointManager
from mpickpt.engine.restorer import Restorer
from mpickpt.engine.snapshot import numpy_dtype
from mpickpt.faults.emulator import FailureEmulator
from mpickpt.faults.loss import Loss, LostShard
from mpickpt.faults.process import FailureModel
from mpickpt.kinds.priority import Priority
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.model.shard_plan import ShardPlanOptions
from mpickpt.quant.config import QuantConfig
from mpickpt.recovery.full_rollback import FullRollback
from mpickpt.recovery.partial import PartialRecovery
from mpickpt.recovery.pls import PLSAccount
from mpickpt.store.manifest import list_manifests
from mpickpt.track.priority import budget

SIZES = (3000, 700, 90, 5)
BATCH = 32
# incrcp's cost model may take a new baseline at any save when the writes' timings say so (it did
# under CI load): one chain for the run keeps step 6 an increment, which is what is tested here
KINDS = {"full": {},
         "incrcp-4bit": {"kind": "incrcp", "incrcp_reset": "never", "quant": QuantConfig(bits="4")},
         "priority-mfu": {"priority": "mfu", "save_fraction": 0.25}}


def _model(topo):
    arch = DenseArch(num_dense=13, num_tables=4, dim=8, bottom=(13, 8), top=(1,))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.05), seed=3,
                      plan_options=ShardPlanOptions(row_wise_threshold=1000))


@pytest.fixture
def ckpt_dir(shared_dir):
    return shared_dir


def _train(topo, model, ckpt, steps, after=None):
    """Train `steps` steps, checkpointing when due; `after(step)` after each. Collective."""
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=5))
    state = SyntheticPosition()
    for step in range(1, steps + 1):
        batch, state = stream.read_slice(state, BATCH * topo.world_size, topo.rank,
                                         topo.world_size)
        model.train_step(batch)
        if ckpt.due(step):
            ckpt.save(step, state.to_dict())
            ckpt.schedule.passed(step)
        if after is not None:
            after(step)


def _lost_rank(topo) -> int:
    """Rank 1 where there is one (a middle rank on 4 ranks), else rank 0."""
    return 1 if topo.world_size >= 2 else 0


def _templates(model):
    return {k: (tuple(t.shape[1:]), np.dtype(numpy_dtype(t))) for k, t in model.row_state().items()}


def _checkpoint_rows(root, model, topo):
    """This rank's rows as the newest committed checkpoint holds them (decoded)."""
    manifests = list_manifests(root)
    loaded = load_checkpoint(root, manifests[-1], model.plan, topo.rank, model.embeddings.dim,
                             _templates(model), {m.step: m for m in manifests})
    return manifests[-1], loaded.rows


def _all(topo, ok) -> bool:
    return all(topo.control.allgather(bool(ok)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("half", [False, True], ids=["whole-rank", "half-rank"])
def test_partial_recovery_reloads_only_the_lost_rows(topology, ckpt_dir, kind, half):
    topo = topology
    model = _model(topo)
    config = CheckpointConfig(directory=ckpt_dir, interval=2, keep=10, resume="none",
                              **KINDS[kind])
    lines = []
    ckpt = CheckpointManager(topo, config, model, log=lines.append)
    restorer = Restorer(topo, ckpt_dir, model, lines.append)
    _train(topo, model, ckpt, 7)  # checkpoints at 2, 4, 6; the loss comes after step 7
    ckpt.quiesce()  # step 6 committed and ingested on every rank
    manifest, saved = _checkpoint_rows(ckpt_dir, model, topo)
    assert manifest.step == 6 and (manifest.kind != "full") == (kind != "full")
    before = {k: v.clone() for k, v in model.row_state().items()}
    dense = {k: v.clone() for k, v in model.dense_state().items()}
    lost = _lost_rank(topo)
    held = model.plan.local_rows(lost)
    shard = LostShard(lost, 0, held // 2 if half else held, held)
    loss = Loss((shard,), after_step=7)
    if topo.rank == lost:
        model.embeddings.wipe_range(shard.start, shard.stop)
    total = sum(SIZES)
    pls = PLSAccount(total_samples=100 * BATCH * topo.world_size)
    policy = PartialRecovery(ckpt, restorer, model, pls, BATCH * topo.world_size, lines.append)
    outcome = policy.recover(loss)
    assert outcome.step == 7 and outcome.reader_state is None and outcome.rolled_back == {lost}
    for name, now in model.row_state().items():
        now = now.cpu().numpy()
        if topo.rank == lost:
            a, b = shard.start, shard.stop
            assert np.array_equal(now[a:b], saved[name][a:b]), name  # exactly the checkpoint's
            assert np.array_equal(now[b:], before[name][b:].numpy()), name
        else:
            assert np.array_equal(now, before[name].numpy()), name  # untouched
    assert _all(topo, all(torch.equal(v, dense[k]) for k, v in model.dense_state().items()))
    # eq. 3: the shard's share of the rows x the samples since its last save (step 6)
    assert pls.value == pytest.approx(shard.rows / total * (7 - 6) * BATCH * topo.world_size
                                      / pls.total_samples)
    written = None  # the step whose value each reloaded row holds
    if topo.rank == lost:
        _, written = load_row_range(ckpt_dir, manifest, model.plan, lost, model.embeddings.dim,
                                    _templates(model),
                                    {m.step: m for m in list_manifests(ckpt_dir)},
                                    (shard.start, shard.stop))
        assert (written == 6).all() == (kind != "priority-mfu")  # stale rows only if prioritized
        assert written.min() >= 2  # the baseline at step 2
    assert restorer.seconds and ckpt.bits.restores == 1
    ckpt.close()


@pytest.mark.mpi(min_size=1)
def test_with_nothing_committed_the_lost_rows_restart_from_the_initial_model(topology, ckpt_dir):
    topo = topology
    model = _model(topo)
    initial = {k: v.clone() for k, v in model.row_state().items()}
    ckpt = CheckpointManager(topo, CheckpointConfig(directory=ckpt_dir, interval=50,
                                                    resume="none"), model, log=lambda _: None)
    _train(topo, model, ckpt, 3)
    trained = {k: v.clone() for k, v in model.row_state().items()}
    loss = Loss.of_ranks([0], 3, model.plan)
    if topo.rank == 0:
        model.embeddings.wipe_rows([0])
    pls = PLSAccount(1000)
    PartialRecovery(ckpt, Restorer(topo, ckpt_dir, model, lambda _: None), model, pls, 10,
                    lambda _: None).recover(loss)
    want = initial if topo.rank == 0 else trained
    assert _all(topo, all(torch.equal(v, want[k]) for k, v in model.row_state().items()))
    assert pls.value == pytest.approx(model.plan.local_rows(0) / sum(SIZES) * 3 * 10 / 1000)
    ckpt.close()


@pytest.mark.mpi(min_size=2)
def test_the_emulator_draws_the_same_failures_on_every_rank(topology):
    plan = _model(topology).plan
    rows = [plan.local_rows(r) for r in range(plan.world_size)]
    emulator = FailureEmulator(FailureModel.parse("cpr:25"), 1.0, 0.125, rows, seed=11)
    mine = emulator.draw(30)
    everyone = topology.control.allgather(mine)
    assert all(other == mine for other in everyone)
    assert {s.rank for f in mine for s in f.shards} == set(range(topology.world_size))


@pytest.mark.mpi(min_size=1)
def test_a_full_rollback_in_the_job_returns_the_pls_to_the_restored_checkpoints(topology,
                                                                                 ckpt_dir):
    topo = topology
    model = _model(topo)
    ckpt = CheckpointManager(topo, CheckpointConfig(directory=ckpt_dir, interval=2, keep=10,
                                                    resume="none"), model, log=lambda _: None)
    restorer = Restorer(topo, ckpt_dir, model, lambda _: None)
    global_batch = BATCH * topo.world_size
    pls = PLSAccount(total_samples=100 * global_batch)
    ckpt.stats_sources.append(lambda: {"pls": pls.to_stats()})  # as the trainer records it
    partial = PartialRecovery(ckpt, restorer, model, pls, global_batch, lambda _: None)
    lost = _lost_rank(topo)
    share = model.plan.local_rows(lost) / sum(SIZES)

    def partial_after(step):
        if step in (3, 7):  # after the saves at 2 and 6
            partial.recover(Loss.of_ranks([lost], step, model.plan))
    _train(topo, model, ckpt, 7, after=partial_after)  # checkpoints at 2, 4, 6
    first = share * (3 - 2) * global_batch / pls.total_samples
    assert pls.value == pytest.approx(2 * first) and pls.recoveries == 2
    ckpt.quiesce()
    recorded = {m.step: m.stats["pls"] for m in list_manifests(ckpt_dir)}
    assert recorded[2] == {"value": 0.0, "partial_recoveries": 0}
    assert recorded[6]["value"] == pytest.approx(first) and recorded[6]["partial_recoveries"] == 1
    lines = []
    restorer.say = lines.append
    full = FullRollback(ckpt, restorer, topo.world_size, model, {}, pls)
    outcome = full.recover(Loss.of_ranks([lost], 7, model.plan))
    assert outcome.step == 6
    # the rollback replays steps 7.. with every row back at step 6: the second recovery is undone
    assert pls.value == recorded[6]["value"] and pls.recoveries == 1
    assert pls.events[-1] == {"step": 6, "rolled_back": True, "change": pytest.approx(-first),
                              "pls": recorded[6]["value"]}
    assert any(f"full rollback to step 6: PLS -{first:.5f} = {first:.5f} after 1 partial" in line
               for line in lines), lines
    ckpt.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("rule", ["mfu", "ssu", "scar"])
def test_prioritized_saves_report_their_trackers_memory(topology, ckpt_dir, rule):
    model = _model(topology)
    kind = Priority(sum(SIZES), CheckpointConfig(directory=ckpt_dir, priority=rule,
                                                 save_fraction=0.25))
    line = kind.attach(model)
    kind.detach()
    rows, dim = model.plan.local_rows(topology.rank), model.embeddings.dim
    caps = sum(budget(s.rows, 0.25) for s in model.plan.shards_of(topology.rank))
    expected = {"mfu": 4 * rows,  # CPR Table 1: a 4-byte counter per row
                "ssu": 4 * caps + 8 * math.ceil(rows / 32),  # r x n int32 ids, a bit per row
                "scar": rows * dim * 4 + rows}[rule]  # the last-saved fp32 weights, a dirty byte
    reported = re.search(r"tracker memory (\d+) bytes \(([0-9.]+) MB\) on rank (\d+), "
                         r"([0-9.]+)% of its embedding rows", line)
    assert reported, line
    assert int(reported.group(1)) == expected and int(reported.group(3)) == topology.rank
    assert float(reported.group(4)) == pytest.approx(100 * expected / (rows * dim * 4), abs=0.01)


@pytest.mark.mpi(min_size=1)
def test_recoveries_in_a_generation_formed_after_the_run_s_end_closed_the_checkpoints(topology,
                                                                                     ckpt_dir):
    """In place after the run's end: rank 0's manager is closed, the others' still open with
    nothing in flight (as a survivor that lagged in the close before it stops its writers). A
    partial recovery reloads the newest checkpoint's rows and a full rollback restores it on
    every rank; a closed manager saves nothing in the steps a rollback replays and lets the
    reader run to the end; the closed rank says the summary its close would have said."""
    topo = topology
    model = _model(topo)
    lines = []
    ckpt = CheckpointManager(topo, CheckpointConfig(directory=ckpt_dir, interval=2, keep=10,
                                                    resume="none"), model, log=lines.append)
    restorer = Restorer(topo, ckpt_dir, model, lambda _: None)
    _train(topo, model, ckpt, 7)  # checkpoints at 2, 4, 6
    ckpt.quiesce()
    manifest, saved = _checkpoint_rows(ckpt_dir, model, topo)
    if topo.rank == 0:
        ckpt.abort(summary=True)
        assert any(line.startswith("checkpoints: 3 saved, 3 committed, 0 abandoned")
                   for line in lines), lines
    assert ckpt.closed == (topo.rank == 0) and not ckpt.busy
    lost = _lost_rank(topo)
    if topo.rank == lost:
        model.embeddings.wipe_rows([0])
    partial = PartialRecovery(ckpt, restorer, model, PLSAccount(1000), BATCH, lambda _: None)
    assert partial.recover(Loss.of_ranks([lost], 7, model.plan)).step == 7
    if topo.rank == lost:
        assert all(np.array_equal(v.cpu().numpy(), saved[k]) for k, v in model.row_state().items())
    model.embeddings.wipe_rows([0])
    outcome = FullRollback(ckpt, restorer, topo.world_size, model).recover(Loss.of_ranks([lost], 7,
                                                                                      model.plan))
    assert outcome.step == manifest.step == 6 and outcome.reader_state is not None
    assert _all(topo, all(np.array_equal(v.cpu().numpy(), saved[k])
                          for k, v in model.row_state().items()))
    if topo.rank == 0:  # replaying steps 7 and 8: no save at 8, the reader allowed to the end
        ckpt.after_step(8, None, 10)
        assert ckpt.allowance(6, 10) == 4 and not ckpt.save_now(8, None)
    topo.control.Barrier()
    assert [m.step for m in list_manifests(ckpt_dir)] == [2, 4, 6]
    ckpt.abort()
