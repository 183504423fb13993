"""In process: a finished rebuild's report is reduced over a real control channel (gloo + a
TCPStore, two ranks as two threads) without holding the rank that starts it, and a report cut
by a death keeps this rank's figures and says why."""
from __future__ import annotations

import time
from types import SimpleNamespace

from mpickpt.control import StoreControl
from mpickpt.generation import host_store
from mpickpt.parity.rebuild_report import RebuildReport
from tests.test_generations import _on_two_ranks


def _finished(rank: int) -> SimpleNamespace:
    """A finished Rebuild's figures on `rank` (rank 1 was the lost one)."""
    return SimpleNamespace(failed={1}, total=1000 * rank, degraded_rows=7 * rank,
                           received_bytes=1 << (20 + rank), rounds=2, memory_rounds=2,
                           beside_rounds=0, started=100.0, finished_at=100.0 + 0.1 * (rank + 1),
                           seconds=0.01 * (3 - rank))


def test_the_report_sums_the_ranks_and_keeps_the_slowest_without_waiting_for_them():
    def work(c):
        rank = c.Get_rank()
        if rank == 1:
            time.sleep(0.5)  # the lost rank ends its last round later
        start = time.monotonic()
        report = RebuildReport(c, _finished(rank), after_step=150, done_step=152)
        started = time.monotonic() - start
        return started, report.result()
    (started0, (zero, why0)), (_, (one, why1)) = _on_two_ranks(work)
    assert started0 < 0.25, started0  # rank 0 went on while rank 1 was still in its round
    assert why0 is None and why1 is None and zero == one
    assert zero["units"] == 1000 and zero["degraded_rows"] == 7
    assert zero["received_bytes"] == (1 << 20) + (1 << 21)
    assert abs(zero["round_seconds"] - 0.03) < 1e-12 and abs(zero["seconds"] - 0.2) < 1e-9
    assert zero["ranks"] == [1] and zero["after_step"] == 150 and zero["done_step"] == 152


def test_a_report_cut_by_a_death_keeps_this_ranks_figures_and_says_why():
    store, _ = host_store(30)
    c = StoreControl(store, "cut/", 0, 1, 30)
    report = RebuildReport(c, _finished(1), after_step=9, done_step=11)
    c.abort()  # the peer watch's abort when a death ends the generation
    record, why = report.result()
    assert why.startswith("this rank's figures only: ") and "aborted" in why
    assert record["units"] == 1000 and abs(record["seconds"] - 0.2) < 1e-9
    assert record["done_step"] == 11
