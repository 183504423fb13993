"""Row codecs of quantized checkpoints: what a stored row array holds and how to get rows back. Local.

A codec turns a block of rows (n, D) float32 into named arrays (`encode`) and back (`decode`):

====================  ==========================================  ==================================
name (bits)           stored arrays                               bytes per row (D = 64)
====================  ==========================================  ==================================
``fp32`` (32)         ``values`` float32 (n, D)                   256 (lossless)
``fp16`` (16)         ``values`` float16 (n, D)                   128
``sym``/``asym``      ``codes`` uint8 (n, ceil(D*bits/8)),         D*bits/8 + 4 (36 at 4 bits)
``adaptive`` (2-8)    ``scale``, ``offset`` float16 (n,)
``kmeans`` (2-8)      ``codes`` as above, ``centroids`` float16    D*bits/8 + 2 * 2**bits
                      (n, 2**bits)
====================  ==========================================  ==================================

``adaptive`` is Check-N-Run's adaptive asymmetric codec: the range of each row from
`mpickpt.quant.search` (``refined`` by default, ``greedy`` for the paper's walk). Its 8-bit form is
plain asymmetric, as in the paper. ``kmeans`` is a per-row 1-D k-means, a reference to compare with,
never a default. A Codec is a frozen value; `attrs()` / `from_attrs` carry it in HDF5 attributes.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from mpickpt.quant import search as rs
from mpickpt.quant.packing import pack, packed_bytes, unpack

NAMES = ("fp32", "fp16", "sym", "asym", "adaptive", "kmeans")
QUANT_CHOICES = ("sym", "asym", "adaptive", "kmeans")
WIDTHS = (2, 3, 4, 8)
KMEANS_ITERS = 12


@dataclass(frozen=True)
class Codec:
    """A row codec and its parameters. Local."""

    name: str = "fp32"
    bits: int = 32
    search: str = "refined"
    num_bins: int = 0
    ratio: float = -1.0
    threads: int = 1

    def __post_init__(self):
        check_codec(self.name, self.bits, self.search, self.num_bins, self.ratio)

    @property
    def lossless(self) -> bool:
        return self.name == "fp32"

    @property
    def bins(self) -> int:
        return self.num_bins or rs.default_bins(self.bits, self.search)

    @property
    def range_ratio(self) -> float:
        if self.ratio >= 0:
            return self.ratio
        return 0.0 if self.name != "adaptive" else rs.default_ratio(self.bits, self.search)

    def label(self) -> str:
        """Short human name, e.g. 'adaptive-4 (refined)'. Local."""
        if self.name in ("fp32", "fp16"):
            return self.name
        extra = f" ({self.search}, {self.bins} bins, ratio {self.range_ratio:g})" \
            if self.name == "adaptive" and self.bits < 8 else ""
        return f"{self.name}-{self.bits}{extra}"

    def bytes_per_row(self, dim: int) -> int:
        """Stored bytes of one row of dimension `dim`. Local."""
        if self.name == "fp32":
            return 4 * dim
        if self.name == "fp16":
            return 2 * dim
        if self.name == "kmeans":
            return packed_bytes(dim, self.bits) + 2 * (1 << self.bits)
        return packed_bytes(dim, self.bits) + 4

    def attrs(self) -> dict:
        """The codec as HDF5 attributes (a JSON string). Local."""
        return {"codec": json.dumps({k: v for k, v in asdict(self).items() if k != "threads"})}

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Stored arrays of the rows `x` (n, D) float32. Local."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.name == "fp32":
            return {"values": x}
        if self.name == "adaptive" and self.bits != 8:  # checks the range in the same pass
            scale, offset, codes = rs.search_encode(x, self.bits, self.search, self.bins,
                                                    self.range_ratio, threads=self.threads)
            return {"codes": codes, "scale": scale, "offset": offset}
        rs.check_finite_range(x)
        if self.name == "fp16":
            return {"values": x.astype(np.float16)}
        if self.name == "kmeans":
            codes, centroids = kmeans_rows(x, self.bits)
            return {"codes": pack(codes, self.bits), "centroids": centroids}
        scale, offset = self.params(x)
        codes = rs.encode_packed(x, scale, offset, self.bits, self.threads)
        return {"codes": codes, "scale": scale, "offset": offset}

    def params(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float16 (scale, offset) per row for the uniform codecs. Local."""
        levels = (1 << self.bits) - 1
        if self.name == "sym":
            a = np.abs(x).max(axis=1) if x.size else np.zeros(len(x), np.float32)
            return (2 * a / levels).astype(np.float16), (-a).astype(np.float16)
        if self.name == "asym" or self.bits == 8:
            lo = x.min(axis=1) if x.size else np.zeros(len(x), np.float32)
            hi = x.max(axis=1) if x.size else np.zeros(len(x), np.float32)
            return ((hi - lo) / levels).astype(np.float16), lo.astype(np.float16)
        return rs.search(x, self.bits, self.search, self.bins, self.range_ratio,
                         threads=self.threads)

    def decode(self, arrays: dict[str, np.ndarray], dim: int,
               out: np.ndarray | None = None) -> np.ndarray:
        """Rows float32 (n, dim) from stored arrays; the uniform codecs decode straight into
        `out` where it takes them (C-contiguous float32, n*dim values: `search.decode_packed`),
        and every codec returns the rows, which are then `out` exactly when written there. Local."""
        if self.name in ("fp32", "fp16"):
            return np.asarray(arrays["values"], dtype=np.float32)
        if self.name == "kmeans":
            codes = unpack(arrays["codes"], self.bits, dim)
            cent = arrays["centroids"].astype(np.float32)
            return np.take_along_axis(cent, codes.astype(np.int64), axis=1)
        return rs.decode_packed(arrays["codes"], arrays["scale"], arrays["offset"], self.bits,
                                dim, out)

    def array_names(self) -> tuple[str, ...]:
        if self.name in ("fp32", "fp16"):
            return ("values",)
        return ("codes", "centroids") if self.name == "kmeans" else ("codes", "scale", "offset")

    def row_error_bound(self, x: np.ndarray) -> np.ndarray:
        """An upper bound on each row's L2 reconstruction error of this codec. Local.

        fp32: 0. fp16: half an ulp per value. Uniform codecs: the asymmetric codec's own error
        (adaptive never does worse; symmetric and asymmetric: half a step per value, plus float16
        rounding of the parameters). k-means: the asymmetric bound (its iterations start from the
        uniform grid and never increase the error)."""
        x = np.asarray(x, dtype=np.float32)
        dim = x.shape[1] if x.ndim == 2 else 1
        if self.name == "fp32":
            return np.zeros(len(x))
        if self.name == "fp16":
            return np.sqrt(dim) * np.maximum(np.abs(x).max(axis=1) * 2.0 ** -11, 2.0 ** -25)
        ref = self if self.name in ("sym", "asym") else Codec("asym", self.bits)
        scale, offset = ref.params(x)
        levels = (1 << self.bits) - 1
        s, o = np.abs(scale.astype(np.float64)), np.abs(offset.astype(np.float64))
        slack = levels * np.maximum(s * 2.0 ** -11, 2.0 ** -25) + np.maximum(o * 2.0 ** -11,
                                                                              2.0 ** -25)
        return np.sqrt(dim) * (s / 2 + slack) * (1 + 1e-6) + 1e-12


def check_codec(name, bits, search="refined", num_bins=0, ratio=-1.0) -> None:
    """Refuse an unknown codec or width, naming the value and the choices. Local."""
    if name not in NAMES:
        raise ValueError(f"codec must be one of {NAMES}, got {name!r}")
    if name == "fp32" and bits != 32 or name == "fp16" and bits != 16:
        raise ValueError(f"codec {name} stores {name[2:]} bits, got bits={bits!r}")
    if name in QUANT_CHOICES and bits not in WIDTHS:
        raise ValueError(f"codec {name} takes bits in {WIDTHS}, got {bits!r}")
    if name == "adaptive":
        rs.check_search(search, num_bins or rs.default_bins(bits, search),
                        rs.default_ratio(bits, search) if ratio < 0 else ratio)


def codec_for(bits: int, quant: str = "adaptive", **kw) -> Codec:
    """The codec of `--ckpt-bits bits --ckpt-quant quant`: 32 -> fp32, 16 -> fp16. Local."""
    if bits == 32:
        return Codec("fp32", 32)
    if bits == 16:
        return Codec("fp16", 16)
    return Codec(quant, bits, **kw)


def from_attrs(attrs) -> Codec:
    """The codec recorded in HDF5 attributes; ValueError naming the text when unreadable. Local."""
    text = attrs["codec"]
    text = text.decode() if isinstance(text, bytes) else str(text)
    try:
        return Codec(**json.loads(text))
    except (TypeError, ValueError) as e:
        raise ValueError(f"unreadable codec attribute {text!r}: {e}") from None


def kmeans_rows(x: np.ndarray, bits: int, iters: int = KMEANS_ITERS):
    """Per-row 1-D k-means with 2**bits centroids, from the uniform grid over [min, max]. Local.

    Returns (codes (n, D) uint8, centroids (n, 2**bits) float16); assignment uses the float16
    centroids that are stored, and an empty cluster keeps its centroid."""
    import torch

    k = 1 << bits
    xs = torch.from_numpy(x)
    lo, hi = xs.amin(1, keepdim=True), xs.amax(1, keepdim=True)
    cent = lo + (hi - lo) * torch.linspace(0, 1, k)[None, :]
    cent = cent.half().float()
    for _ in range(iters + 1):
        codes = (xs[:, :, None] - cent[:, None, :]).abs_().argmin(2)
        if _ == iters:
            break
        sums = torch.zeros_like(cent).scatter_add_(1, codes, xs)
        counts = torch.zeros_like(cent).scatter_add_(1, codes, torch.ones_like(xs))
        cent = torch.where(counts > 0, sums / counts.clamp(min=1), cent).half().float()
    return codes.to(torch.uint8).numpy(), cent.half().numpy()
