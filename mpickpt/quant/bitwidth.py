"""Which codec each row array gets, and Check-N-Run's dynamic bit-width (§4.2.3). Local.

With ``--ckpt-bits auto`` the width follows the expected number of restores over the job,
E = failures per node-hour x nodes x expected training hours: quantization error accumulates with
every restore from a quantized checkpoint, so fewer expected restores afford fewer bits. The
paper's thresholds: E <= 1: 2 bits; E <= 3: 3 bits; E <= 20: 4 bits; else 8 bits. Once the job has
been restored more often than E, the width falls back to 8 bits for good. The restore count travels
in the manifests (``stats["restores"]``), so it survives the restarts it counts.

Optimizer state stays at 16 bits or more unless ``--ckpt-state-bits 8`` asks otherwise (8-bit
asymmetric per row for vector state; 1-D per-row state never goes below float16).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mpickpt.quant.codecs import Codec, codec_for
from mpickpt.quant.config import BIT_CHOICES, STATE_BIT_CHOICES, QuantConfig

THRESHOLDS = ((1.0, 2), (3.0, 3), (20.0, 4))
"""(largest expected restores, bits), in order; above the last: `FALLBACK_BITS`."""
FALLBACK_BITS = 8


def expected_restores(failure_rate: float, nodes: int, hours: float) -> float:
    """Expected failures (each a restore) of a job: rate per node-hour x nodes x hours. Local."""
    return failure_rate * nodes * hours


def bits_for(expected: float) -> int:
    """The paper's width for `expected` restores. Local."""
    for limit, bits in THRESHOLDS:
        if expected <= limit:
            return bits
    return FALLBACK_BITS


@dataclass
class BitWidthPolicy:
    """The weight codec's width over a job: fixed, or `auto` from the expected restores."""

    config: QuantConfig = field(default_factory=QuantConfig)
    nodes: int = 1
    restores: int = 0
    fell_back: bool = field(default=False, init=False)

    def __post_init__(self):
        c = self.config
        if str(c.bits) not in BIT_CHOICES:
            raise ValueError(f"--ckpt-bits must be one of {', '.join(BIT_CHOICES)}, got "
                             f"{c.bits!r}")
        if c.state_bits is not None and c.state_bits not in STATE_BIT_CHOICES:
            raise ValueError(f"--ckpt-state-bits must be one of {STATE_BIT_CHOICES}, got "
                             f"{c.state_bits!r}")
        if self.auto:
            if c.failure_rate is None or c.hours is None:
                raise ValueError("--ckpt-bits auto needs --node-failure-rate (failures per node "
                                 "per hour) and --expected-train-hours")
            if c.failure_rate < 0 or c.hours < 0 or self.nodes < 1:
                raise ValueError(f"--node-failure-rate and --expected-train-hours must be >= 0 "
                                 f"and nodes >= 1, got {c.failure_rate!r}, {c.hours!r}, "
                                 f"{self.nodes!r}")
        self.weight_codec()  # refuse a bad --ckpt-quant / bins / ratio before training starts

    @property
    def auto(self) -> bool:
        return str(self.config.bits) == "auto"

    @property
    def expected(self) -> float | None:
        c = self.config
        return expected_restores(c.failure_rate, self.nodes, c.hours) if self.auto else None

    def bits(self) -> int:
        """The weight width in force now. Local."""
        if not self.auto:
            return int(self.config.bits)
        if self.fell_back or self.restores > self.expected:
            return FALLBACK_BITS
        return bits_for(self.expected)

    def note_restore(self, restores: int) -> str | None:
        """Record that the job has now been restored `restores` times; a log line when that
        makes `auto` fall back to 8 bits. Local."""
        self.restores = restores
        if self.auto and not self.fell_back and restores > self.expected:
            self.fell_back = True
            return (f"quantization: {restores} restores exceed the expected "
                    f"{self.expected:.2f}: checkpoints fall back to {FALLBACK_BITS} bits")
        return None

    def explain(self) -> str:
        """The choice and its inputs, for the log. Local."""
        codec = self.weight_codec()
        c = self.config
        if not self.auto:
            return f"quantization: --ckpt-bits {c.bits}: weights {codec.label()}"
        why = (f"{self.restores} restores so far exceed the estimate" if self.bits() == FALLBACK_BITS
               and self.restores > self.expected else "thresholds <=1: 2, <=3: 3, <=20: 4, else 8")
        return (f"quantization: --ckpt-bits auto: expected restores {self.expected:.2f} = "
                f"{c.failure_rate:g} failures/node-hour x {self.nodes} nodes x {c.hours:g} h "
                f"({why}; restores so far {self.restores}) -> weights {codec.label()}")

    def weight_codec(self) -> Codec:
        c = self.config
        kw = {"search": c.search, "num_bins": c.bins, "ratio": c.ratio} \
            if c.quant == "adaptive" else {}
        return codec_for(self.bits(), c.quant, **kw)

    def state_codec(self, vector: bool) -> Codec:
        """Codec of optimizer state: float32 with lossless weights, else float16 by default. Local."""
        bits = self.config.state_bits if self.config.state_bits is not None else (
            32 if self.weight_codec().lossless else 16)
        if bits == 8 and not vector:
            bits = 16  # 1-D per-row state: one value per row, float16 at least
        return codec_for(bits, "asym")

    def row_codecs(self, row_state: dict) -> dict[str, Codec]:
        """Codec of each row array that is not stored losslessly (name -> Codec). Local."""
        out = {}
        for name, tensor in row_state.items():
            codec = self.weight_codec() if name == "weight" else \
                self.state_codec(vector=len(tensor.shape) > 1)
            if not codec.lossless:
                out[name] = codec
        return out
