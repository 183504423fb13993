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
    if comm.rank == victim:
        watch.close(goodbye=False)
        comm.Barrier()
        return
    started = time.monotonic()
    assert watch.wait_for_death(5.0) == {victim}
    assert time.monotonic() - started < 1.0  # a closed connection is seen at once
    assert deaths == [{victim}]
    neighbour = comm.rank in ((victim - 1) % comm.size, (victim + 1) % comm.size)
    if neighbour:
        assert watch.how == "its connection closed"
    else:
        assert watch.how.startswith("reported by rank")
    watch.close()
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_silent_rank_is_dead_after_the_timeout(comm):
    victim = 0
    watch = PeerWatch(comm, timeout=1.5)
    time.sleep(0.3)
    if comm.rank == victim:
        watch.closed = True  # its thread stops beating; the connections stay open (a hung node)
        comm.Barrier()
        for _, sock in watch.links:
            sock.close()
        return
    started = time.monotonic()
    assert watch.wait_for_death(10.0) == {victim}
    waited = time.monotonic() - started
    assert 1.0 < waited < 4.0, waited
    assert "silent" in watch.how or watch.how.startswith("reported by rank")
    watch.close()
    comm.Barrier()
