"""`--ckpt-cores`: which cores of a rank's share training and the checkpoint's background work
keep to (issue 23, point 2), planned from the affinity mask and the node's layout, and applied
to real threads and spawned processes, as the kernel reports it."""
import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from mpickpt.background_priority import Background, IOPRIO_CLASS_IDLE, current, threads_of
from mpickpt.engine.commit import CommitCoordinator
from mpickpt.engine.core_split import CoreSplit, node_masks, plan, rank_share
from mpickpt.engine.writer_pool import WriterPool
from mpickpt.incrcp.client import ExtractorClient

two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                               reason="needs a mask of at least 2 cores")


def test_one_rank_on_two_cores_trains_on_the_first_and_writes_on_the_second():
    split, why = plan("split", 0, [{0, 1}], "cpu", 1)
    assert why is None and split == CoreSplit((0,), (1,))
    assert plan("auto", 0, [{0, 1}], "cpu", 1)[0] == split


def test_shared_splits_nothing_and_says_nothing():
    assert plan("shared", 0, [{0, 1}], "cpu", 1) == (None, None)


def test_unbound_ranks_deal_their_cores_out_in_rank_order():
    """mpiexec's default: every rank's mask is the node's (or the job's cgroup's, 16 of a
    larger host here); a GPU rank's training takes one core of its quarter."""
    cgroup = set(range(32, 48))
    split, _ = plan("auto", 3, [cgroup] * 4, "cuda", 1)
    assert split == CoreSplit((44,), (45, 46, 47))
    assert rank_share(1, [range(8)] * 2) == ((4, 5, 6, 7), None)


def test_a_rank_bound_to_its_own_cores_splits_its_mask():
    split, _ = plan("split", 1, [{0, 1, 2}, {4, 5, 6}], "cpu", 2)
    assert split == CoreSplit((4, 5), (6,))


def test_no_split_where_training_needs_every_core_or_the_share_is_unknown():
    split, why = plan("split", 1, [{0, 1}, {0, 1}], "cpu", 1)  # 2 ranks, 2 cores
    assert split is None and "training needs all of this rank's 1 core(s)" in why
    sockets = [set(range(8)), set(range(8)), set(range(4, 12)), set(range(8, 16))]
    split, why = plan("auto", 0, sockets, "cuda", 1)
    assert split is None and "overlap without being equal" in why
    split, why = plan("split", 2, [{0, 1}] * 3, "cuda", 1)
    assert split is None and "3 ranks on this node's 2 cores" in why


def test_bad_modes_and_splits_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"--ckpt-cores must be one of auto, shared, split, "
                                         r"got 'half'"):
        plan("half", 0, [{0, 1}], "cpu", 1)
    with pytest.raises(ValueError, match=r"disjoint, non-empty .* got \(0, 1\) and \(1,\)"):
        CoreSplit((0, 1), (1,))


def test_the_node_masks_are_gathered_by_host_in_rank_order():
    class Control:  # the generation's channel or an MPI communicator, as far as this reads
        def Get_rank(self):
            return 2

        def allgather(self, mine):
            return [("a", [0, 1]), ("b", [0, 1, 2, 3]), mine, ("b", [4, 5])]
    index, masks = node_masks(Control(), hostname="b")
    assert index == 1 and masks == [[0, 1, 2, 3], sorted(os.sched_getaffinity(0)), [4, 5]]


def _on_a_thread(fn):
    """Run `fn` on a fresh thread (pinning the test's own thread would pin the session)."""
    out = {}
    t = threading.Thread(target=lambda: out.update(value=fn()))
    t.start()
    t.join()
    return out["value"]


@two_cores
def test_training_pins_its_thread_and_what_it_starts_helpers_widen_again():
    mask = sorted(os.sched_getaffinity(0))
    split = CoreSplit(tuple(mask[:1]), tuple(mask[1:]))

    def training():
        assert split.pin_training() is None
        child = _on_a_thread(lambda: os.sched_getaffinity(0))
        helper = _on_a_thread(lambda: (split.widen(), os.sched_getaffinity(0))[1])
        return os.sched_getaffinity(0), child, helper
    mine, child, helper = _on_a_thread(training)
    assert mine == child == set(mask[:1])
    assert helper == set(mask)
    assert os.sched_getaffinity(0) == set(mask)  # the session's thread is untouched


PIN_WORKERS = """
import os, threading
from mpickpt.engine.core_split import CoreSplit
mask = sorted(os.sched_getaffinity(0))[:2]
os.sched_setaffinity(0, mask)
split = CoreSplit((mask[0],), (mask[1],))
go, out = threading.Event(), {}
def worker(name, place=None):
    if place:
        os.sched_setaffinity(0, place)
    out[name] = threading.get_native_id()
    go.wait()
threads = [threading.Thread(target=worker, args=("unplaced",)),
           threading.Thread(target=worker, args=("background", {mask[1]}))]
for t in threads:
    t.start()
while len(out) < 2:
    pass
split.pin_training(workers=True)
print(sorted(os.sched_getaffinity(0)), *(sorted(os.sched_getaffinity(out[n]))
                                         for n in ("unplaced", "background")))
go.set()
"""


@two_cores
def test_a_cpu_rank_pins_its_unplaced_threads_with_it_and_leaves_placed_ones():
    """With `workers` (a CPU rank: its torch workers), every thread still on the whole share
    goes to the training cores; one already on the background cores stays there."""
    mask = sorted(os.sched_getaffinity(0))[:2]
    out = subprocess.run([sys.executable, "-c", PIN_WORKERS], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split("] ") == [f"[{mask[0]}", f"[{mask[0]}", f"[{mask[1]}]\n"], out


@two_cores
def test_a_background_process_is_spawned_on_the_background_cores():
    """Its interpreter starts there (not on training's cores until it is moved), and the
    spawning thread gets its own cores back."""
    last = max(os.sched_getaffinity(0))

    def spawn():
        before = os.sched_getaffinity(0)
        with Background("idle", (last,)).spawning():
            child = subprocess.run([sys.executable, "-c", "import os; print(sorted("
                                    "os.sched_getaffinity(0)))"], capture_output=True,
                                   text=True, timeout=60).stdout.strip()
        return child, os.sched_getaffinity(0) == before
    assert _on_a_thread(spawn) == (f"[{last}]", True)


@two_cores
def test_background_processes_and_the_commit_thread_keep_to_the_background_cores(tmp_path):
    last = max(os.sched_getaffinity(0))
    background = Background("idle", (last,))
    pool = WriterPool(1, background)
    client = ExtractorClient(str(tmp_path), 0.02, background=background)
    commits = CommitCoordinator(SimpleNamespace(rank=0, world_size=1), str(tmp_path), 1,
                                print, background=background)
    try:
        commits._io.submit(lambda: None).result()
        for pid in pool.pids + [client.proc.pid]:
            for tid in threads_of(pid):
                assert os.sched_getaffinity(tid) == {last}, (pid, tid)
                assert current(tid) == (os.SCHED_IDLE, IOPRIO_CLASS_IDLE)
        assert os.sched_getaffinity(commits._tid) == {last}
        pool.prioritize("normal")  # the last checkpoint: faster, on the same cores
        assert {os.sched_getaffinity(t) == {last} and os.sched_getscheduler(t) ==
                os.SCHED_OTHER for t in threads_of(pool.pids[0])} == {True}
    finally:
        pool.close()
        client.close()
        commits.close()


def _tasks(pid: int) -> dict[int, set]:
    return {tid: os.sched_getaffinity(tid) for tid in threads_of(pid)}


@two_cores
def test_a_training_run_keeps_its_loop_and_its_background_apart(tmp_path):
    """A real 1-rank run (incrcp, copy-on-update): while it trains, its main thread is on the
    training core, the copier (rank 0: and the commit thread) and the writer and the extractor
    on the background core."""
    mask = sorted(os.sched_getaffinity(0))[:2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = tmp_path / "log"
    cmd = ["taskset", "-c", f"{mask[0]},{mask[1]}", sys.executable, "-m", "mpickpt.train",
           "--embedding-scale-down", "2000", "--mini-batch-size", "64", "--num-batches",
           "100000", "--test-num-batches", "0", "--print-freq", "0", "--ckpt-dir",
           str(tmp_path / "ck"), "--ckpt-interval", "20", "--ckpt-kind", "incrcp",
           "--ckpt-snapshot", "copy-on-update", "--ckpt-cores", "split"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "incrcp step" not in log.read_text():  # an extraction ran: every part started
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        tasks = _tasks(proc.pid)
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)],
                                                   capture_output=True, text=True).stdout.split()]
        spawned = {pid: _tasks(pid) for pid in children
                   if current(pid)[0] == os.SCHED_IDLE}  # the writer and the extractor
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert f"training on cores {mask[0]}, background on {mask[1]}" in log.read_text()
    assert tasks[proc.pid] == {mask[0]}
    assert {mask[1]} in tasks.values()  # the copier (rank 0: and the commit thread)
    assert len(spawned) == 2 and all(cpus == {mask[1]} for t in spawned.values()
                                     for cpus in t.values()), spawned
