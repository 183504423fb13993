"""Parity on real sharded models: difference propagation keeps parity equal to a fresh encode,
degraded reads and rebuilds return the lost rows bit for bit (r = 1 and r = 2)."""
import threading
import time

import pytest
import torch

from mpickpt.data.position import SyntheticPosition
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.model.shard_plan import ShardPlanOptions
from mpickpt.parity import peer_rows, shared_rows
from mpickpt.parity.guard import ParityConfig, ParityGuard

SIZES = (3000, 700, 90, 5)


def _shapes(world):
    """(k, r, failed ranks) cases this world size can hold."""
    cases = [(world - 1, 1, [world - 1])]
    if world >= 4:
        cases.append((world - 2, 2, [0, world - 1]))
    return cases


def _model(topo, optimizer):
    arch = DenseArch(num_dense=13, num_tables=4, dim=8, bottom=(13, 8), top=(1,))
    return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind=optimizer, lr=0.05), seed=3,
                      plan_options=ShardPlanOptions(row_wise_threshold=1000))


def _train(topo, model, steps, state=None):
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=5))
    state = state or SyntheticPosition()
    for _ in range(steps):
        batch, state = stream.read_slice(state, 32 * topo.world_size, topo.rank, topo.world_size)
        model.train_step(batch)
    return state


def _all_ok(topo, ok: bool) -> bool:
    return all(topo.control.allgather(bool(ok)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("optimizer", ["adagrad", "momentum"])
def test_propagated_parity_equals_a_fresh_encode(topology, optimizer):
    for k, r, _ in _shapes(topology.world_size):
        model = _model(topology, optimizer)
        guard = ParityGuard(topology, model, ParityConfig(k=k, r=r), say=lambda line: None)
        guard.encode()
        state = _train(topology, model, 3)
        batch, _ = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=6)).read_slice(
            SyntheticPosition(), 32 * topology.world_size, topology.rank, topology.world_size)
        model.predict(batch)  # an evaluation lookup posts nothing
        assert _all_ok(topology, guard.store._flight is None)
        pooled, ctx = model.embeddings.lookup(batch.sparse, update=True)
        assert _all_ok(topology, guard.store._flight is not None)  # counts left in the lookup
        model.embeddings.apply_gradients(torch.ones_like(pooled), ctx)
        model.embeddings.finish_step()
        st = guard.store  # an exchange whose deltas were never folded is refused, not reused
        st.after_update(ctx.rows, st.before_update(ctx.rows))
        with pytest.raises(RuntimeError, match="step_done was not called"):
            st.before_update(ctx.rows)
        st.step_done()
        _train(topology, model, 3, state)
        kept = guard.store.parity.clone()
        assert _all_ok(topology, kept.abs().sum() > 0)
        guard.store.encode_all()
        assert _all_ok(topology, torch.equal(kept, guard.store.parity)), (k, r)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["memory", "memory-votes", "mapped", "bxor-reduce",
                                  "all-to-lost"])
def test_degraded_reads_and_rebuild_are_exact(topology, path, monkeypatch):
    """memory: sweeps beside the steps (r = 1), copying the survivors' rows; memory-votes: rank 0
    votes for them, the others against, so every round sweeps in the lookup; mapped: every rank
    keeps its rows and parity in shared memory, which every rank maps ahead and the lost rank
    reads (sweeps in the lookup), with no probe exchange."""
    from mpickpt.parity.memory_reads import MemoryReads
    from mpickpt.parity.rebuild import Rebuild

    probes, holds, joins = [], [], []
    real_probe, real_hold, real_join = Rebuild._agree_probe, Rebuild.hold_all, Rebuild.join
    monkeypatch.setattr(Rebuild, "_agree_probe",
                        lambda self, *a: probes.append(1) or real_probe(self, *a))
    monkeypatch.setattr(Rebuild, "hold_all", lambda self: holds.append(1) or real_hold(self))
    monkeypatch.setattr(Rebuild, "join", lambda self, in_step=True: (
        joins.append(in_step) if self.deferred else None) or real_join(self, in_step))
    # a sweep beside the step starts late: the survivors reach their gradients' all-to-all
    # before it reads them, and must change nothing until the lost rank has joined it
    real_pull = MemoryReads.pull
    monkeypatch.setattr(MemoryReads, "pull", lambda self, *a: (time.sleep(0.2) if (
        threading.current_thread().name.startswith("mpickpt-sweep")) else None) or
        real_pull(self, *a))
    rank, mem, mapped = topology.rank, path in ("memory", "memory-votes", "mapped"), \
        path == "mapped"
    for k, r, failed in _shapes(topology.world_size):
        model = _model(topology, "adagrad")
        transport = "network" if path in ("bxor-reduce", "all-to-lost") else \
            "auto" if mapped else "copy"
        sweep = "beside" if path == "memory" or rank == 0 and path == "memory-votes" \
            else "lookup"
        config = ParityConfig(k=k, r=r, transport=transport, sweep=sweep)
        shared = shared_rows.for_parity(model, config)
        assert (shared is not None) == mapped
        guard = ParityGuard(topology, model, config, say=lambda line: None, shared=shared)
        assert guard.mapped == mapped
        assert (guard.store.group_pg is not None) == (r == 1 and topology.backend == "gloo")
        if path == "all-to-lost":  # NCCL's path: every survivor's units go to the lost rank
            guard.store._xor_reduce = False
        guard.encode()
        state = _train(topology, model, 4)
        words = guard.store.words
        truth = words.gather(torch.arange(words.rows))
        parity = guard.store.parity.clone()
        assert guard.uncovered(failed) is None
        guard.fail(failed)
        guard.start_rebuild(failed, step=4)
        rb = guard.rebuild
        # memory reads use the readers whose scratch the guard faulted in before the failure
        assert (guard.reads is not None) == mem
        assert (mem and guard.reads.reserved > 0) == (mem and not mapped)
        if mem:
            assert rb.reads is (guard.reads if rank in failed else None)
            # mapped: every rank began mapping its group's buffers ahead, when encode
            # published them (the lost rank's loss finds them under way)
            assert (guard.reads._premap is not None) == mapped
        rb.chunk = 0  # this round serves degraded reads only
        want = torch.arange(0, words.rows, 7)
        rb.round(want if rank in failed else None, step_seconds=None)
        now = words.gather(torch.arange(words.rows))
        if rank in failed:
            read = torch.zeros(words.rows, dtype=torch.bool)
            read[want] = True
            ok = torch.equal(now[read], truth[read]) and bool(torch.isnan(
                now[~read][:, 0].view(torch.float32)).all()) and rb.degraded_rows == len(want)
        else:
            ok = torch.equal(now, truth)
        assert _all_ok(topology, ok), (k, r, "degraded reads")
        # training continues during the rebuild (rounds run inside the lookups, each with a
        # chunk: read from memory, it is swept beside the step and joined before its gradients
        # leave), then an evaluation lookup leaves a sweep that settle joins, then finish
        rb.chunk = 64
        state = _train(topology, model, 3, state)
        batch, _ = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=6)).read_slice(
            SyntheticPosition(), 32 * topology.world_size, topology.rank, topology.world_size)
        model.predict(batch)
        beside = mem and r == 1 and _all_ok(topology, sweep == "beside")
        assert rb.deferred == beside
        # the next lookup joins that sweep before it reads a row, then its round takes the rest:
        # while that last sweep runs the rank is still being rebuilt, and the lookup after it
        # joins it and ends the rebuild
        rb.chunk = 1 << 22
        model.predict(batch)
        assert rb.deferred == beside and rb.active == beside
        assert guard.rebuilding() == (sorted(failed) if beside else [])
        model.predict(batch)
        assert not rb.active and not rb.deferred and len(guard.history) == 1
        guard.settle()
        assert not rb.active and rb.remaining() == 0 and not rb.deferred
        assert rb.sweeps_beside == (5 if beside and rank in failed else 0)
        # the same on every rank; the round of degraded reads only was deferred too
        assert rb.beside_rounds == (6 if beside else 0)
        # every round read the survivors' memory (all ranks share this host), or none did
        assert rb.memory_rounds == (rb.rounds if mem else 0), (path, rb.rounds)
        assert (rb.probed and rb.received_bytes > 0) if mem and rank in failed \
            else not rb.probed
        # mapped: the lost rank's maps made ahead stood for its probe: no rank had the
        # probe's exchange (the copies had theirs, once per rebuild)
        assert rb.premapped == (mapped and rank in failed)
        assert len(probes) == (0 if mapped or not mem else 1), (path, probes)
        # a sweep joined in a step's gradient hook needs no exchange of its own (the gradients'
        # all-to-all holds every rank); one joined in a lookup or settle has one
        assert joins.count(True) == (3 if beside else 0), (path, joins)
        assert len(holds) == joins.count(False) == (3 if beside else 0), (path, holds, joins)
        probes.clear(), holds.clear(), joins.clear()
        # after the first round read memory, every round's counts travelled in its lookup's
        # exchange (the first was called outside a lookup); over the network none did
        assert rb.carried_rounds == (rb.rounds - 1 if mem else 0), (path, rb.carried_rounds)
        # mapped: everything was read where the survivors' rows lie, nothing copied
        assert rb.mapped_bytes == (rb.received_bytes if mapped else 0), (path, rb.mapped_bytes)
        # the rebuilt state trains on exactly like a model that never failed
        ref = _model(topology, "adagrad")
        ref_guard = ParityGuard(topology, ref, ParityConfig(k=k, r=r), say=lambda line: None)
        ref_guard.encode()
        _train(topology, ref, 7)
        both = ref_guard.store.words
        ok = torch.equal(words.gather(torch.arange(words.rows)),
                         both.gather(torch.arange(both.rows)))
        ok = ok and torch.equal(guard.store.parity, ref_guard.store.parity)
        assert _all_ok(topology, ok), (k, r, "rebuilt state")
        assert _all_ok(topology, parity.shape == guard.store.parity.shape)
        if shared is not None:
            shared.close()


@pytest.mark.mpi(min_size=2)
def test_a_refused_memory_read_falls_back_to_the_network(topology, monkeypatch):
    """Survivors publish a parity address the kernel cannot read (page 0): the lost rank's probe
    fails with EFAULT, it says so, and the whole rebuild goes over the network, exact."""
    k, r, failed = _shapes(topology.world_size)[0]
    if topology.rank not in failed:
        real = peer_rows.describe
        monkeypatch.setattr(peer_rows, "describe", lambda store, enabled, probed, **kw: (
            lambda f: f[:4] + [8] + f[5:])(real(store, enabled, probed, **kw)))
    said = []
    model = _model(topology, "adagrad")
    guard = ParityGuard(topology, model, ParityConfig(k=k, r=r), say=said.append)
    guard.encode()
    _train(topology, model, 3)
    truth = guard.store.words.gather(torch.arange(guard.store.words.rows))
    guard.fail(failed)
    guard.start_rebuild(failed, step=3)
    guard.settle()
    rb = guard.rebuild
    now = guard.store.words.gather(torch.arange(guard.store.words.rows))
    refused = [line for line in said if "cannot read its group's memory" in line]
    ok = torch.equal(now, truth) and rb.memory_rounds == 0 and rb.rounds >= 1
    ok = ok and (("EFAULT" in refused[0]) if topology.rank in failed else not refused)
    assert _all_ok(topology, ok), (rb.memory_rounds, said)


def _lost_after_two_steps(topology, **config):
    """A guarded model trained 2 steps whose first shape's ranks have just failed, its rebuild
    started: (guard, failed ranks, every row's words before the loss)."""
    k, r, failed = _shapes(topology.world_size)[0]
    model = _model(topology, "adagrad")
    guard = ParityGuard(topology, model, ParityConfig(k=k, r=r, **config), say=lambda line: None)
    guard.encode()
    _train(topology, model, 2)
    words = guard.store.words
    truth = words.gather(torch.arange(words.rows))
    guard.fail(failed)
    guard.start_rebuild(failed, step=2)
    return guard, failed, truth


@pytest.mark.mpi(min_size=2)
def test_the_probe_round_decodes_every_row_its_step_reads(topology):
    """The first round by memory re-sizes its chunk after the probe; a step so short that the
    memory chunk would be smaller than the one asked for must not drop the stripes in between
    (they were left out of the degraded reads): every row the step reads is whole after it."""
    guard, failed, truth = _lost_after_two_steps(topology)
    rb, words = guard.rebuild, guard.store.words
    rb.chunk = 256  # asked for; a 1 us step buys the memory reads the minimum, 64
    want = torch.arange(0, words.rows, 5)
    rb.round(want if topology.rank in failed else None, step_seconds=1e-6)
    now = words.gather(torch.arange(words.rows))
    ok = rb.memory_rounds == 1 and (topology.rank not in failed or torch.equal(
        now[want], truth[want]))
    assert _all_ok(topology, ok)
    guard.settle()
    assert _all_ok(topology, torch.equal(words.gather(torch.arange(words.rows)), truth))


@pytest.mark.mpi(min_size=2)
def test_a_chunk_taken_for_a_lookups_exchange_and_not_used_is_given_back(topology):
    """After a round read memory, the next round's counts are taken for the lookup's exchange
    with its chunk; where no round uses them (a settle comes instead), the chunk goes back to
    the sweep: every row is whole after it, none skipped."""
    guard, failed, truth = _lost_after_two_steps(topology, sweep="lookup")
    rb, words = guard.rebuild, guard.store.words
    rb.chunk = 0  # degraded reads only
    rb.round(None, step_seconds=None)
    assert _all_ok(topology, rb.read_memory and rb.active and rb.carried)
    rb.chunk = 64
    cursor = rb.cursor
    counts = guard.outgoing()  # a lookup's exchange hook: the next round's counts, chunk taken
    assert counts is not None and len(counts) == topology.world_size
    if topology.rank in failed:
        assert rb.cursor > cursor and max(c[2] for c in counts) == rb.cursor
    guard.settle()  # not a lookup: its own exchange, the chunk given back first
    ok = torch.equal(words.gather(torch.arange(words.rows)), truth) and rb.remaining() == 0
    assert _all_ok(topology, ok and rb.carried_rounds == 0 and not rb.active)


@pytest.mark.mpi(min_size=2)
def test_a_carried_round_that_must_go_to_the_network_exchanges_its_counts_again(topology,
                                                                               monkeypatch):
    """The counts a lookup carried hold no degraded-read count; where the round finds it must go
    over the network (a survivor no longer serves its memory), every rank exchanges them again
    and the survivors answer the degraded reads too: the rows come back exact."""
    guard, failed, truth = _lost_after_two_steps(topology, sweep="lookup")
    rb, words = guard.rebuild, guard.store.words
    rb.chunk = 0  # degraded reads only
    rb.round(None, step_seconds=None)
    assert _all_ok(topology, rb.read_memory and rb.memory_rounds == 1)
    if topology.rank not in failed:  # serves = 0 from now on
        real = peer_rows.describe
        monkeypatch.setattr(peer_rows, "describe", lambda *a, **kw: (
            lambda f: f[:2] + [0] + f[3:])(real(*a, **kw)))
    rb.chunk = 64
    batch, _ = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=6)).read_slice(
        SyntheticPosition(), 32 * topology.world_size, topology.rank, topology.world_size)
    guard.embeddings.lookup(batch.sparse)  # an evaluation lookup carries the round's counts
    guard.settle()
    ok = torch.equal(words.gather(torch.arange(words.rows)), truth) and rb.remaining() == 0
    assert _all_ok(topology, ok and rb.memory_rounds == 1 and rb.carried_rounds == 0
                   and rb.rounds >= 2 and (rb.degraded_rows > 0) == (topology.rank in failed))


@pytest.mark.mpi(min_size=2)
def test_a_new_generation_maps_ahead_again_once_its_rebuild_ends(topology, monkeypatch):
    """A replacement's rebuild (a new generation: the maps made ahead are dropped) ends with
    every rank publishing its rows again and mapping its group's ahead, so the generation's next
    loss finds them made and needs no probe."""
    from mpickpt.parity.rebuild import Rebuild

    k, r, failed = _shapes(topology.world_size)[0]
    model = _model(topology, "adagrad")
    config = ParityConfig(k=k, r=r, sweep="lookup")
    shared = shared_rows.for_parity(model, config)
    guard = ParityGuard(topology, model, config, say=lambda line: None, shared=shared)
    guard.encode()
    _train(topology, model, 2)
    assert guard._published_in == 0 and guard.reads._premap is not None
    monkeypatch.setattr(type(topology), "generation", property(lambda self: 1))
    guard.fail(failed)
    guard.start_rebuild(failed, step=2)
    assert guard.rebuild.published is None and guard.reads._premap is None  # dropped
    _train(topology, model, 1)
    guard.settle()
    assert _all_ok(topology, guard._published_in == 1 and guard.reads._premap is not None)
    probes = []
    real_probe = Rebuild._agree_probe
    monkeypatch.setattr(Rebuild, "_agree_probe",
                        lambda self, *a: probes.append(1) or real_probe(self, *a))
    words = guard.store.words
    truth = words.gather(torch.arange(words.rows))
    guard.fail(failed)
    guard.start_rebuild(failed, step=3)
    guard.settle()
    rb = guard.rebuild
    ok = torch.equal(words.gather(torch.arange(words.rows)), truth) and not probes
    assert _all_ok(topology, ok and rb.premapped == (topology.rank in failed))
    shared.close()


@pytest.mark.mpi(min_size=2)
def test_a_round_that_sweeps_everything_reads_no_row_twice_and_reports_later(topology):
    """A step long enough for the whole sweep: the probe round grows the chunk it asked for to
    every period, so none of the rows its step reads is read again by a degraded read. The
    rebuild's report is reduced beside training: said at the next lookup, not in the round that
    ended it, with the job's totals and the step from which the rows are whole."""
    k, r, failed = _shapes(topology.world_size)[0]
    model = _model(topology, "adagrad")
    said = []  # in the lookup: where a core is free, `auto` would sweep beside the step
    guard = ParityGuard(topology, model, ParityConfig(k=k, r=r, sweep="lookup"),
                        say=said.append)
    guard.encode()
    state = _train(topology, model, 2)
    words = guard.store.words
    truth = words.gather(torch.arange(words.rows))
    guard.fail(failed)
    guard.start_rebuild(failed, step=2)
    guard.note_step(0.07)  # step 3 trained before the rebuild's first round (none was due)
    rb = guard.rebuild
    rb.chunk = 256
    want = torch.arange(0, words.rows, 5)
    guard.step_seconds = 10.0
    guard._on_lookup(want if topology.rank in failed else torch.empty(0, dtype=torch.int64))
    whole = torch.equal(words.gather(torch.arange(words.rows)), truth)
    ok = whole and not rb.active and rb.rounds == 1 and rb.degraded_rows == 0
    assert _all_ok(topology, ok), (rb.rounds, rb.degraded_rows)
    ok = guard._report_due is not None and \
        not [line for line in said if line.startswith("parity: rebuilt")]
    assert _all_ok(topology, ok)
    _train(topology, model, 1, state)  # the next step's lookup says it
    lines = [line for line in said if line.startswith("parity: rebuilt")]
    record = guard.history[-1]
    units = topology.control.allreduce(rb.total)
    ok = len(lines) == 1 and len(guard.history) == 1 and record["units"] == units > 0
    ok = ok and record["done_step"] == 4 and record["degraded_rows"] == 0
    ok = ok and "whole from step 4 on" in lines[0] and "slowest rank" in lines[0]
    assert _all_ok(topology, ok), (lines, record)
