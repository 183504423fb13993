"""Launcher variables and backend choice (the collective part is exercised by every MPI test)."""
import pytest

from mpickpt.topology import choose_backend, local_rank_from_env


@pytest.mark.parametrize("env, expected", [
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "3"}, 3),
    ({"MPI_LOCALRANKID": "1"}, 1),
    ({"SLURM_LOCALID": "2", "MPI_LOCALRANKID": ""}, 2),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "0", "SLURM_LOCALID": "5"}, 0),
    ({}, None),
])
def test_local_rank_from_launcher_variables(env, expected):
    assert local_rank_from_env(env) == expected


def test_backend_choice_on_cpu_machine():
    import torch

    expected = "nccl" if torch.cuda.is_available() else "gloo"
    assert choose_backend(None) == expected
    assert choose_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="'mpi'"):
        choose_backend("mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            choose_backend("nccl")
