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

BIT_CHOICES = ("32", "16", "8", "4", "3", "2", "auto")
STATE_BIT_CHOICES = (32, 16, 8)
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

    requested: str = "32"
    quant: str = "adaptive"
    search: str = "refined"
    num_bins: int = 0
    ratio: float = -1.0
    state_bits: int | None = None
    failure_rate: float | None = None
    nodes: int = 1
    hours: float | None = None
    restores: int = 0
    fell_back: bool = field(default=False, init=False)

    def __post_init__(self):
        if str(self.requested) not in BIT_CHOICES:
            raise ValueError(f"--ckpt-bits must be one of {', '.join(BIT_CHOICES)}, got "
                             f"{self.requested!r}")
        if self.state_bits is not None and self.state_bits not in STATE_BIT_CHOICES:
            raise ValueError(f"--ckpt-state-bits must be one of {STATE_BIT_CHOICES}, got "
                             f"{self.state_bits!r}")
        if self.auto:
            if self.failure_rate is None or self.hours is None:
                raise ValueError("--ckpt-bits auto needs --node-failure-rate (failures per node "
                                 "per hour) and --expected-train-hours")
            if self.failure_rate < 0 or self.hours < 0 or self.nodes < 1:
                raise ValueError(f"--node-failure-rate and --expected-train-hours must be >= 0 "
                                 f"and nodes >= 1, got {self.failure_rate!r}, {self.hours!r}, "
                                 f"{self.nodes!r}")
        self.weight_codec()  # refuse a bad --ckpt-quant / bins / ratio before training starts

    @property
    def auto(self) -> bool:
        return str(self.requested) == "auto"

    @property
    def expected(self) -> float | None:
        return expected_restores(self.failure_rate, self.nodes, self.hours) if self.auto else None

    def bits(self) -> int:
        """The weight width in force now. Local."""
        if not self.auto:
            return int(self.requested)
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
        if not self.auto:
            return f"quantization: --ckpt-bits {self.requested}: weights {codec.label()}"
        why = (f"{self.restores} restores so far exceed the estimate" if self.bits() == FALLBACK_BITS
               and self.restores > self.expected else "thresholds <=1: 2, <=3: 3, <=20: 4, else 8")
        return (f"quantization: --ckpt-bits auto: expected restores {self.expected:.2f} = "
                f"{self.failure_rate:g} failures/node-hour x {self.nodes} nodes x {self.hours:g} h "
                f"({why}; restores so far {self.restores}) -> weights {codec.label()}")

    def weight_codec(self) -> Codec:
        kw = {"search": self.search, "num_bins": self.num_bins, "ratio": self.ratio} \
            if self.quant == "adaptive" else {}
        return codec_for(self.bits(), self.quant, **kw)

    def state_codec(self, vector: bool) -> Codec:
        """Codec of optimizer state: float32 with lossless weights, else float16 by default. Local."""
        bits = self.state_bits if self.state_bits is not None else (
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
