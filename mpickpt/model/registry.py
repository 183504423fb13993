"""Which models exist: `--model` names to the builders of the model a Trainer trains, next to the
kinds (`mpickpt.kinds.registry`) and the recovery policies (`mpickpt.recovery.build`). A new
model is one module meeting `mpickpt.model.contract` plus one entry here. Local."""
from __future__ import annotations

from mpickpt.model.contract import TRAINING, require


def _dlrm(topo, config, timer):
    """mpickpt's own hybrid-parallel DLRM (`mpickpt.model.hybrid`)."""
    from mpickpt.model.hybrid import HybridDLRM

    return HybridDLRM(topo, config.arch, config.table_sizes, config.optim, config.model.seed,
                      config.plan_options, timer, shard_lost=topo.replacement)


def _torchrec(topo, config, timer):
    """torchrec's DLRM under DistributedModelParallel (`mpickpt.model.torchrec_dlrm`)."""
    from mpickpt.model.torchrec_dlrm import build_torchrec_dlrm

    return build_torchrec_dlrm(topo, config, timer)


MODELS = {"dlrm": _dlrm, "torchrec": _torchrec}
"""`--model` name -> builder(topo, TrainConfig, PhaseTimer)."""
MODEL_NAMES = tuple(MODELS)


def build_model(name: str, topo, config, timer):
    """The model `--model name` trains, checked against the core contract. Collective where
    the model's construction is. ValueError naming the choices for an unknown name."""
    builder = MODELS.get(name)
    if builder is None:
        raise ValueError(f"--model must be one of {', '.join(MODEL_NAMES)}, got {name!r}")
    model = builder(topo, config, timer)
    require(model, TRAINING)
    return model
