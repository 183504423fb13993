"""The trainer's DLRM-style flags and the validated `TrainConfig` built from them.

Only this module parses argv. Every flag is declared once, as a field of the config dataclass it
fills (`mpickpt.options`): model, data and run here; checkpoint (`engine.config`), quantization
(`quant.config`), parity (`parity.guard`) and faults (`faults`) beside their mechanisms. Every check
that does not need MPI runs in `TrainConfig.from_args`; `TrainConfig.check_world` adds the checks
that need the world size. Both raise `ValueError` / `OSError` subclasses whose message names the
flag or file and what was expected.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import ClassVar

from mpickpt.data.synthetic import criteo_kaggle_sizes
from mpickpt.engine.config import CheckpointConfig
from mpickpt.faults.config import FaultConfig
from mpickpt.model.dense import DenseArch, parse_mlp
from mpickpt.model.optimizers import OPTIMIZERS, OptimizerConfig
from mpickpt.model.registry import MODEL_NAMES
from mpickpt.model.shard_plan import ShardPlan, ShardPlanOptions
from mpickpt.options import (add_options, changed_flags, check_output, int_at_least, option,
                             positive_float, values_from)
from mpickpt.parity.guard import ParityConfig
from mpickpt.quant.config import QuantConfig
from mpickpt.recovery.config import RecoveryConfig, check_combination

CRITEO_PRESET = "criteo-kaggle"

GROUPS = (
    ("model", "model", None),
    ("data", "data", None),
    ("run", "training run", None),
    ("checkpoint", "checkpointing (on when --ckpt-dir is given)", None),
    ("quantization", "quantized checkpoints (Check-N-Run; training stays float32)", None),
    ("parity", "in-memory parity (ECRM; level 1, below the checkpoints)", None),
    ("recovery", "recovery of lost shards (CPR partial recovery, intervals from failure models)",
     None),
    ("faults", "fault injection and tracing (tests)", None),
)
"""Argument groups of `--help`, by concern: (key, title, description)."""


class FlagError(ValueError):
    """A malformed flag value (raised instead of argparse's print-and-exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FlagError(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The DLRM: embedding tables, MLPs, optimizer, placement."""

    OPTION_GROUP: ClassVar[str] = "model"

    arch_sparse_feature_size: int = option(16, parse=int_at_least(1))
    """embedding dimension D"""
    arch_embedding_size: str = option("4000-3000-2000-1000-500-100-50-10")
    """dash-separated table sizes, or 'criteo-kaggle' (26 Criteo Kaggle tables divided by
    --embedding-scale-down)"""
    embedding_scale_down: int = option(1000, parse=int_at_least(1))
    """divisor of the Criteo Kaggle cardinalities for 'criteo-kaggle'"""
    arch_mlp_bot: str = option("13-64-16")
    """bottom MLP widths, input (13) first, last = dim"""
    arch_mlp_top: str = option("64-32-1")
    """top MLP widths after the interaction, last = 1"""
    model: str = option("dlrm", choices=MODEL_NAMES)
    """the model: mpickpt's hybrid-parallel DLRM, or torchrec's DLRM under
    DistributedModelParallel (needs the torchrec extra; see mpickpt.model.registry)"""
    torchrec_sharding: str = option("table_wise", choices=("table_wise", "row_wise"))
    """--model torchrec: every table on one rank (table_wise) or split over all (row_wise)"""
    import_dcp: str | None = option(None, metavar="DIR")
    """--model torchrec: start from this torch DCP checkpoint of the DMP (dmp.state_dict()
    under 'model'; any plan or world size) when --ckpt-dir holds no checkpoint yet, and make it
    the first checkpoint there"""
    export_dcp: str | None = option(None, metavar="DIR")
    """--model torchrec: at the end, also write the model as a torch DCP checkpoint here
    ('model': dmp.state_dict(), 'fused_optimizer', 'dense_optimizer')"""
    optimizer: str = option("adagrad", choices=OPTIMIZERS)
    """rowwise Adagrad (embeddings) + Adagrad (MLPs), SGD, or SGD with momentum"""
    learning_rate: float = option(0.05, parse=positive_float)
    """learning rate of both optimizers"""
    seed: int = option(0, parse=int_at_least(0))
    """seed of the initial model and of the synthetic data"""
    row_wise_threshold: int | None = option(None, parse=int_at_least(1))
    """split tables with more rows than this row-wise (default: total rows / world size)"""
    max_rows_per_rank: int | None = option(None, parse=int_at_least(1))
    """capacity of one rank in embedding rows (default: unlimited)"""

    def check_placement_flags(self) -> None:
        """Each model's placement flags only with that model (the other would ignore them):
        FlagError naming them. Local."""
        if self.model == "torchrec":
            _refuse_without(changed_flags(ModelConfig, self, ("row_wise_threshold",
                                                              "max_rows_per_rank")),
                            "--model dlrm", "--model torchrec places its tables by "
                            "--torchrec-sharding and would ignore it")
        else:
            _refuse_without(changed_flags(ModelConfig, self, ("torchrec_sharding",)),
                            "--model torchrec", f"--model {self.model} would ignore it")

    def check_dcp_flags(self) -> None:
        """--import-dcp and --export-dcp: only with --model torchrec; the import directory must
        hold a DCP checkpoint. ValueError naming the flag. Local."""
        for flag, path in (("--import-dcp", self.import_dcp), ("--export-dcp", self.export_dcp)):
            if path is not None and self.model != "torchrec":
                raise FlagError(f"{flag} needs --model torchrec (a DMP's state dict), got "
                                f"--model {self.model}")
        if self.import_dcp is not None and \
                not os.path.isfile(os.path.join(self.import_dcp, ".metadata")):
            raise FlagError(f"--import-dcp {self.import_dcp}: not a DCP checkpoint directory "
                            f"(no .metadata file)")
        if self.import_dcp is not None:
            from mpickpt.model.torchrec_dcp import importable_entries
            try:
                importable_entries(self.import_dcp)
            except ValueError as e:
                raise FlagError(f"--import-dcp {e}") from None

    def table_sizes(self) -> tuple[int, ...]:
        """The tables' row counts; FlagError naming the flag when malformed. Local."""
        text = self.arch_embedding_size
        if text == CRITEO_PRESET:
            return criteo_kaggle_sizes(self.embedding_scale_down)
        try:
            sizes = tuple(int(x) for x in text.split("-"))
        except ValueError:
            sizes = ()
        if not sizes or any(n < 1 for n in sizes):
            raise FlagError(f"--arch-embedding-size must be dash-separated positive integers "
                            f"like 1000-500-20 or '{CRITEO_PRESET}', got {text!r}")
        return sizes

    def arch(self, num_tables: int) -> DenseArch:
        """The dense part's shapes; ValueError naming the flag when they do not fit. Local."""
        return DenseArch(num_dense=13, num_tables=num_tables, dim=self.arch_sparse_feature_size,
                         bottom=parse_mlp(self.arch_mlp_bot, "--arch-mlp-bot"),
                         top=parse_mlp(self.arch_mlp_top, "--arch-mlp-top"))


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where samples come from and how they are batched."""

    OPTION_GROUP: ClassVar[str] = "data"

    data_generation: str = option("synthetic", choices=("synthetic", "criteo-tsv"))
    """synthetic (a planted logistic model over Zipf rows) or criteo-tsv (raw Criteo day files)"""
    raw_data_file: str | None = option(None)
    """Criteo TSV day file(s) for training, comma-separated, read in order"""
    raw_test_file: str | None = option(None)
    """Criteo TSV file for testing (default: the first test batches of --raw-data-file)"""
    skip_bad_lines: bool = option(False, switch=True)
    """skip malformed TSV lines and count them"""
    num_indices_per_lookup: int = option(1, parse=int_at_least(1))
    """synthetic data: rows pooled per table and sample"""
    zipf_alpha: float = option(1.05, parse=positive_float)
    """synthetic data: power-law exponent of row popularity"""
    mini_batch_size: int = option(256, parse=int_at_least(1))
    """global mini-batch (split evenly over ranks)"""
    prefetch_depth: int = option(4, parse=int_at_least(1))
    """batches read ahead"""

    def files(self, train: bool) -> tuple[str, ...]:
        """The training (or test) TSV paths, in order. Local."""
        text = self.raw_data_file if train else self.raw_test_file
        return tuple(p for p in (text or "").split(",") if p)

    def check(self, table_sizes: tuple[int, ...]) -> None:
        """The data source fits the model and its files can be read. Local."""
        if self.data_generation != "criteo-tsv":
            stray = changed_flags(DataConfig, self, ("raw_data_file", "raw_test_file",
                                                     "skip_bad_lines"))
            _refuse_without(stray, "--data-generation criteo-tsv",
                            f"--data-generation {self.data_generation} would ignore it")
            return
        stray = changed_flags(DataConfig, self, ("num_indices_per_lookup", "zipf_alpha"))
        _refuse_without(stray, "--data-generation synthetic",
                        "--data-generation criteo-tsv would ignore it")
        if not self.raw_data_file:
            raise FlagError("--data-generation criteo-tsv needs --raw-data-file PATH[,PATH...]")
        if len(table_sizes) != 26:
            raise FlagError(f"Criteo TSV data has 26 categorical features, but "
                            f"--arch-embedding-size gives {len(table_sizes)} tables")
        from mpickpt.data.criteo_tsv import CriteoTSVConfig

        for files in (self.files(True), self.files(False)):
            if files:
                CriteoTSVConfig(paths=files, table_sizes=table_sizes,
                                skip_bad_lines=self.skip_bad_lines).check()


@dataclass(frozen=True, kw_only=True, slots=True)
class RunConfig:
    """How long to train and what to report."""

    OPTION_GROUP: ClassVar[str] = "run"

    num_batches: int = option(1000, parse=int_at_least(1))
    """training steps (global batches)"""
    print_freq: int = option(100, parse=int_at_least(0))
    """batches between progress lines"""
    test_freq: int = option(0, parse=int_at_least(0))
    """batches between test evaluations (0: only at the end)"""
    test_num_batches: int = option(8, parse=int_at_least(0))
    """global batches in a test evaluation (0: no test)"""
    digest: bool = option(False, switch=True)
    """print the SHA-256 of the whole training state at the end"""
    backend: str = option("auto", choices=("auto", "nccl", "gloo"))
    """torch.distributed backend of the data plane (auto: NCCL when CUDA is usable)"""
    phase_times: bool = option(False, switch=True)
    """time the step's phases (synchronises CUDA) and print them at the end"""
    run_report: str | None = option(None, metavar="PATH")
    """rank 0 writes what the run did (every step's loss and time, saves, losses and their
    recovery, test metrics, PLS) as JSON to PATH at the end (benchmarks read it)"""


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (DLRM flag names), grouped by concern. Local."""
    p = _Parser(prog="mpickpt-train", description="Hybrid-parallel DLRM training over MPI.")
    groups = {key: p.add_argument_group(title, text) for key, title, text in GROUPS}
    for cls in (ModelConfig, DataConfig, RunConfig, CheckpointConfig, QuantConfig, ParityConfig,
                RecoveryConfig, FaultConfig):
        add_options(p, cls, groups)
    return p


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything the trainer needs, validated: the flags by concern, and what they imply."""

    model: ModelConfig
    data: DataConfig
    run: RunConfig
    checkpoint: CheckpointConfig | None
    parity: ParityConfig | None
    recovery: RecoveryConfig
    faults: FaultConfig
    # ---- derived from the flags
    table_sizes: tuple[int, ...]
    arch: DenseArch
    optim: OptimizerConfig
    plan_options: ShardPlanOptions

    @classmethod
    def from_args(cls, argv=None) -> "TrainConfig":
        """Parse and validate everything that does not depend on MPI. Local."""
        args = build_parser().parse_args(argv)
        model = ModelConfig(**values_from(ModelConfig, args))
        data = DataConfig(**values_from(DataConfig, args))
        sizes = model.table_sizes()
        arch = model.arch(len(sizes))
        data.check(sizes)
        checkpoint, parity = _checkpoint(args), _parity(args)
        recovery = RecoveryConfig(**values_from(RecoveryConfig, args))
        faults = FaultConfig(**values_from(FaultConfig, args))
        check_combination(recovery, checkpoint, parity, faults)
        if checkpoint is not None:
            checkpoint.quant.check_flags(model.optimizer)
        if model.model == "torchrec":
            from mpickpt.model.torchrec_dlrm import check_torchrec_options
            check_torchrec_options(model.optimizer, model.torchrec_sharding, len(sizes), 1)
        model.check_placement_flags()
        model.check_dcp_flags()
        run = RunConfig(**values_from(RunConfig, args))
        check_output("--export-dcp", model.export_dcp, folder=True)  # every rank writes there
        return cls(model=model, data=data, run=run,
                   checkpoint=checkpoint, parity=parity, recovery=recovery, faults=faults,
                   table_sizes=sizes, arch=arch,
                   optim=OptimizerConfig(kind=model.optimizer, lr=model.learning_rate),
                   plan_options=ShardPlanOptions(row_wise_threshold=model.row_wise_threshold,
                                                 max_rows_per_rank=model.max_rows_per_rank))

    def check_root_outputs(self) -> None:
        """Rank 0's outputs (`--run-report`, `--trace-samples`) can be written where rank 0
        runs: call there only (the directory may exist on its node alone). Local."""
        check_output("--run-report", self.run.run_report, folder=False)
        check_output("--trace-samples", self.faults.trace_samples, folder=False)

    def check_world(self, world_size: int) -> ShardPlan:
        """Checks that need the world size; returns the shard plan. Local."""
        batch = self.data.mini_batch_size
        if batch % world_size:
            raise ValueError(f"--mini-batch-size {batch} is not divisible by the world "
                             f"size {world_size}: each rank needs an equal share of the batch")
        self.faults.check_world(world_size)
        if self.model.model == "torchrec":
            from mpickpt.model.torchrec_dlrm import check_torchrec_options
            check_torchrec_options(self.optim.kind, self.model.torchrec_sharding,
                                   len(self.table_sizes), world_size)
        if self.parity is not None:
            self.parity.check_world(world_size)
        if self.faults.injects_losses and self.parity is None and self.checkpoint is None:
            what = "--inject-failure" if self.faults.inject_failure else "--failure-model"
            raise ValueError(f"{what} needs something to recover from: --parity-k or --ckpt-dir")
        return ShardPlan.build(self.table_sizes, world_size, self.plan_options)

    # ---- shorthands the loop uses every step
    @property
    def global_batch(self) -> int:
        return self.data.mini_batch_size

    @property
    def num_batches(self) -> int:
        return self.run.num_batches


def _parity(args) -> ParityConfig | None:
    values = values_from(ParityConfig, args)
    if values["k"] is None:
        _refuse_without(changed_flags(ParityConfig, values), "--parity-k K",
                        "parity is off without it")
        return None
    return ParityConfig(**values)


def _checkpoint(args) -> CheckpointConfig | None:
    values = values_from(CheckpointConfig, args)
    if values["directory"] is None:
        _refuse_without(changed_flags(CheckpointConfig, values) +
                        changed_flags(QuantConfig, values_from(QuantConfig, args)),
                        "--ckpt-dir DIR", "checkpointing is off without it")
        return None
    config = CheckpointConfig(**values, quant=QuantConfig(**values_from(QuantConfig, args)))
    config.check_kind_options()
    config.check_directory()
    return config


def _refuse_without(flags: list[str], needed: str, why: str) -> None:
    """FlagError naming `flags` when any was given without `needed` (which would ignore them
    silently). Local."""
    if flags:
        one = len(flags) == 1
        raise FlagError(f"{', '.join(flags)} {'needs' if one else 'need'} {needed}: "
                        + (why if one else why.replace(" it", " them")))
