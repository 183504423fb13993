"""The model contract (`mpickpt.model.contract`) and the model registry: mpickpt's own model meets
every capability (a real 1-rank topology in a child process), and a model that lacks what a
feature needs is refused at the feature's construction, naming the model, the missing members
and the feature, before anything is hooked or written."""
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from mpickpt.model.contract import (CAPABILITIES, PARITY, TRAINING, ModelContractError,
                                    capabilities_of, missing_for, require)
from tests.launch import REPO


class _Rows:
    """Only the core rows: no hooks, no row tensors, no wipes."""

    def __init__(self):
        self.dim, self.device = 4, torch.device("cpu")
        self.local_gids = np.arange(3, dtype=np.int64)
        self.state_lock = threading.RLock()
        self.optimizer = None


class CoreOnly:
    """A model with the core members only (what a minimal adapter would start with)."""

    def __init__(self):
        self.topo = self.plan = None
        self.embeddings = _Rows()
        self.state_lock = self.embeddings.state_lock

    def train_step(self, batch, votes=None):
        return 0.0

    def row_state(self):
        return {}

    def dense_state(self):
        return {}

    def load_row_state(self, arrays):
        pass

    def load_dense_state(self, arrays):
        pass

    def predict(self, batch):
        return torch.zeros(0)

    def digest(self):
        return ""


def test_a_core_only_model_trains_but_is_refused_for_what_needs_more():
    model = CoreOnly()
    require(model, TRAINING)
    assert capabilities_of(model) == ["core", "core rows"]
    assert missing_for(model, PARITY) == ["embeddings.add_index_hook",
                                          "embeddings.add_update_hook", "embeddings.weight",
                                          "embeddings.wipe_range", "embeddings.wipe_rows"]
    with pytest.raises(ModelContractError, match=r"CoreOnly cannot be used with parity "
                                                 r"\(--parity-k\): it lacks "
                                                 r"embeddings.add_index_hook, "):
        require(model, PARITY)


def test_features_refuse_the_model_at_construction_before_any_work():
    from mpickpt.parity.guard import ParityConfig, ParityGuard
    from mpickpt.survivors.undo import StepUndo

    model = CoreOnly()
    said = []
    with pytest.raises(ModelContractError, match="parity"):
        ParityGuard(None, model, ParityConfig(k=1), said.append)
    with pytest.raises(ModelContractError, match=r"step undo\): it lacks embeddings.add_update"):
        StepUndo(model)
    assert not said
    broken = CoreOnly()
    broken.embeddings = object()
    with pytest.raises(ModelContractError, match=r"training: it lacks embeddings.device, "
                                                 r"embeddings.dim, embeddings.local_gids"):
        require(broken, TRAINING)


def test_a_recovery_that_must_start_over_is_unrecoverable_without_initial_rows():
    from mpickpt.faults.loss import Loss
    from mpickpt.recovery.base import Unrecoverable, cannot_start_over

    with pytest.raises(Unrecoverable, match=r"CoreOnly cannot start over from its initial state "
                                            r"\(it lacks initial_row_range, reset_to_initial"):
        cannot_start_over(CoreOnly(), Loss((), 5))


def test_an_unknown_model_name_is_refused_naming_the_choices():
    from mpickpt.model.registry import build_model

    with pytest.raises(ValueError, match=r"--model must be one of dlrm, torchrec, got 'torchrek'"):
        build_model("torchrek", None, None, None)


SCRIPT = textwrap.dedent("""
    from mpickpt.model.contract import CAPABILITIES, capabilities_of
    from mpickpt.model.registry import build_model
    from mpickpt.timing import PhaseTimer
    from mpickpt.topology import Topology
    from mpickpt.train_flags import TrainConfig

    topo = Topology.from_mpi()
    config = TrainConfig.from_args(["--arch-embedding-size", "30-20", "--arch-sparse-feature-size",
                                    "4", "--arch-mlp-bot", "13-4", "--arch-mlp-top", "8-1"])
    model = build_model(config.model.model, topo, config, PhaseTimer(topo.device, False))
    print(type(model).__name__, capabilities_of(model) == [c.name for c in CAPABILITIES])
""")


def test_the_built_in_model_meets_every_capability():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["HybridDLRM", "True"], proc.stdout + proc.stderr
    assert len(CAPABILITIES) == 10
