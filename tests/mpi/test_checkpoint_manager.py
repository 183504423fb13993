"""CheckpointManager in-process on 1, 2 and 4 ranks: writers spawned under mpiexec, overlap
policies, gap control, and a save/restore round trip."""
import shutil
import tempfile

import pytest
import torch

from mpickpt.data.position import SyntheticPosition
from mpickpt.data.prefetch import PrefetchReader
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.manager import CheckpointManager
from mpickpt.engine.restorer import Restorer
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.store.manifest import list_manifests

SIZES = (200_000, 100_000, 5_000, 300)  # large enough that a write outlasts a staging copy


def make_model(topo, seed=0):
    arch = DenseArch(num_dense=13, num_tables=len(SIZES), dim=16, bottom=(13, 16), top=(8, 1))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.05), seed)


@pytest.fixture
def ckpt_dir(topology):
    path = topology.control.bcast(tempfile.mkdtemp(prefix="mpickpt-test-") if topology.is_root
                                  else None)
    yield path
    topology.control.Barrier()
    if topology.is_root:
        shutil.rmtree(path, ignore_errors=True)


def manager(topo, model, directory, **kw):
    config = CheckpointConfig(directory=directory, interval=kw.pop("interval", 1),
                              resume=kw.pop("resume", "none"), **kw)
    lines = []
    return CheckpointManager(topo, config, model, log=lines.append), lines


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("policy", ["wait", "skip"])
def test_overlapping_checkpoints_wait_or_skip(topology, ckpt_dir, policy):
    model = make_model(topology)
    mgr, lines = manager(topology, model, ckpt_dir, overlap=policy, keep=5)
    assert mgr.save(1, {"kind": "synthetic", "sample_index": 0})
    second = mgr.save(2, {"kind": "synthetic", "sample_index": 0})  # first still writing
    mgr.close()
    steps = [m.step for m in list_manifests(ckpt_dir)]
    if policy == "skip":
        assert second is False and mgr.counters["skips"] == 1 and steps == [1]
        assert topology.rank != 0 or any("skipped" in l for l in lines)
    else:
        assert second is True and mgr.counters["waits"] == 1 and steps == [1, 2]
        assert topology.rank != 0 or any("waited" in l for l in lines)


@pytest.mark.mpi(min_size=1)
def test_the_overlap_vote_a_step_ahead_never_lets_a_save_overtake_a_write(topology, ckpt_dir):
    """`look_ahead` votes while the step before a checkpoint trains: a vote taken when nobody
    was writing lets the save go, one taken while a write was in flight makes the save vote
    again and wait, and a vote whose step may come again (a rollback: `resumed_at`) is
    dropped."""
    model = make_model(topology)
    mgr, _ = manager(topology, model, ckpt_dir, overlap="wait", keep=5)
    state = {"kind": "synthetic", "sample_index": 0}
    assert mgr.due(1)
    mgr.look_ahead(0)
    assert mgr._vote is not None and mgr._vote[0] == 1
    assert mgr.save(1, state) and mgr.counters["waits"] == 0 and mgr._vote is None
    mgr.schedule.passed(1)
    mgr.look_ahead(1)  # step 1 is still being written
    assert mgr.save(2, state) and mgr.counters["waits"] == 1
    mgr.schedule.passed(2)
    mgr.look_ahead(2)
    mgr.resumed_at(0)
    assert mgr._vote is None
    mgr.look_ahead(5)  # not due: no vote
    assert mgr._vote is None
    mgr.close()
    assert [m.step for m in list_manifests(ckpt_dir)] == [1, 2]


@pytest.mark.mpi(min_size=1)
def test_gap_control_and_round_trip(topology, ckpt_dir):
    model = make_model(topology)
    world, rank = topology.world_size, topology.rank
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES))
    mgr, _ = manager(topology, model, ckpt_dir, interval=3)
    reader = PrefetchReader(stream, global_batch=8 * world, rank=rank, world=world,
                            state=SyntheticPosition(), allowance=mgr.allowance(0, 7))
    for step in range(1, 7):
        model.train_step(reader.next())
        if step % 3 == 0:
            with pytest.raises(RuntimeError, match="allowance used up"):
                reader.next()  # nothing beyond the checkpoint was delivered
        mgr.after_step(step, reader, 7)
    mgr.close()
    reader.close()
    saved = {k: v.clone() for k, v in model.row_state().items()}
    manifest = list_manifests(ckpt_dir)[-1]
    assert manifest.step == 6 and manifest.reader_state["sample_index"] == 6 * 8 * world
    fresh = make_model(topology, seed=99)
    mgr2, lines = manager(topology, fresh, ckpt_dir, resume="latest")
    restored = Restorer(topology, ckpt_dir, fresh, lines.append, "latest").restore()
    mgr2.close()
    assert restored.step == 6 and restored.reader_state == manifest.reader_state
    for name, value in fresh.row_state().items():
        assert torch.equal(value, saved[name]), name
    for p, q in zip(fresh.dense.parameters(), model.dense.parameters()):
        assert torch.equal(p, q)
    assert fresh.digest() == model.digest()


@pytest.mark.mpi(min_size=1)
def test_the_first_restore_reads_rows_into_place_and_a_half_read_damaged_one_falls_back(
        topology, ckpt_dir, monkeypatch):
    """The job's first restore reads rows straight into the model's own memory (no copy into
    it afterwards); when the newest checkpoint turns out damaged after some tables were read
    into place, the previous one overwrites every row, so the state is exactly its. A later
    restore (a rollback while training goes on) loads apart and copies in."""
    from mpickpt.store.manifest import list_manifests as listed
    from mpickpt.store.shard_file import open_hdf5

    model = make_model(topology)
    mgr, _ = manager(topology, model, ckpt_dir, interval=3, keep=5)
    states = {}
    for step in range(1, 7):
        _one_step(topology, model)
        if step % 3 == 0:
            assert mgr.save(step, {"kind": "synthetic", "sample_index": step}, wait=True)
            states[step] = ({k: v.clone() for k, v in model.row_state().items()}, model.digest())
    mgr.close()
    newest = listed(ckpt_dir)[-1]
    assert newest.step == 6
    if topology.is_root:  # damage the last table's rows of rank 0's shard: read after others
        rel = next(r for r, m in newest.files.items() if m["role"] == "shard" and m["rank"] == 0)
        with open_hdf5(f"{ckpt_dir}/{rel}", "r") as f:
            weight = f["rows/weight"]
            offset = weight.id.get_offset() + int(f["rows"].attrs["tables"][-1][1]) * \
                weight.dtype.itemsize * weight.shape[1]
        with open(f"{ckpt_dir}/{rel}", "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    topology.control.Barrier()
    fresh = make_model(topology, seed=99)
    before = {k: v.data_ptr() for k, v in fresh.row_state().items()}
    monkeypatch.setattr(fresh, "load_row_state", lambda arrays: pytest.fail("copied in"))
    lines = []
    restored = Restorer(topology, ckpt_dir, fresh, lines.append, "latest").restore()
    assert restored.step == 3
    assert {k: v.data_ptr() for k, v in fresh.row_state().items()} == before
    for name, value in fresh.row_state().items():
        assert torch.equal(value, states[3][0][name]), name
    assert fresh.digest() == states[3][1]
    assert topology.rank != 0 or any("step 6 unusable" in l and "checksum" in l for l in lines)
    copied = []
    monkeypatch.setattr(fresh, "load_row_state", copied.append)
    assert Restorer(topology, ckpt_dir, fresh, lines.append, "latest").restore(latest=True).step \
        == 3 and len(copied) == 1 and set(copied[0]) == set(before)


def _one_step(topology, model):
    world = topology.world_size
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES))
    reader = PrefetchReader(stream, global_batch=8 * world, rank=topology.rank, world=world,
                            state=SyntheticPosition())
    model.train_step(reader.next())
    reader.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("stop", ["close", "abort"])
@pytest.mark.parametrize("kind", [{"kind": "consecutive"}, {"priority": "mfu"},
                                  {"priority": "scar"}])
def test_stopping_the_manager_detaches_every_tracker(topology, ckpt_dir, kind, stop):
    model = make_model(topology)
    emb = model.embeddings
    before = (list(emb.index_hooks), list(emb.count_hooks), list(emb.update_hooks))
    mgr, _ = manager(topology, model, ckpt_dir, **kind)
    assert len(emb.index_hooks) == len(before[0]) + 1  # the modified-row bit vector
    assert len(emb.count_hooks) == len(before[1]) + ("priority" in kind)  # MFU/SCAR tracker
    tracker = mgr.incremental.tracker
    _one_step(topology, model)
    if tracker is not None:
        assert tracker.count() > 0  # attached: a step marks rows
        tracker.extract()
    getattr(mgr, stop)()
    getattr(mgr, stop)()  # safe twice
    assert (emb.index_hooks, emb.count_hooks, emb.update_hooks) == before
    _one_step(topology, model)
    if tracker is not None:
        assert tracker.count() == 0  # detached: a further step marks nothing
