"""The trainer's DLRM-style flags and the validated `TrainConfig` built from them.

Only this module parses argv. Every check that does not need MPI runs in `TrainConfig.from_args`;
`TrainConfig.check_world` adds the checks that need the world size. Both raise `ValueError` /
`OSError` subclasses whose message names the flag or file and what was expected.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from mpickpt.data.synthetic import criteo_kaggle_sizes
from mpickpt.engine.config import OVERLAP_POLICIES, CheckpointConfig
from mpickpt.engine.kinds import INCRCP_RESETS, KINDS
from mpickpt.faults import FailAt, KillAt
from mpickpt.quant.bitwidth import BIT_CHOICES, STATE_BIT_CHOICES
from mpickpt.quant.codecs import QUANT_CHOICES
from mpickpt.quant.search import SEARCHES
from mpickpt.model.dense import DenseArch, parse_mlp
from mpickpt.model.optimizers import OPTIMIZERS, OptimizerConfig
from mpickpt.model.shard_plan import ShardPlan, ShardPlanOptions
from mpickpt.parity.guard import ParityConfig

CRITEO_PRESET = "criteo-kaggle"


class FlagError(ValueError):
    """A malformed flag value (raised instead of argparse's print-and-exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise FlagError(message)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The trainer's argument parser (DLRM flag names). Local."""
    p = _Parser(prog="mpickpt-train", description="Hybrid-parallel DLRM training over MPI.")
    a = p.add_argument
    a("--arch-sparse-feature-size", type=_int_at_least(1), default=16, help="embedding dimension")
    a("--arch-embedding-size", default="4000-3000-2000-1000-500-100-50-10",
      help=f"dash-separated table sizes, or '{CRITEO_PRESET}' (26 Criteo Kaggle tables "
           "divided by --embedding-scale-down)")
    a("--embedding-scale-down", type=_int_at_least(1), default=1000,
      help=f"divisor of the Criteo Kaggle cardinalities for '{CRITEO_PRESET}'")
    a("--arch-mlp-bot", default="13-64-16", help="bottom MLP widths, input (13) first, last = dim")
    a("--arch-mlp-top", default="64-32-1", help="top MLP widths after the interaction, last = 1")
    a("--mini-batch-size", type=_int_at_least(1), default=256,
      help="global mini-batch (split evenly over ranks)")
    a("--num-batches", type=_int_at_least(1), default=1000)
    a("--learning-rate", type=_positive_float, default=0.05)
    a("--optimizer", choices=OPTIMIZERS, default="adagrad",
      help="rowwise Adagrad (embeddings) + Adagrad (MLPs), SGD, or SGD with momentum")
    a("--data-generation", choices=("synthetic", "criteo-tsv"), default="synthetic")
    a("--raw-data-file", default=None,
      help="Criteo TSV day file(s) for training, comma-separated, read in order")
    a("--raw-test-file", default=None,
      help="Criteo TSV file for testing (default: the first test batches of --raw-data-file)")
    a("--skip-bad-lines", action="store_true", help="skip malformed TSV lines and count them")
    a("--num-indices-per-lookup", type=_int_at_least(1), default=1,
      help="synthetic data: rows pooled per table and sample")
    a("--zipf-alpha", type=_positive_float, default=1.05,
      help="synthetic data: power-law exponent of row popularity")
    a("--seed", type=_int_at_least(0), default=0)
    a("--print-freq", type=_int_at_least(0), default=100, help="batches between progress lines")
    a("--test-freq", type=_int_at_least(0), default=0,
      help="batches between test evaluations (0: only at the end)")
    a("--test-num-batches", type=_int_at_least(0), default=8,
      help="global batches in a test evaluation (0: no test)")
    a("--digest", action="store_true", help="print the SHA-256 of the whole training state at the end")
    a("--row-wise-threshold", type=_int_at_least(1), default=None,
      help="split tables with more rows than this row-wise (default: total rows / world size)")
    a("--max-rows-per-rank", type=_int_at_least(1), default=None,
      help="capacity of one rank in embedding rows (default: unlimited)")
    a("--backend", choices=("auto", "nccl", "gloo"), default="auto")
    a("--prefetch-depth", type=_int_at_least(1), default=4, help="batches read ahead")
    a("--phase-times", action="store_true",
      help="time the step's phases (synchronises CUDA) and print them at the end")
    c = p.add_argument_group("checkpointing (on when --ckpt-dir is given)")
    c.add_argument("--ckpt-dir", default=None, help="checkpoint root directory")
    c.add_argument("--ckpt-interval", type=_int_at_least(1), default=100,
                   help="batches between checkpoints")
    c.add_argument("--ckpt-keep", type=_int_at_least(1), default=2,
                   help="committed checkpoints to retain")
    c.add_argument("--resume", default="latest",
                   help="'latest' (newest valid, falling back past corrupted ones), 'none', or a step")
    c.add_argument("--ckpt-writers", type=_int_at_least(1), default=1,
                   help="background writer processes per rank (one part file each)")
    c.add_argument("--ckpt-overlap", choices=OVERLAP_POLICIES, default="wait",
                   help="when the previous checkpoint is still being written: wait, or skip")
    c.add_argument("--ckpt-kind", choices=KINDS, default="full",
                   help="full; differential (one-shot baseline); consecutive; intermittent "
                        "(differential with Check-N-Run's baseline predictor); incrcp (consecutive "
                        "increments in IncrCP's 2-D chunk store)")
    c.add_argument("--incrcp-ratio", type=_ratio, default=0.02,
                   help="IncrCP's selective-extraction threshold R (0..1)")
    c.add_argument("--incrcp-reset", choices=INCRCP_RESETS, default="cost",
                   help="incrcp baselines: IncrCP's cost model (construction + extrapolated "
                        "recovery time), or never (one chain per run)")
    q = p.add_argument_group("quantized checkpoints (Check-N-Run; training stays float32)")
    q.add_argument("--ckpt-bits", choices=BIT_CHOICES, default="32",
                   help="bits per embedding weight in checkpoints: 32 (lossless), 16 (float16), "
                        "8/4/3/2 (quantized per row), or auto (from the expected restores)")
    q.add_argument("--ckpt-quant", choices=QUANT_CHOICES, default="adaptive",
                   help="quantizer below 16 bits: sym, asym, adaptive (Check-N-Run's adaptive "
                        "asymmetric range search) or kmeans (per-row k-means, a reference)")
    q.add_argument("--quant-search", choices=SEARCHES, default="refined",
                   help="adaptive range search: refined (greedy walk + least-squares polish, never "
                        "worse) or greedy (the paper's walk)")
    q.add_argument("--quant-bins", type=_int_at_least(1), default=0,
                   help="greedy walk bins (default: 25 at 2 and 3 bits, 45 at 4 bits)")
    q.add_argument("--quant-ratio", type=_ratio, default=-1.0,
                   help="greedy walk: fraction of the range it may clip (default: 0.5 at 2 bits, "
                        "0.2 at 3 and 4 bits)")
    q.add_argument("--ckpt-state-bits", type=int, choices=STATE_BIT_CHOICES, default=None,
                   help="optimizer state bits (default: 32 with lossless weights, else 16)")
    q.add_argument("--node-failure-rate", type=float, default=None,
                   help="--ckpt-bits auto: failures per node per hour")
    q.add_argument("--expected-train-hours", type=float, default=None,
                   help="--ckpt-bits auto: expected training time in hours")
    q.add_argument("--nodes", type=_int_at_least(1), default=None,
                   help="--ckpt-bits auto: nodes of the job (default: counted from the ranks)")
    e = p.add_argument_group("in-memory parity (ECRM; level 1, below the checkpoints)")
    e.add_argument("--parity-k", type=_int_at_least(1), default=None, metavar="K",
                   help="data ranks per parity group (groups of K + R consecutive ranks; the "
                        "world size must be a multiple of K + R); off when not given")
    e.add_argument("--parity-r", type=_int_at_least(1), default=1, metavar="R",
                   help="parity units per stripe: 1 = XOR, 2 or more = Reed-Solomon over GF(2^8); "
                        "R failed ranks per group are rebuilt exactly")
    e.add_argument("--rebuild-budget", type=_positive_float, default=0.1, metavar="F",
                   help="fraction of a step's time each rebuild round may spend on its chunk")
    t = p.add_argument_group("testing")
    t.add_argument("--inject-kill", default=None, metavar="STEP:RANK[,RANK...]",
                   help="those ranks SIGKILL themselves after step STEP")
    t.add_argument("--inject-failure", default=None, metavar="STEP:RANK[,RANK...]",
                   help="after step STEP those ranks lose their shards, optimizer state and "
                        "parity (NaN) and the job recovers them: from parity when it can, else "
                        "from the latest checkpoint")
    t.add_argument("--inject-extract-crash", type=_int_at_least(1), default=None, metavar="N",
                   help="rank 0's extractor SIGKILLs itself in its N-th ingestion, after writing "
                        "the bundles and before committing the chunk index")
    t.add_argument("--trace-samples", default=None, metavar="PATH",
                   help="rank 0 appends 'step position' for every step to PATH")
    return p


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Everything the trainer needs, validated."""

    arch: DenseArch
    table_sizes: tuple[int, ...]
    optim: OptimizerConfig
    plan_options: ShardPlanOptions
    global_batch: int
    num_batches: int
    data_generation: str
    raw_data_files: tuple[str, ...]
    raw_test_files: tuple[str, ...]
    skip_bad_lines: bool
    pooling: int
    zipf_alpha: float
    seed: int
    print_freq: int
    test_freq: int
    test_num_batches: int
    digest: bool
    backend: str
    prefetch_depth: int
    phase_times: bool
    checkpoint: CheckpointConfig | None
    inject_kill: KillAt | None
    parity: ParityConfig | None
    inject_failure: FailAt | None
    trace_samples: str | None

    @classmethod
    def from_args(cls, argv=None) -> "TrainConfig":
        """Parse and validate everything that does not depend on MPI. Local."""
        args = build_parser().parse_args(argv)
        sizes = _table_sizes(args.arch_embedding_size, args.embedding_scale_down)
        dim = args.arch_sparse_feature_size
        arch = DenseArch(num_dense=13, num_tables=len(sizes), dim=dim,
                         bottom=parse_mlp(args.arch_mlp_bot, "--arch-mlp-bot"),
                         top=parse_mlp(args.arch_mlp_top, "--arch-mlp-top"))
        train_files, test_files = _data_files(args, sizes)
        return cls(arch=arch, table_sizes=sizes,
                   optim=OptimizerConfig(kind=args.optimizer, lr=args.learning_rate),
                   plan_options=ShardPlanOptions(row_wise_threshold=args.row_wise_threshold,
                                                 max_rows_per_rank=args.max_rows_per_rank),
                   global_batch=args.mini_batch_size, num_batches=args.num_batches,
                   data_generation=args.data_generation, raw_data_files=train_files,
                   raw_test_files=test_files, skip_bad_lines=args.skip_bad_lines,
                   pooling=args.num_indices_per_lookup, zipf_alpha=args.zipf_alpha,
                   seed=args.seed, print_freq=args.print_freq, test_freq=args.test_freq,
                   test_num_batches=args.test_num_batches, digest=args.digest,
                   backend=args.backend, prefetch_depth=args.prefetch_depth,
                   phase_times=args.phase_times, checkpoint=_checkpoint(args),
                   inject_kill=KillAt.parse(args.inject_kill) if args.inject_kill else None,
                   parity=_parity(args),
                   inject_failure=(FailAt.parse(args.inject_failure)
                                   if args.inject_failure else None),
                   trace_samples=args.trace_samples)

    def check_world(self, world_size: int) -> ShardPlan:
        """Checks that need the world size; returns the shard plan. Local."""
        if self.global_batch % world_size:
            raise ValueError(f"--mini-batch-size {self.global_batch} is not divisible by the world "
                             f"size {world_size}: each rank needs an equal share of the batch")
        if self.inject_kill is not None:
            self.inject_kill.check_world(world_size)
        if self.parity is not None:
            self.parity.check_world(world_size)
        if self.inject_failure is not None:
            self.inject_failure.check_world(world_size)
            if self.parity is None and self.checkpoint is None:
                raise ValueError("--inject-failure needs something to recover from: --parity-k "
                                 "or --ckpt-dir")
        return ShardPlan.build(self.table_sizes, world_size, self.plan_options)


def _parity(args) -> ParityConfig | None:
    if args.parity_k is None:
        return None
    return ParityConfig(k=args.parity_k, r=args.parity_r, budget=args.rebuild_budget)


def _checkpoint(args) -> CheckpointConfig | None:
    if args.ckpt_dir is None:
        return None
    config = CheckpointConfig(directory=args.ckpt_dir, interval=args.ckpt_interval,
                              keep=args.ckpt_keep, resume=args.resume, writers=args.ckpt_writers,
                              overlap=args.ckpt_overlap, kind=args.ckpt_kind,
                              incrcp_ratio=args.incrcp_ratio, incrcp_reset=args.incrcp_reset,
                              inject_extract_crash=args.inject_extract_crash,
                              bits=args.ckpt_bits, quant=args.ckpt_quant,
                              quant_search=args.quant_search, quant_bins=args.quant_bins,
                              quant_ratio=args.quant_ratio, state_bits=args.ckpt_state_bits,
                              failure_rate=args.node_failure_rate,
                              train_hours=args.expected_train_hours, nodes=args.nodes)
    config.check_directory()
    return config


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text!r}")
    return value


def _table_sizes(text: str, scale_down: int) -> tuple[int, ...]:
    if text == CRITEO_PRESET:
        return criteo_kaggle_sizes(scale_down)
    try:
        sizes = tuple(int(x) for x in text.split("-"))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise FlagError(f"--arch-embedding-size must be dash-separated positive integers like "
                        f"1000-500-20 or '{CRITEO_PRESET}', got {text!r}")
    return sizes


def _data_files(args, sizes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if args.data_generation != "criteo-tsv":
        return (), ()
    if not args.raw_data_file:
        raise FlagError("--data-generation criteo-tsv needs --raw-data-file PATH[,PATH...]")
    if len(sizes) != 26:
        raise FlagError(f"Criteo TSV data has 26 categorical features, but --arch-embedding-size "
                        f"gives {len(sizes)} tables")
    train = tuple(p for p in args.raw_data_file.split(",") if p)
    test = tuple(p for p in (args.raw_test_file or "").split(",") if p)
    from mpickpt.data.criteo_tsv import CriteoTSVConfig

    for files in (train, test):
        if files:
            CriteoTSVConfig(paths=files, table_sizes=sizes, skip_bad_lines=args.skip_bad_lines).check()
    return train, test
