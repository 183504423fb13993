"""Configuration of the checkpoint engine."""
from __future__ import annotations

import os
from dataclasses import dataclass

OVERLAP_POLICIES = ("wait", "skip")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where, how often and how checkpoints are written and restored."""

    directory: str
    """Checkpoint root (one per job; a parallel filesystem on clusters)."""
    interval: int
    """Batches between checkpoints (>= 1)."""
    keep: int = 2
    """Committed checkpoints to retain (>= 1); older ones are deleted after a newer commit."""
    resume: str = "latest"
    """'latest' (newest valid, falling back past corrupted ones), 'none', or a step number."""
    writers: int = 1
    """Background writer processes per rank (>= 1); each writes one part file of the shard."""
    overlap: str = "wait"
    """When the previous checkpoint is still being written: 'wait' for it, or 'skip' this one."""
    kind: str = "full"
    """'full', 'differential', 'consecutive', 'intermittent' or 'incrcp' (see engine.kinds)."""
    incrcp_ratio: float = 0.02
    """IncrCP's selective-extraction threshold R."""
    incrcp_reset: str = "cost"
    """incrcp: new baselines by IncrCP's cost model ('cost') or never ('never')."""
    inject_extract_crash: int | None = None
    """Testing: rank 0's extractor dies in its N-th ingestion, before the index commit."""
    bits: str = "32"
    """Embedding weight bits in checkpoints: '32', '16', '8', '4', '3', '2' or 'auto'."""
    quant: str = "adaptive"
    """Quantizer below 16 bits: 'sym', 'asym', 'adaptive' or 'kmeans'."""
    quant_search: str = "refined"
    """Adaptive range search: 'refined' or 'greedy' (the paper's walk)."""
    quant_bins: int = 0
    """Greedy walk bins (0: the paper's default for the width)."""
    quant_ratio: float = -1.0
    """Greedy walk ratio (< 0: the paper's default for the width)."""
    state_bits: int | None = None
    """Optimizer state bits (None: 32 with lossless weights, else 16)."""
    failure_rate: float | None = None
    """--ckpt-bits auto: failures per node per hour."""
    train_hours: float | None = None
    """--ckpt-bits auto: expected training hours."""
    nodes: int | None = None
    """--ckpt-bits auto: nodes of the job (None: counted from the ranks)."""

    def __post_init__(self):
        if not self.directory:
            raise ValueError("--ckpt-dir must name a directory, got an empty string")
        for name in ("interval", "keep", "writers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--ckpt-{name} must be an integer >= 1, got {value!r}")
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(f"--ckpt-overlap must be 'wait' or 'skip', got {self.overlap!r}")
        from mpickpt.engine.kinds import KINDS

        if self.kind not in KINDS:
            raise ValueError(f"--ckpt-kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.incrcp_reset not in ("cost", "never"):
            raise ValueError(f"--incrcp-reset must be 'cost' or 'never', got {self.incrcp_reset!r}")
        if not 0.0 <= self.incrcp_ratio <= 1.0:
            raise ValueError(f"--incrcp-ratio must lie in [0, 1], got {self.incrcp_ratio!r}")
        self.bit_policy(1)  # refuse bad quantization flags before training starts
        if self.resume not in ("latest", "none") and not str(self.resume).isdigit():
            raise ValueError(f"--resume must be 'latest', 'none' or a step number, got {self.resume!r}")

    def bit_policy(self, nodes: int):
        """A fresh BitWidthPolicy from these settings (`nodes` unless --nodes was given). Local."""
        from mpickpt.quant.bitwidth import BitWidthPolicy

        return BitWidthPolicy(requested=str(self.bits), quant=self.quant, search=self.quant_search,
                              num_bins=self.quant_bins, ratio=self.quant_ratio,
                              state_bits=self.state_bits, failure_rate=self.failure_rate,
                              nodes=self.nodes or nodes, hours=self.train_hours)

    @property
    def resume_step(self) -> int | None:
        """The chosen step, or None for 'latest'/'none'. Local."""
        return int(self.resume) if str(self.resume).isdigit() else None

    def check_directory(self) -> None:
        """Create the directory if needed; raise naming it when it cannot be used. Local."""
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(f"--ckpt-dir {self.directory} exists and is not a directory")
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise OSError(f"--ckpt-dir {self.directory} cannot be created: {e.strerror}") from None
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(f"--ckpt-dir {self.directory} is not writable")
