"""The background processes (checkpoint writers, IncrCP extractor) and rank 0's commit thread run
at the priority `--ckpt-background` names, on every thread, as the kernel reports it for the
real spawned processes, and can be raised to normal for the last checkpoint (issue 23, point 2)."""
import os
from types import SimpleNamespace

import pytest

from mpickpt.background_priority import (IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE, current, setting,
                                         threads_of)
from mpickpt.engine.commit import CommitCoordinator
from mpickpt.engine.writer_pool import WriterPool
from mpickpt.incrcp.client import ExtractorClient


def _every_thread(pid: int) -> set:
    return {current(tid) for tid in threads_of(pid)}


def test_writers_start_idle_and_are_raised_to_normal_for_the_end():
    pool = WriterPool(2, "idle")
    try:
        assert pool.priority_problem is None
        for pid in pool.pids:
            assert _every_thread(pid) == {(os.SCHED_IDLE, IOPRIO_CLASS_IDLE)}, pid
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the trainer itself is untouched
        pool.prioritize("normal")
        for pid in pool.pids:
            assert _every_thread(pid) == {(os.SCHED_OTHER, IOPRIO_CLASS_BE)}, pid
    finally:
        pool.close()


def test_the_extractor_runs_at_the_low_priority(tmp_path):
    client = ExtractorClient(str(tmp_path), 0.02, background="low")
    try:
        assert _every_thread(client.proc.pid) == {(os.SCHED_BATCH, IOPRIO_CLASS_BE)}
    finally:
        client.close()


def test_rank_0s_commit_thread_runs_at_the_background_priority(tmp_path):
    """The commit thread (manifests, retention's deletes) is background work too: idle from
    its start, normal once raised; the trainer's own threads stay as they are."""
    coordinator = CommitCoordinator(SimpleNamespace(rank=0, world_size=1), str(tmp_path), 1,
                                    print, background="idle")
    try:
        coordinator._io.submit(lambda: None).result()  # the thread starts with its first work
        assert coordinator.priority_problem is None
        assert current(coordinator._tid) == (os.SCHED_IDLE, IOPRIO_CLASS_IDLE)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        coordinator.prioritize("normal")
        assert current(coordinator._tid) == (os.SCHED_OTHER, IOPRIO_CLASS_BE)
    finally:
        coordinator.close()


def test_an_unknown_mode_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"--ckpt-background must be one of idle, low, normal, "
                                         r"got 'fast'"):
        setting("fast")
