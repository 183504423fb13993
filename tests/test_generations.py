"""In process: the control channel over gloo + a real TCPStore (two ranks as two threads), the
rendezvous' generation and slot rules, and the muting of hydra's SIGUSR1 death notice."""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from mpickpt.control import StoreControl
from mpickpt.generation import (JOB_ENDED, TRAINING_FINISHED, GenerationError, JobOver, Rendezvous,
                                SlotTaken, connect_store, host_store, process_identity)
from mpickpt.interruptible import SLICE_S, GenerationAborted, Interruptible
from mpickpt.stop_signals import StopSignals


def _on_two_ranks(fn):
    """Run fn(control) on two ranks (threads) of one StoreControl group; their results."""
    _, address = host_store(30)
    out, errors = [None, None], []

    def rank(r):
        try:  # a client of its own, as a process has
            out[r] = fn(StoreControl(connect_store(address, 30), "t/", r, 2, 30))
        except Exception as e:  # reported below, with the rank
            errors.append((r, e))
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def test_control_collectives_and_messages_match_their_mpi_meaning():
    def work(c):
        r = c.Get_rank()
        got = {"bcast": c.bcast({"from": r} if r == 1 else None, root=1),
               "allgather": c.allgather("x" * (r + 1)),
               "gather": c.gather(r * 10, root=0),
               "max": c.allreduce(r + 0.5, op="MAX"),
               "sum": c.allreduce(r + 1, op="sum")}
        arr, out = np.array([r, 5 - r], dtype=np.float64), np.empty(2)
        c.Allreduce(arr, out, op="max")
        got["Allreduce"] = out.tolist()
        if r == 1:
            for i in range(3):
                c.isend({"n": i}, dest=0, tag=7)
        c.Barrier()
        if r == 0:
            got["probe"] = c.iprobe(tag=7)
            got["msgs"] = [c.recv(tag=7)["n"] for _ in range(3)]
            got["empty"] = c.iprobe(tag=7)
        return got
    zero, one = _on_two_ranks(work)
    assert zero["bcast"] == one["bcast"] == {"from": 1}
    assert zero["allgather"] == ["x", "xx"]
    assert zero["gather"] == [0, 10] and one["gather"] is None
    assert zero["max"] == one["max"] == 1.5 and zero["sum"] == 3
    assert zero["Allreduce"] == one["Allreduce"] == [1.0, 5.0]
    assert zero["probe"] and zero["msgs"] == [0, 1, 2] and not zero["empty"]


def test_an_aborted_control_channel_raises_instead_of_waiting():
    store, _ = host_store(30)
    c = StoreControl(store, "solo/", 0, 1, 30)
    c.Barrier()
    c.abort()
    with pytest.raises(RuntimeError):
        c.Barrier()


def test_an_abort_ends_a_wait_on_a_live_peer_that_never_answers():
    """gloo cannot cancel an operation whose live peer gave up on it (a survivor far round a ring
    from the dead rank): the sliced wait must end it within a slice of the abort."""
    release = threading.Event()

    def work(c):
        if c.Get_rank() == 1:  # alive, never enters the barrier, until told
            release.wait(30)
            return None
        threading.Timer(0.3, c.abort).start()
        start = time.monotonic()
        try:
            c.Barrier()
        except GenerationAborted as e:
            return time.monotonic() - start, str(e)
        finally:
            release.set()
        return None
    (took, said), _ = _on_two_ranks(work)
    assert 0.25 < took < 0.3 + 2 * SLICE_S + 0.3, took
    assert "'t/' was aborted" in said


def test_a_sliced_wait_returns_when_the_operation_ends_and_passes_its_error_on():
    class Late:  # a Work that finishes after three slices
        def __init__(self, error=None):
            self.slices, self.error = 0, error

        def wait(self, timeout=None):
            self.slices += 1
            if self.slices < 4:
                raise RuntimeError("Operation timed out!")
            if self.error:
                raise self.error
            return True
    late = Late()
    Interruptible(sliced=True).wait(late)
    assert late.slices == 4
    closed = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(RuntimeError, match="Connection closed"):
        Interruptible(sliced=True).wait(Late(closed))
    gone = Interruptible(sliced=True)
    gone.abort()
    with pytest.raises(GenerationAborted):
        gone.wait(Late())
    plain = Late()
    with pytest.raises(RuntimeError, match="timed out"):  # NCCL: one plain wait, no slices
        Interruptible(sliced=False).wait(plain)
    assert plain.slices == 1


def test_rendezvous_generations_and_replacement_slots():
    store, address = host_store(30)
    rv = Rendezvous(store, address)
    assert rv.current() == 0
    for r in range(3):
        rv.register(0, r)
    assert rv.gather(0, 3, 5) == {r: os.getpid() for r in range(3)}
    # rank 1 died: its slot in generation 0 is taken, so a replacement waits for generation 1
    found = []
    waiter = threading.Thread(target=lambda: found.append(rv.generation_for_replacement(1, 10)))
    waiter.start()
    time.sleep(0.2)
    assert not found, "joined the broken generation"
    assert rv.advance(0, {1}) == 1
    assert rv.advance(0, {1}) == 1, "a second survivor must not start generation 2"
    waiter.join(10)
    assert found == [1] and rv.dead_of(0, 3) == [1]
    rv.register(1, 0)
    with pytest.raises(GenerationError, match=r"rank\(s\) \[1, 2\] did not join"):
        rv.gather(1, 3, 0.3)


def test_a_dead_ranks_slot_goes_to_exactly_one_claimer_and_the_others_serve_as_spares():
    """Spares and the dead rank's respawn race for its slot: one wins, a respawn that lost (or
    came after the job's end) is told so at once, and a survivor that a peer wrongly counted
    dead cannot form the generation beside the process that took its slot."""
    store, address = host_store(30)
    rv = Rendezvous(store, address)
    for r in range(3):
        rv.register(0, r)
    dead = process_identity()  # in this test one process held every slot of generation 0
    assert rv.free_slot(3) is None  # nothing died yet
    rv.advance(0, {1})
    rv.advance(0, {2})  # a second survivor's view: rank 2 is alive, but it counted it dead
    rv.register(1, 0)
    assert rv.dead_of(0, 3) == [1, 2] and rv.free_slot(3) == (1, 1)
    wins = []

    def claimer(i):  # six processes, as their identities say
        client = Rendezvous(connect_store(address, 30), address)
        wins.append(client.claim(1, 1, f"node{i}:{100 + i}"))
    threads = [threading.Thread(target=claimer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(wins) == [False] * 5 + [True]
    assert rv.free_slot(3) == (1, 2)  # offered, though its survivor lives
    assert rv.claim(1, 2, "node9:999")  # a spare took it
    with pytest.raises(GenerationError, match="was claimed by node9:999 while its survivor"):
        rv.register(1, 2)  # the survivor of rank 2: no generation around two holders of rank 2
    with pytest.raises(SlotTaken, match="taken by node"):  # the respawn of rank 1 lost
        rv.generation_for_replacement(1, 5, dead=dead)
    assert rv.job_over() is None
    rv.done()  # a member stopped (a stop signal, an error): no training finished
    assert rv.job_over() == JobOver(JOB_ENDED, relaunch=False)
    rv.done(completed=True)
    assert rv.job_over() == JobOver(TRAINING_FINISHED, relaunch=False)
    with pytest.raises(SlotTaken, match="not needed any more"):
        rv.generation_for_replacement(0, 5, dead=dead)
    rv.give_up("rank 0: generation 2 did not form")
    over = rv.job_over()
    assert "falls back to a relaunch: rank 0" in str(over) and over.relaunch


def test_a_members_death_or_the_fallback_ends_a_generation_that_has_not_settled():
    """`FormationWatch` over a real store: a respawn that finds its slot of the forming
    generation held by the dead process records the death, and the watch aborts the
    generation's groups (again at each look: groups made after the first abort are aborted
    too), and a spare's respawn records the slots its predecessor held; the job's fallback
    does the same; a settled generation's watch does nothing."""
    from mpickpt.survivors.formation_watch import POLL_S, FormationWatch

    store, address = host_store(30)
    rv = Rendezvous(store, address)
    assert rv.current() == 0
    for r in range(3):
        rv.register(0, r)
    assert rv.advance(0, {1}) == 1
    for r in range(3):
        rv.register(1, r, "node1:101" if r == 1 else None)
    aborts = []
    watch = FormationWatch(address, 1, 3, lambda: aborts.append(time.monotonic()))
    settled = FormationWatch(address, 1, 3, lambda: aborts.append("settled"))
    settled.stop()
    time.sleep(3 * POLL_S)
    assert aborts == [] and watch.reason is None
    respawn = threading.Thread(  # the replacement of rank 1 died; its respawn waits for gen 2
        target=lambda: pytest.raises(SlotTaken, rv.generation_for_replacement, 1, 10,
                                     dead="node1:101"))
    respawn.start()
    deadline = time.monotonic() + 5
    while len(aborts) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert watch.reason == "rank(s) [1] of generation 1 died before its peer watch stood"
    assert len(aborts) >= 2 and "settled" not in aborts
    assert rv.dead_of(1, 3) == [1] and rv.deaths_recorded(1) == 1  # recorded once
    assert rv.record_if_held("node7:707", 3) == [] and rv.deaths_recorded(1) == 1
    assert rv.record_if_held("node1:101", 3) == [1]  # a spare's respawn: what it held
    watch.stop()
    rv.give_up("rank 0: gave up")  # ends the respawn's wait
    respawn.join(10)
    fallback = FormationWatch(address, 2, 3, lambda: aborts.append("fallback"))
    try:
        time.sleep(3 * POLL_S)
        assert "fallback" in aborts and "falls back to a relaunch: rank 0" in fallback.reason
    finally:
        fallback.stop()


def test_a_waiting_spare_takes_a_slot_or_leaves_with_the_reason():
    from mpickpt.spares import Spare

    store, address = host_store(30)
    rv = Rendezvous(store, address)
    spare = Spare(Rendezvous(connect_store(address, 30), address), 3, 0, 1, "gloo", 30)
    for r in range(3):
        rv.register(0, r)
    threading.Timer(0.3, lambda: rv.advance(0, {2})).start()
    said = []
    assert spare.wait(said.append, poll_s=0.01) == (1, 2)
    assert said == ["spare: took rank 2 of generation 1"]
    assert rv.holder(1, 2) == process_identity()
    threading.Timer(0.2, lambda: rv.give_up("rank 1: no replacement came")).start()
    over = spare.wait(said.append, poll_s=0.01)
    assert str(over).endswith("rank 1: no replacement came") and over.relaunch
    threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    other = Spare(Rendezvous(host_store(30)[0], None), 3, 0, 1, "gloo", 30)
    assert other.wait(said.append, poll_s=0.01) == JobOver("SIGTERM received", relaunch=False)


def _deliver(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)


@pytest.mark.parametrize("spares", [False, True])
def test_hydra_death_notice_is_muted_but_not_sigterm(spares):
    """A death known: SIGUSR1 (hydra's notice) is muted for a while; with hot spares it is a
    notice for good (a waiting spare's death comes only as SIGUSR1). SIGTERM, SIGINT never."""
    signals = StopSignals().install()
    try:
        if spares:
            signals.notices_only()
        else:
            _deliver(signal.SIGUSR1)  # arrived just before the death was known
            assert signals.received == "SIGUSR1"
            signals.mute_death_notices(5.0)
            assert signals.received is None and len(signals.muted) == 1
        _deliver(signal.SIGUSR1)  # during the recovery
        assert signals.received is None and len(signals.muted) == (1 if spares else 2)
        _deliver(signal.SIGINT if spares else signal.SIGTERM)
        assert signals.received == ("SIGINT" if spares else "SIGTERM")
    finally:
        signals.uninstall()


def test_sigusr1_stays_a_stop_under_a_launcher_without_death_notices():
    """srun (mpickpt-run sets MPICKPT_SIGUSR1_NOTICES=0): Slurm's --signal=USR1@T before the time
    limit must stop the job even around a death and with spares."""
    signals = StopSignals({"MPICKPT_SIGUSR1_NOTICES": "0"}).install()
    try:
        signals.notices_only()
        signals.mute_death_notices(5.0)
        _deliver(signal.SIGUSR1)
        assert signals.received == "SIGUSR1" and not signals.muted
    finally:
        signals.uninstall()


def test_the_run_s_end_counts_a_phase_done_that_a_survivor_completed_and_others_were_ending():
    """A death at the close's barrier can let some survivors through and not others: the phase
    counts as done (the others finish it alone); 'settle' is left out (every member settles
    again); anything else mixed is refused."""
    from mpickpt.survivors.inplace import agreed_end

    assert agreed_end([["settle", "close"], ["settle"], ["settle", "close"]]) == ["close"]
    assert agreed_end([["settle"], []]) == []
    assert agreed_end([["settle", "close"]] * 3) == ["close"]
    with pytest.raises(GenerationError, match=r"different parts of the run's end: \[\(\), "
                                              r"\('close', 'report'\)\]"):
        agreed_end([["close", "report"], []])
    with pytest.raises(GenerationError, match="different parts"):
        agreed_end([["report"], ["close"]])
    with pytest.raises(GenerationError, match="different parts"):  # only the close ends so
        agreed_end([["close", "report"], ["close"]])


def test_a_replacement_refused_by_its_generation_says_why_in_one_line():
    """The generation's refusal (GenerationError) ends a joining process with status 77 and its
    message, without a stack trace (any other error keeps its trace), after saying at the store
    that the job falls back to a relaunch."""
    import subprocess
    import sys

    script = (
        "from types import SimpleNamespace as N\n"
        "from mpickpt.generation import GenerationError\n"
        "from mpickpt.train import _join_and_build\n"
        "def join():\n"
        "    raise GenerationError('the survivors completed different parts of the run')\n"
        "_join_and_build(N(recovery=N(startup_timeout=60)), None, 'the replacement of rank 1',\n"
        "                join, N(job_over=lambda: None, address=None,\n"
        "                        give_up=lambda why: print('fallback:', why, flush=True)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 77, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert ("the replacement of rank 1 failed in joining the next generation (the survivors "
            "completed different parts of the run); exit status 77") in proc.stderr, proc.stderr
    # said at the store too: the others waiting for the generation end at once
    assert proc.stdout == ("fallback: the replacement of rank 1 failed: the survivors completed "
                           "different parts of the run\n"), proc.stdout
