"""HostPendingRows, the copier's chunk read beside the updates: whatever the order of the copier's
steps (mark the chunk, read it without a lock, end it) and of a step's hook and update, a step
inside the read included (whose rows the read copies updated and the chunk's end puts back),
every staged row ends as its value at the snapshot, for a full snapshot and a selection, and a
row the hook took before the chunk is not read again; with real threads, a copier racing updates that
rewrite the rows it reads stages the snapshot exactly."""
import itertools
import threading

import pytest
import torch

from mpickpt.engine.pending_rows import HostPendingRows

ROWS, DIM = 64, 4


def _tables(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(ROWS, DIM, generator=g),
            "state/sum": torch.rand(ROWS, generator=g)}


def _update(sources, rows: torch.Tensor) -> None:
    """A sparse update: rows and their optimizer state change."""
    sources["weight"][rows] += 1.0
    sources["state/sum"][rows] += 2.0


ORDERS = [order for order in itertools.permutations(["begin", "read", "end", "hook"])
          if order.index("begin") < order.index("read") < order.index("end")]


@pytest.mark.parametrize("selected", [None, torch.arange(0, ROWS, 3)], ids=["full", "selected"])
@pytest.mark.parametrize("order", ORDERS, ids=["-".join(o) for o in ORDERS])
def test_every_interleaving_of_a_chunk_and_a_step_stages_the_snapshot(order, selected):
    sources = _tables()
    snapshot = {k: v.clone() for k, v in sources.items()}
    targets = {k: torch.full_like(v, float("nan")) for k, v in sources.items()}
    pending = HostPendingRows()
    pending.arm(ROWS, None if selected is None else selected.tolist())
    stepped = torch.tensor([1, 9, 10, 17, 30, 40])  # 9, 10 and 17 lie in the chunk 8..23
    for what in order:
        if what == "begin":
            pending.begin_chunk(8, 24)
        elif what == "read":
            pending.read_chunk(sources, targets)
        elif what == "end":
            pending.end_chunk(targets)
        else:  # the step: its hook copies the pending rows it will update, then the update
            pending.copy_listed(sources, targets, stepped)
            _update(sources, stepped)
    pending.begin_chunk(0, ROWS)  # the copier's other chunks
    pending.read_chunk(sources, targets)
    pending.end_chunk(targets)
    wanted = torch.arange(ROWS) if selected is None else selected
    for name in sources:
        assert torch.equal(targets[name][wanted], snapshot[name][wanted]), (name, order)
    # the hook copies the rows still pending: not those the chunk's end already cleared
    cleared = set(range(8, 24)) if order.index("end") < order.index("hook") else set()
    assert pending.hooked() == len((set(stepped.tolist()) & set(wanted.tolist())) - cleared)


class _StepInsideTheRead(dict):
    """Sources whose first `items()` (the copier's read, after it looked at the mask) runs a
    step first: its hook and update land between the read's look at the mask and its copy."""

    def __init__(self, tables, step):
        super().__init__(tables)
        self.step = step

    def items(self):
        step, self.step = self.step, None
        if step is not None:
            step()
        return super().items()


@pytest.mark.parametrize("selected", [None, torch.arange(0, ROWS, 3)], ids=["full", "selected"])
def test_a_step_inside_the_read_gets_its_rows_put_back(selected):
    tables = _tables()
    snapshot = {k: v.clone() for k, v in tables.items()}
    targets = {k: torch.full_like(v, float("nan")) for k, v in tables.items()}
    pending = HostPendingRows()
    pending.arm(ROWS, None if selected is None else selected.tolist())
    stepped = torch.tensor([9, 12, 17, 30])

    def step():
        pending.copy_listed(tables, targets, stepped)
        _update(tables, stepped)

    pending.begin_chunk(8, 24)
    pending.read_chunk(_StepInsideTheRead(tables, step), targets)
    read = {k: v.clone() for k, v in targets.items()}
    pending.end_chunk(targets)
    inside = torch.tensor([r for r in (9, 12, 17) if selected is None or r % 3 == 0])
    assert not torch.equal(read["weight"][inside], snapshot["weight"][inside])  # the race hit
    wanted = torch.arange(ROWS) if selected is None else selected
    pending.begin_chunk(0, ROWS)
    pending.read_chunk(tables, targets)
    pending.end_chunk(targets)
    for name in tables:
        assert torch.equal(targets[name][wanted], snapshot[name][wanted]), name


def test_a_row_the_hook_took_before_the_chunk_is_not_read_again():
    sources = _tables()
    at_snapshot = sources["weight"][5].clone()
    targets = {k: torch.zeros_like(v) for k, v in sources.items()}
    pending = HostPendingRows()
    pending.arm(ROWS, None)
    pending.copy_listed(sources, targets, torch.tensor([5]))
    _update(sources, torch.tensor([5]))
    pending.begin_chunk(0, 16)
    pending.read_chunk(sources, targets)  # the chunk is not all pending: its pending rows only
    pending.end_chunk(targets)
    assert torch.equal(targets["weight"][5], at_snapshot)
    assert not torch.equal(sources["weight"][5], at_snapshot)


def _race(rows: int, dim: int, chunk: int, per_step: int, selected, seed: int) -> None:
    """A copier thread reads chunks (the caller's lock around begin and end only, as
    `CopyOnUpdate` does) while this thread's steps copy their pending rows and update them; the
    staged rows must be those of the snapshot, and the copier must not fail. The copier starts
    after the first step's hook, so that a hook copied pending rows however the threads are
    scheduled (on a busy machine the copier could otherwise finish before any step ran)."""
    sources = {"weight": torch.randn(rows, dim), "state/sum": torch.rand(rows)}
    snapshot = {k: v.clone() for k, v in sources.items()}
    targets = {k: torch.zeros_like(v) for k, v in sources.items()}
    pending, lock = HostPendingRows(), threading.Lock()
    pending.arm(rows, None if selected is None else selected.tolist())
    done, failed, stepped_once = threading.Event(), [], threading.Event()

    def copier():
        try:
            stepped_once.wait(30)
            for a in range(0, rows, chunk):
                with lock:
                    pending.begin_chunk(a, min(rows, a + chunk))
                pending.read_chunk(sources, targets)
                with lock:
                    pending.end_chunk(targets)
        except BaseException as e:  # noqa: BLE001 - asserted below
            failed.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=copier)
    g = torch.Generator().manual_seed(seed)
    thread.start()
    steps = 0
    while not done.is_set() or steps < 5:
        stepped = torch.randint(0, rows, (per_step,), generator=g).unique()
        with lock:
            pending.copy_listed(sources, targets, stepped)
        _update(sources, stepped)
        steps += 1
        stepped_once.set()
    thread.join()
    assert failed == []
    wanted = torch.arange(rows) if selected is None else selected
    for name in sources:
        assert torch.equal(targets[name][wanted], snapshot[name][wanted]), name
    assert pending.hooked() > 0


@pytest.mark.timeout(60)
def test_a_copier_racing_the_updates_stages_the_snapshot():
    """Big rows, so that the copier's reads (which release the GIL) overlap the updates."""
    _race(20000, 256, 4000, 500, None, seed=3)


@pytest.mark.timeout(60)
def test_a_copier_racing_small_steps_over_a_selection_does_not_fail():
    """Many small steps clearing bits of the chunk being read, which the copier reads by
    index (a selection): the list of a chunk's pending rows is taken under the lock (torch's
    nonzero over bits that changed between its two passes raised, ~half the snapshots)."""
    for seed in range(10):
        _race(200000, 4, 20000, 20, torch.arange(0, 200000, 2), seed=seed)
