"""Fixtures for multi-rank tests (run with `mpiexec -n N python -m mpi4py -m pytest --with-mpi`)."""
import pytest


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
