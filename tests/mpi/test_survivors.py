"""Survivor state in process on 1, 2 and 4 ranks: the undo log takes back a whole step or the part
of one that ran (rows, optimizer state, dense part, parity fold) bit for bit; dumps written by the
survivors restore, in a fresh model (the relaunch), exactly the state of the agreed step, with a
survivor one step ahead going back one step and the dead rank counted lost; a dump of an earlier
job whose checkpoint directory was made anew is refused."""
import os
import shutil

import numpy as np
import pytest
import torch

from mpickpt.data.position import SyntheticPosition
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.parity.guard import ParityConfig, ParityGuard
from mpickpt.survivors.dump import LINEAGE_FILE
from mpickpt.survivors.state import SurvivorDumps
from mpickpt.survivors.survival import Survival

SIZES = (400, 300, 90, 7)
BATCH = 16


def _model(topo):
    arch = DenseArch(num_dense=13, num_tables=4, dim=8, bottom=(13, 8), top=(1,))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.05), seed=4)


def _parity(topo, model):
    if topo.world_size < 2:
        return None
    guard = ParityGuard(topo, model, ParityConfig(k=topo.world_size - 1, r=1), say=lambda l: 0)
    guard.encode()
    return guard


class Run:
    """A model, its parity, its dumps and a reader position, stepped like the trainer does."""

    def __init__(self, topo, root):
        self.topo, self.model = topo, _model(topo)
        self.parity = _parity(topo, self.model)
        self.dumps = SurvivorDumps(topo, self.model, self.parity, root, "shm", lambda l: 0)
        self.stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=5))
        self.state, self.step = SyntheticPosition(), 0

    def train(self, steps: int) -> None:
        for _ in range(steps):
            self.dumps.undo.begin(self.step + 1, self.state.to_dict())
            batch, self.state = self.stream.read_slice(self.state, BATCH * self.topo.world_size,
                                                       self.topo.rank, self.topo.world_size)
            self.model.train_step(batch)
            self.dumps.undo.complete()
            self.step += 1

    def snapshot(self) -> dict:
        out = {f"row/{k}": v.clone() for k, v in self.model.row_state().items()}
        out.update({f"dense/{k}": v.clone() for k, v in self.model.dense_state().items()})
        if self.parity is not None:
            out["parity"] = self.parity.store.parity.clone()
        return out


def _same(topo, a: dict, b: dict, keys=None) -> bool:
    ok = all(torch.equal(a[k], b[k]) for k in (keys or a))
    return all(topo.control.allgather(ok))


@pytest.fixture
def root(shared_dir):
    return shared_dir


@pytest.mark.mpi(min_size=1)
def test_undo_takes_back_a_whole_step_or_the_part_that_ran(topology, root):
    run = Run(topology, root)
    run.train(3)
    before = run.snapshot()
    run.train(1)
    assert not _same(topology, before, run.snapshot())
    run.dumps.undo.undo_last()
    assert _same(topology, before, run.snapshot())
    # the sparse update of a step, then a death before its dense allreduce
    run.dumps.undo.begin(run.step + 1, run.state.to_dict())
    batch, _ = run.stream.read_slice(run.state, BATCH * topology.world_size, topology.rank,
                                     topology.world_size)
    pooled, ctx = run.model.embeddings.lookup(batch.sparse, update=True)
    run.model.embeddings.apply_gradients(torch.ones_like(pooled), ctx)
    assert not _same(topology, before, run.snapshot())
    run.dumps.undo.undo_current()
    assert _same(topology, before, run.snapshot())
    if run.parity is not None:
        run.parity.store.step_done()  # the step's exchange is over on every rank
    run.dumps.remove()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("start", ["survey", "chosen"])
def test_dumps_restore_the_agreed_step_in_a_fresh_model(topology, root, start):
    """The first launch resumed as launches do (its survey finds nothing) or started where
    the user chose (`--resume STEP` or `none`: earlier dumps dropped): either way its dumps
    carry the directory's lineage, and its relaunch restores them."""
    topo = topology
    dead = topo.world_size - 1
    ahead = 0 if topo.world_size >= 3 else None  # with 2 ranks its step would be the agreed one
    run = Run(topo, root)
    if start == "survey":
        run.dumps.survey(None)  # the lineage of this directory (a first launch: nothing found)
    else:
        run.dumps.start_anew()
    run.train(4)
    agreed, at = run.snapshot(), run.state.to_dict()
    run.train(1)  # rank `ahead` completed step 5 when the peer died; the others only step 4
    if topo.rank != ahead:
        run.dumps.undo.undo_last()
    if topo.rank != dead:
        step = run.step if topo.rank == ahead else run.step - 1
        reader = run.state.to_dict() if topo.rank == ahead else at
        run.dumps.write(step, reader, {"lost_samples": 0.0}, {dead})
    topo.control.Barrier()
    relaunch = Run(topo, root)  # the relaunch: a fresh model, the same layout
    survey = relaunch.dumps.survey(newest_committed=None)
    assert survey.usable and survey.step == 4, survey
    assert survey.survivors == [r for r in range(topo.world_size) if r != dead]
    assert list(survey.lost) == [dead] and survey.undo == ([] if ahead is None else [ahead])
    reader, pls = relaunch.dumps.restore(survey)
    assert reader == at and pls == {"lost_samples": 0.0}
    got = relaunch.snapshot()
    dense = [k for k in agreed if k.startswith("dense/")]
    assert _same(topo, got, agreed, dense)  # every rank, the dead one too
    if topo.rank != dead:
        assert _same_local(got, agreed)
    else:
        assert all(bool(v.isnan().all()) for k, v in got.items() if k.startswith("row/"))
    relaunch.dumps.remove()


def _same_local(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a if k.startswith("row/")) and \
        ("parity" not in a or torch.equal(a["parity"], b["parity"]))


@pytest.mark.mpi(min_size=2)
def test_dumps_of_an_earlier_job_in_a_remade_directory_are_refused(topology, root):
    topo = topology
    run = Run(topo, root)
    run.dumps.survey(None)
    run.train(2)
    run.dumps.write(run.step, run.state.to_dict(), {}, {topo.world_size - 1})
    topo.control.Barrier()
    if topo.is_root:
        os.remove(os.path.join(root, LINEAGE_FILE))  # the directory was removed and made anew
    topo.control.Barrier()
    survey = Run(topo, root).dumps.survey(None)
    assert not survey.usable and "earlier job" in survey.reason, survey
    run.dumps.remove()


@pytest.mark.mpi(min_size=2)
def test_parity_snapshot_and_restore_through_the_guard(topology, root):
    """What survivor dumps take from parity and put back, through ParityGuard's public API."""
    run = Run(topology, root)
    held = run.parity.snapshot()
    kept = held.copy()
    assert held.size and not run.parity.rebuilding_here()
    run.train(2)
    assert np.array_equal(held, kept)  # a copy, not a view of the live parity
    assert not np.array_equal(run.parity.snapshot(), held)  # training folded deltas into it
    run.parity.restore(held)
    np.testing.assert_array_equal(run.parity.snapshot(), held)
    with pytest.raises(ValueError, match="cannot replace"):
        run.parity.restore(np.zeros((held.shape[0] + 1, 3), dtype=held.dtype))
    run.dumps.remove()


@pytest.mark.mpi(min_size=2)
def test_ckpt_dumps_carry_a_relaunch_whose_shm_dumps_are_gone(topology, root):
    """--survivor-dumps ckpt, and the relaunch runs on other nodes (simulated: the node-local
    dumps are deleted): the survivors restore from the checkpoint directory's copy."""
    topo = topology
    dead = topo.world_size - 1
    run = Run(topo, root)
    run.dumps.mode = "ckpt"
    run.dumps.survey(None)
    run.train(3)
    agreed = run.snapshot()
    if topo.rank != dead:
        shm_dir, ckpt_dir = run.dumps.write(run.step, run.state.to_dict(), {}, {dead})[0]
        shutil.rmtree(shm_dir)  # the relaunch lands on other nodes
        assert ckpt_dir.startswith(str(root)) and os.path.isdir(ckpt_dir)
    topo.control.Barrier()
    relaunch = Run(topo, root)
    survey = relaunch.dumps.survey(newest_committed=None)
    assert survey.usable and survey.step == 3 and list(survey.lost) == [dead], survey
    relaunch.dumps.restore(survey)
    if topo.rank != dead:
        assert relaunch.dumps.found.startswith(str(root))  # the checkpoint directory's copy
        assert _same_local(relaunch.snapshot(), agreed)
    topo.control.Barrier()
    relaunch.dumps.remove()


@pytest.mark.mpi(min_size=2)
def test_a_relaunch_that_finds_no_dump_says_it_falls_back(topology, root):
    said = []
    model = _model(topology)
    first = Survival(topology, model, None, root, "shm", 10.0, said.append, restart=0)
    survey, found = first.resume(None)
    assert found is None and survey.reason == "" and said == []  # a first launch: nothing said
    relaunch = Survival(topology, model, None, root, "shm", 10.0, said.append, restart=2)
    survey, found = relaunch.resume(None)
    assert found is None and not survey.usable
    assert len(said) == 1 and said[0].startswith("relaunch (restart 2): no rank found a "
                                                 "survivor dump"), said
    assert "falling back to the newest checkpoint" in said[0]


@pytest.mark.mpi(min_size=2)
def test_a_generation_agrees_on_closed_checkpoints_and_kept_dumps(topology):
    """The last rank joins as a replacement (no state); the survivors differ: only rank 0's
    checkpoint manager is closed and only rank 0 still keeps the dumps of step 30 (a survivor
    that lagged in the close keeps its writers; one that closed dropped them). Every member
    agrees that the checkpoints are closed and that dumps of step 30 are kept, so that all make
    the same checkpoint and dump collectives afterwards."""
    from mpickpt.survivors.inplace import InPlace

    topo = topology
    me, last = topo.rank, topo.world_size - 1
    model = _model(topo)
    agree = InPlace(topo, model, None, None, 30.0)._agree
    if me == last:  # the replacement's side
        joined = agree(None, None, None, None, None, None)
    else:
        joined = agree(40, {"samples": 7}, None, "a1", 10, [], None, me == 0,
                       30 if me == 0 else None)
    assert joined.checkpoints_closed and joined.dumps_from == 30 and joined.step == 40
    assert joined.replaced == [last] and joined.reader == {"samples": 7}
    nobody = InPlace(topo, model, None, None, 30.0)._agree(
        None if me == last else 40, {}, None, None, None, None if me == last else [])
    assert not nobody.checkpoints_closed and nobody.dumps_from is None
