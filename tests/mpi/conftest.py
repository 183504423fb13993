"""Fixtures for multi-rank tests (run with `mpiexec -n N python -m mpi4py -m pytest --with-mpi`)."""
import shutil
import tempfile

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
