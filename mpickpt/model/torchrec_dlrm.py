"""`--model torchrec`: torchrec's own DLRM (`torchrec.models.dlrm.DLRM`) over an
EmbeddingBagCollection with fused optimizers, sharded by `DistributedModelParallel`, under
mpickpt's TorchRec adapter. The trainer's flags choose it as they choose `HybridDLRM`: the same
table sizes, dimension, MLP widths, optimizer, learning rate and seed (the rows start from
mpickpt's initialization, so both models and every world size and plan start from the same rows;
the dense part is torchrec's, initialized under the seed). Construction is collective.
"""
from __future__ import annotations

import os

import torch

from mpickpt.model.torchrec import TorchRecModel, dense_allreduce_wrapper
from mpickpt.model.torchrec_support import load_torchrec

SHARDINGS = ("table_wise", "row_wise")
FUSED = {"adagrad": "RowWiseAdagrad", "sgd": "SGD"}
"""mpickpt's --optimizer -> the fused optimizer of the rows (fbgemm has no fused momentum)."""
MODULE_PATH = "sparse_arch.embedding_bag_collection"


def check_torchrec_options(optimizer: str, sharding: str, num_tables: int, world: int) -> None:
    """ValueError naming the flag for a choice the TorchRec model cannot take. Local, pure."""
    if optimizer not in FUSED:
        raise ValueError(f"--model torchrec trains its rows with fbgemm's fused optimizers: "
                         f"--optimizer must be one of {', '.join(FUSED)}, got {optimizer!r}")
    if sharding not in SHARDINGS:
        raise ValueError(f"--torchrec-sharding must be one of {', '.join(SHARDINGS)}, "
                         f"got {sharding!r}")
    if sharding == "table_wise" and num_tables < world:
        raise ValueError(f"--torchrec-sharding table_wise leaves ranks without a table: "
                         f"{num_tables} tables on {world} ranks; use row_wise")


def table_wise_ranks(table_sizes, world: int) -> list[int]:
    """The rank of each table: largest first onto the least loaded rank (ties: lower rank).
    Local, pure."""
    load = [0] * world
    ranks = [0] * len(table_sizes)
    for t in sorted(range(len(table_sizes)), key=lambda t: (-table_sizes[t], t)):
        r = min(range(world), key=lambda r: (load[r], r))
        ranks[t], load[r] = r, load[r] + table_sizes[t]
    return ranks


def build_torchrec_dlrm(topo, config, timer=None) -> TorchRecModel:
    """The TorchRec DLRM of a `TrainConfig` on this job's process group. Collective."""
    model_cfg, arch, optim = config.model, config.arch, config.optim
    world = topo.world_size
    check_torchrec_options(optim.kind, model_cfg.torchrec_sharding, len(config.table_sizes),
                           world)
    load_torchrec()
    import torchrec.optim
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=arch.dim, num_embeddings=n,
                                 feature_names=[f"f{i}"])
              for i, n in enumerate(config.table_sizes)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_cfg.seed)
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        dlrm = DLRM(embedding_bag_collection=ebc, dense_in_features=arch.num_dense,
                    dense_arch_layer_sizes=list(arch.bottom[1:]),
                    over_arch_layer_sizes=list(arch.top), dense_device=topo.device)
    fused = {"lr": optim.lr} | ({"eps": optim.eps} if optim.kind == "adagrad" else {})
    apply_optimizer_in_backward(getattr(torchrec.optim, FUSED[optim.kind]), ebc.parameters(),
                                fused)
    skip_constructor_collective()
    sharder = cpu_capable_sharder()
    plan = ShardingPlan({MODULE_PATH: _module_plan(ebc, sharder, config.table_sizes,
                                                   model_cfg.torchrec_sharding, world,
                                                   topo.device.type)})
    dmp = DistributedModelParallel(module=dlrm, device=topo.device, plan=plan,
                                   env=ShardingEnv.from_process_group(topo.pg),
                                   sharders=[sharder],
                                   data_parallel_wrapper=dense_allreduce_wrapper())
    dense = (lambda ps: torch.optim.Adagrad(ps, lr=optim.lr, eps=optim.eps)) \
        if optim.kind == "adagrad" else (lambda ps: torch.optim.SGD(ps, lr=optim.lr))
    return TorchRecModel(dmp, topo, dense, init_seed=model_cfg.seed,
                         shard_lost=topo.replacement)


def skip_constructor_collective() -> None:
    """DMP's constructor broadcasts, once per process, whether torchrec validates collectives
    (`TORCHREC_VALIDATE_COLLECTIVES`, else a Meta-internal knob that is off outside Meta). A
    replacement that builds its model beside survivors that built theirs long ago would wait
    in that broadcast forever: settle it here from the variable alone, the same on every rank
    (the job's environment is). Local."""
    from torchrec.distributed import collective_utils

    if not getattr(collective_utils, "_INITIALIZED", True):
        collective_utils._USE_COLLECTIVE_VALIDATION = \
            os.environ.get("TORCHREC_VALIDATE_COLLECTIVES", "") == "1"
        collective_utils._INITIALIZED = True


def cpu_capable_sharder():
    """torchrec's EmbeddingBagCollection sharder offering row-wise on CPU too (the stock one
    offers it for "cuda" only; it runs on CPU). Local."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    class Sharder(EmbeddingBagCollectionSharder):
        def sharding_types(self, compute_device_type):
            return super().sharding_types("cuda")

    return Sharder()


def _module_plan(ebc, sharder, table_sizes, sharding: str, world: int, device_type: str):
    from torchrec.distributed.sharding_plan import (construct_module_sharding_plan, row_wise,
                                                    table_wise)

    ranks = table_wise_ranks(table_sizes, world)
    spec = {f"t{i}": row_wise(compute_kernel="fused") if sharding == "row_wise" else
            table_wise(rank=ranks[i], compute_kernel="fused") for i in range(len(table_sizes))}
    return construct_module_sharding_plan(ebc, spec, sharder=sharder, local_size=world,
                                          world_size=world, device_type=device_type)
