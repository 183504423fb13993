"""Fixtures for multi-rank tests (run with `mpiexec -n N python -m mpi4py -m pytest --with-mpi`)."""
import shutil
import sys
import tempfile

import pytest


def pytest_runtest_logreport(report):
    """A test that fails on one rank of a multi-rank job prints its failure and aborts the job:
    the other ranks would otherwise wait for it at their next collective until their timeouts,
    and the job would end in a wall of timeout stacks that hide the one failure. Local."""
    if report.failed:
        _abort_the_job(f"{report.nodeid} failed ({report.when})", report.longreprtext)


def _abort_the_job(what: str, detail: str) -> None:
    """Print `what` and `detail`, then MPI_Abort, where MPI runs on more than one rank (the
    serial run, which collects these tests too, is left alone). Local."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() < 2:
        return
    sys.stderr.write(f"\n[rank {world.Get_rank()} of {world.Get_size()}] {what}, aborting the "
                     f"job:\n{detail}\n")
    sys.stderr.flush()
    world.Abort(1)


@pytest.fixture
def comm():
    """A duplicated COMM_WORLD, freed after the test: tests never talk on the bare world."""
    from mpi4py import MPI

    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


@pytest.fixture(scope="session")
def topology():
    """One Topology (gloo process group + control channel) for the whole MPI session."""
    from mpi4py import MPI

    from mpickpt.topology import Topology

    topo = Topology.from_mpi(MPI.COMM_WORLD, backend="gloo", timeout_s=120)
    yield topo
    topo.close()


@pytest.fixture
def shared_dir(topology):
    """A temporary directory made by rank 0 and named to every rank, removed after the test.
    Collective."""
    path = topology.control.bcast(tempfile.mkdtemp(prefix="mpickpt-mpi-")
                                  if topology.is_root else None)
    yield path
    topology.control.Barrier()
    if topology.is_root:
        shutil.rmtree(path, ignore_errors=True)
