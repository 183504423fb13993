"""Configuration of the checkpoint engine (the `--ckpt-*` flags are declared here)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from mpickpt.kinds.incrcp import RESETS as INCRCP_RESETS
from mpickpt.kinds.registry import KINDS
from mpickpt.options import int_at_least, option, ratio
from mpickpt.quant.config import QuantConfig

OVERLAP_POLICIES = ("wait", "skip")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointConfig:
    """Where, how often and how checkpoints are written and restored."""

    OPTION_GROUP: ClassVar[str] = "checkpoint"

    directory: str | None = option(None, flag="--ckpt-dir")
    """checkpoint root directory, one per job (a parallel filesystem on clusters); checkpointing
    is on when it is given"""
    interval: int = option(100, flag="--ckpt-interval", parse=int_at_least(1))
    """batches between checkpoints"""
    keep: int = option(2, flag="--ckpt-keep", parse=int_at_least(1))
    """committed checkpoints to retain; older ones are deleted after a newer commit"""
    resume: str = option("latest", flag="--resume")
    """'latest' (newest valid, falling back past corrupted ones), 'none', or a step"""
    writers: int = option(1, flag="--ckpt-writers", parse=int_at_least(1))
    """background writer processes per rank (one part file each)"""
    overlap: str = option("wait", flag="--ckpt-overlap", choices=OVERLAP_POLICIES)
    """when the previous checkpoint is still being written: wait for it, or skip this one"""
    kind: str = option("full", flag="--ckpt-kind", choices=KINDS)
    """full; differential (one-shot baseline); consecutive; intermittent (differential with
    Check-N-Run's baseline predictor); incrcp (consecutive increments in IncrCP's 2-D chunk
    store)"""
    incrcp_ratio: float = option(0.02, parse=ratio)
    """IncrCP's selective-extraction threshold R (0..1)"""
    incrcp_reset: str = option("cost", choices=INCRCP_RESETS)
    """incrcp baselines: IncrCP's cost model (construction + extrapolated recovery time), or
    never (one chain per run)"""
    inject_extract_crash: int | None = option(None, parse=int_at_least(1), metavar="N",
                                              group="faults")
    """rank 0's extractor SIGKILLs itself in its N-th ingestion, after writing the bundles and
    before committing the chunk index"""
    quant: QuantConfig = field(default_factory=QuantConfig)
    """How checkpoints are quantized."""

    def __post_init__(self):
        if not self.directory:
            raise ValueError(f"--ckpt-dir must name a directory, got {self.directory!r}")
        for name in ("interval", "keep", "writers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--ckpt-{name} must be an integer >= 1, got {value!r}")
        if self.overlap not in OVERLAP_POLICIES:
            raise ValueError(f"--ckpt-overlap must be 'wait' or 'skip', got {self.overlap!r}")
        if self.kind not in KINDS:
            raise ValueError(f"--ckpt-kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.incrcp_reset not in INCRCP_RESETS:
            raise ValueError(f"--incrcp-reset must be 'cost' or 'never', got {self.incrcp_reset!r}")
        if not 0.0 <= self.incrcp_ratio <= 1.0:
            raise ValueError(f"--incrcp-ratio must lie in [0, 1], got {self.incrcp_ratio!r}")
        if self.resume not in ("latest", "none") and not str(self.resume).isdigit():
            raise ValueError(f"--resume must be 'latest', 'none' or a step number, got {self.resume!r}")

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
