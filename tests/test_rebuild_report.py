"""In process: a finished rebuild's report is reduced over a real control channel (gloo + a
TCPStore, two ranks as two threads) without holding the rank that starts it; a report cut
by a death, or started after one, keeps this rank's figures and says why; one that completed
before a death keeps the job's."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from mpickpt.control import StoreControl
from mpickpt.generation import host_store
from mpickpt.parity.rebuild_report import RebuildReport
from tests.test_generations import _on_two_ranks


def _finished(rank: int) -> SimpleNamespace:
    """A finished Rebuild's figures on `rank` (rank 1 was the lost one)."""
    return SimpleNamespace(failed={1}, total=1000 * rank, degraded_rows=7 * rank,
                           received_bytes=1 << (20 + rank), mapped_bytes=rank << 20,
                           rounds=2, memory_rounds=2,
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
    assert started0 < 0.4, started0  # rank 0 went on while rank 1 was still in its round
    assert why0 is None and why1 is None and zero == one
    assert zero["units"] == 1000 and zero["degraded_rows"] == 7
    assert zero["received_bytes"] == (1 << 20) + (1 << 21) and zero["mapped_bytes"] == 1 << 20
    assert abs(zero["round_seconds"] - 0.03) < 1e-12 and abs(zero["seconds"] - 0.2) < 1e-9
    assert zero["ranks"] == [1] and zero["after_step"] == 150 and zero["done_step"] == 152


def test_a_report_cut_by_a_death_keeps_this_ranks_figures_and_says_why():
    """Rank 1 never joins the reductions (it died); the peer watch aborts rank 0's channel."""
    release = threading.Event()

    def work(c):
        if c.Get_rank() == 1:
            release.wait(30)
            return None
        try:
            report = RebuildReport(c, _finished(0), after_step=9, done_step=11)
            c.abort()
            return report.result()
        finally:
            release.set()
    (record, why), _ = _on_two_ranks(work)
    assert why.startswith("this rank's figures only: ") and "aborted" in why
    assert record["units"] == 0 and abs(record["seconds"] - 0.1) < 1e-9
    assert record["done_step"] == 11


def test_a_report_finished_before_the_abort_keeps_the_jobs_figures():
    store, _ = host_store(30)
    c = StoreControl(store, "done/", 0, 1, 30)
    report = RebuildReport(c, _finished(1), after_step=9, done_step=11)
    deadline = time.monotonic() + 10
    while not all(r.work.is_completed() for r in report._requests) and \
            time.monotonic() < deadline:
        time.sleep(0.01)
    c.abort()  # a later death: the reductions had completed
    record, why = report.result()
    assert why is None and record["units"] == 1000 and abs(record["seconds"] - 0.2) < 1e-9


def test_a_report_on_an_aborted_channel_starts_nothing_and_says_why():
    store, _ = host_store(30)
    c = StoreControl(store, "gone/", 0, 1, 30)
    c.abort()  # the death was known when the rebuild ended
    record, why = RebuildReport(c, _finished(1), after_step=9, done_step=11).result()
    assert why.startswith("this rank's figures only: ") and "aborted" in why
    assert record["units"] == 1000 and record["done_step"] == 11
