"""PeerWatch on real ranks and real TCP connections: ranks that end normally, in any order and
within milliseconds of each other, are never taken for dead; a rank that vanishes without a
goodbye (what a killed process looks like) or falls silent (a lost node) is known dead on every
other rank, its neighbours by the connection and the rest by the word passed around the ring."""
import random
import time

import pytest

from mpickpt.liveness import PeerWatch


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("round_", range(4))
def test_normal_ends_in_any_order_are_no_deaths(comm, round_):
    order = comm.bcast(random.Random(round_).sample(range(comm.size), comm.size))
    deaths = []
    watch = PeerWatch(comm, on_death=deaths.append, timeout=5.0)
    time.sleep(0.3 + 0.004 * order.index(comm.rank))  # a few heartbeats, then staggered ends
    watch.close()
    time.sleep(0.3)  # the neighbours' watch threads read the goodbyes and the closed streams
    assert deaths == [] and watch.dead == set(), (comm.rank, order, watch.how)
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_an_unannounced_end_is_a_death_known_to_every_rank(comm):
    victim = comm.size - 1
    deaths = []
    watch = PeerWatch(comm, on_death=deaths.append, timeout=5.0)
    time.sleep(0.3)
    record = None
    if comm.rank == victim:
        watch.close(goodbye=False)
    else:
        started = time.monotonic()
        dead = watch.wait_for_death(5.0)
        waited = time.monotonic() - started
        until = time.monotonic() + 2.0  # the callback runs just after the waiters wake
        while not deaths and time.monotonic() < until:
            time.sleep(0.01)
        record = (dead, waited, list(deaths), watch.how)
        watch.close()
    # every rank judges every survivor's record, so a failure fails all ranks and hangs none
    records = dict(enumerate(comm.allgather(record)))
    del records[victim]
    neighbours = {(victim - 1) % comm.size, (victim + 1) % comm.size}
    for rank, (dead, waited, seen, how) in records.items():
        assert dead == {victim} and seen == [{victim}], (rank, records)
        assert waited < 2.5, (rank, records)  # at once, not by the 5 s timeout
        if rank not in neighbours:  # no connection to the victim: only the word around the ring
            assert how.startswith("reported by rank"), (rank, records)
    # a neighbour may hear the other neighbour's word before its own connection's end
    hows = [records[r][3] for r in neighbours]
    assert "its connection closed" in hows, records
    assert all(h == "its connection closed" or h.startswith("reported by rank")
               for h in hows), records


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_silent_rank_is_dead_after_the_timeout(comm):
    victim = 0
    watch = PeerWatch(comm, timeout=1.5)
    time.sleep(0.3)
    record = None
    if comm.rank == victim:
        watch.closed = True  # its thread stops beating; the connections stay open (a hung node)
    else:
        started = time.monotonic()
        dead = watch.wait_for_death(10.0)
        record = (dead, time.monotonic() - started, watch.how)
        watch.close()
    records = dict(enumerate(comm.allgather(record)))  # every rank judges every record
    if comm.rank == victim:
        for _, sock in watch.links:
            sock.close()
    del records[victim]
    for rank, (dead, waited, how) in records.items():
        assert dead == {victim}, (rank, records)
        assert 1.0 < waited < 4.0, (rank, records)
        assert "silent" in how or how.startswith("reported by rank"), (rank, records)
