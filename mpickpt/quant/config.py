"""QuantConfig: how checkpoints are quantized (the `--ckpt-bits` family of flags). Local."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mpickpt.options import (changed_flags, int_at_least, non_negative_float, only_applies,
                             option, ratio)
from mpickpt.quant.codecs import QUANT_CHOICES
from mpickpt.quant.search import SEARCHES

BIT_CHOICES = ("32", "16", "8", "4", "3", "2", "auto")
STATE_BIT_CHOICES = (32, 16, 8)
LOSSY_OPTIONS = ("quant", "search", "bins", "ratio")
"""Options of a quantizer: they apply below 16 bits (or with auto)."""
ADAPTIVE_OPTIONS = ("search", "bins", "ratio")
"""Options of the adaptive quantizer's range search."""
AUTO_OPTIONS = ("failure_rate", "hours", "nodes")
"""Inputs of --ckpt-bits auto."""


@dataclass(frozen=True, kw_only=True, slots=True)
class QuantConfig:
    """Checkpoint quantization (Check-N-Run §4.2; training stays float32)."""

    OPTION_GROUP: ClassVar[str] = "quantization"

    bits: str = option("32", flag="--ckpt-bits", choices=BIT_CHOICES)
    """bits per embedding weight in checkpoints: 32 (lossless), 16 (float16), 8/4/3/2 (quantized
    per row), or auto (from the expected restores)"""
    quant: str = option("adaptive", flag="--ckpt-quant", choices=QUANT_CHOICES)
    """quantizer below 16 bits: sym, asym, adaptive (Check-N-Run's adaptive asymmetric range
    search) or kmeans (per-row k-means, a reference)"""
    search: str = option("refined", flag="--quant-search", choices=SEARCHES)
    """adaptive range search: refined (greedy walk + least-squares polish, never worse) or greedy
    (the paper's walk)"""
    bins: int = option(0, flag="--quant-bins", parse=int_at_least(1))
    """walk bins (default, shown as 0: greedy: the paper's 25 at 2 and 3 bits, 45 at 4 bits;
    refined: 12 at 2 bits, else the paper's)"""
    ratio: float = option(-1.0, flag="--quant-ratio", parse=ratio)
    """walk: fraction of the range it may clip (default, shown as -1: greedy: the paper's 0.5 at
    2 bits, 0.2 at 3 and 4 bits; refined: 0.5 at 2 bits, 0.2 at 3, 0.09 at 4)"""
    state_bits: int | None = option(None, flag="--ckpt-state-bits", parse=int,
                                    choices=STATE_BIT_CHOICES)
    """optimizer state bits (default: 32 with lossless weights, else 16)"""
    failure_rate: float | None = option(None, flag="--node-failure-rate",
                                       parse=non_negative_float)
    """--ckpt-bits auto: failures per node per hour"""
    hours: float | None = option(None, flag="--expected-train-hours",
                                parse=non_negative_float)
    """--ckpt-bits auto: expected training time in hours"""
    nodes: int | None = option(None, flag="--nodes", parse=int_at_least(1))
    """--ckpt-bits auto: nodes of the job (default: counted from the ranks)"""

    def __post_init__(self):
        self.policy(1)  # refuse bad widths, codecs, bins or ratios before training starts

    def check_flags(self, optimizer: str) -> None:
        """Flags this configuration would ignore, or a state width the sparse `optimizer`'s
        state cannot take: ValueError naming them. The trainer's flags only (a library caller
        may set every field). Local."""
        _ignored(self, AUTO_OPTIONS, self.bits == "auto", "--ckpt-bits auto",
                 f"--ckpt-bits {self.bits}")
        _ignored(self, LOSSY_OPTIONS, self.bits not in ("32", "16"),
                 "--ckpt-bits 8, 4, 3, 2 or auto (a quantizer)", f"--ckpt-bits {self.bits}")
        _ignored(self, ADAPTIVE_OPTIONS, self.quant == "adaptive", "--ckpt-quant adaptive",
                 f"--ckpt-quant {self.quant}")
        _ignored(self, ADAPTIVE_OPTIONS, self.bits != "8",  # adaptive at 8 bits: plain asym
                 "a range search at 2, 3 or 4 bits (or auto)", "--ckpt-bits 8")
        if self.state_bits is not None and optimizer == "sgd":
            raise ValueError(f"--ckpt-state-bits {self.state_bits}: --optimizer sgd keeps no "
                             f"optimizer state per row (adagrad and momentum do)")
        if self.state_bits == 8 and optimizer != "momentum":
            raise ValueError(f"--ckpt-state-bits 8 quantizes a vector of state per row "
                             f"(--optimizer momentum); --optimizer {optimizer} keeps one value "
                             f"per row, stored as float16 at least (--ckpt-state-bits 16)")

    def policy(self, nodes: int):
        """A fresh BitWidthPolicy for a job on `nodes` nodes (unless --nodes says). Local."""
        from mpickpt.quant.bitwidth import BitWidthPolicy

        return BitWidthPolicy(self, nodes=self.nodes or nodes)


def _ignored(config: QuantConfig, names: tuple, applies: bool, where: str, this: str) -> None:
    """ValueError naming the flags of `names` the user set where they do not apply. Local."""
    stray = changed_flags(QuantConfig, config, names)
    if stray and not applies:
        raise ValueError(only_applies(stray, where, this))
