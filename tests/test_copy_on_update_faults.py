"""A copy-on-update snapshot whose copy fails (here: a staging target too short for the rows)
is abandoned, never training: the update hook swallows the failure and copies nothing more,
`finish()` raises it, and the next snapshot is whole. CPU tables, in process."""
import pytest
import torch

from mpickpt.engine.copy_on_update import CopyOnUpdate
from tests.row_tables import RowTables

ROWS = 2000


@pytest.mark.parametrize("who", ["hook", "copier"])
def test_a_failing_copy_abandons_the_snapshot_and_training_goes_on(who):
    tables = {"weight": torch.randn(ROWS, 4), "state/sum": torch.zeros(ROWS)}
    model = RowTables(tables)
    short = {"weight": torch.empty(ROWS // 2, 4), "state/sum": torch.empty(ROWS // 2)}
    cou = CopyOnUpdate(model, chunk_rows=50, pause_s=0.002)
    try:
        cou.start(tables, short)
        if who == "copier":
            cou.go()  # its chunks past ROWS // 2 fail
        else:  # the hook reaches a row past the end first (the copier is not let go yet)
            model.update(torch.tensor([3, ROWS - 1]))
        for _ in range(5):
            model.update(torch.randint(0, ROWS, (100,)))  # never raises
        with pytest.raises(RuntimeError, match="copy-on-update snapshot failed"):
            cou.finish()
        assert cou._pending is None
        model.update(torch.arange(ROWS))  # nothing pending: no copy, no error
        # the next snapshot, into a whole staging area, is the state at its start
        staging = {n: torch.empty_like(t) for n, t in tables.items()}
        want = {n: t.clone() for n, t in tables.items()}
        cou.start(tables, staging)
        cou.go()
        model.update(torch.arange(0, ROWS, 3))
        cou.finish()
        assert all(torch.equal(staging[n], want[n]) for n in tables)
    finally:
        cou.close()


def test_the_copier_runs_where_it_is_placed_and_counts_its_cpu():
    """`place` (a core split's background cores) runs on the copier thread, once; the copier's
    CPU (background work that the time-lost bench's bound counts) grows with each snapshot."""
    import threading

    tables = {"weight": torch.randn(200_000, 16), "state/sum": torch.zeros(200_000)}
    placed = []
    cou = CopyOnUpdate(RowTables(tables), place=lambda: placed.append(threading.get_ident()))
    try:
        staging = {n: torch.empty_like(t) for n, t in tables.items()}
        for _ in range(2):
            cou.start(tables, staging)
            cou.go()
            cou.finish()
        assert all(torch.equal(staging[n], tables[n]) for n in tables)
        assert placed == [cou._thread.ident] and placed[0] != threading.get_ident()
        assert cou.cpu_seconds > 0
    finally:
        cou.close()
