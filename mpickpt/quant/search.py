"""Fast per-row range search of the uniform codecs: Check-N-Run's greedy walk and a refinement. Local.

A row x of dimension D is stored as codes c in [0, L] (L = 2**bits - 1) with a float16 scale s and
offset o: x ~ o + s*c. For a candidate (s, o) the nearest codes give three per-row sums,
Sc = sum c, Scc = sum c*c and Sxc = sum x*c, and from them, in closed form,

- the loss of the candidate: sum (x - o - s c)^2 = Sxx - 2 o Sx - 2 s Sxc + D o^2 + 2 s o Sc + s^2 Scc;
- the least-squares (LS) polish: the best (s, o) for those codes, a per-row linear regression of x
  on c, and its loss, again in closed form.

Searches (`SEARCHES`):

- ``greedy``: Check-N-Run's walk (§4.2): from [min, max], move x_min up or x_max down by
  (max - min) / num_bins, whichever candidate has the lower loss, for num_bins * ratio steps; keep
  the best range seen. With FBGEMM's parameters (200 bins, ratio 0.16) it reproduces
  `embedding_bag_4bit_prepack`'s loss.
- ``refined`` (the default): the same walk, where both candidates of every step are also
  LS-polished at no extra pass over the data, then `polish_rounds` LS rounds from the best (a
  round whose polish does not win ends them: the next would repeat it); a row keeps the lowest
  loss seen, so it is never worse than ``greedy`` with the same bins and ratio, nor than
  [min, max]. Its default walk is shorter than the paper's (`REFINED_BINS`, `REFINED_RATIO`).

Every candidate is rounded to float16 before it is evaluated, so the loss minimised is the loss of
what is stored. Rows are centred on their mean first, so the closed forms do not cancel
catastrophically for rows far from zero (the compiled kernels accumulate in double instead).

Backends: the compiled CPU kernel `mpickpt._quant_cpu` (kernels/quant_rows_cpu.c, built by
setup.py), its CUDA twin (kernels/quant_rows.cu, `mpickpt.quant.cuda_kernels`), and a torch path
(`mpickpt.quant.search_torch`) where no compiler was available.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

SEARCHES = ("greedy", "refined")
DEFAULT_BINS = {2: 25, 3: 25, 4: 45, 8: 45}
"""The greedy walk's defaults, Check-N-Run's (§5.2): 25 bins at 2 and 3 bits, 45 at 4 bits."""
DEFAULT_RATIO = {2: 0.5, 3: 0.2, 4: 0.2, 8: 0.0}
"""The greedy walk's defaults, Check-N-Run's: 0.5 at 2 bits, 0.2 at 3 bits (0.2 at 4 bits, where
the paper gives none); plain asymmetric at 8 bits."""
REFINED_BINS = {2: 12, 3: 25, 4: 45, 8: 45}
REFINED_RATIO = {2: 0.5, 3: 0.2, 4: 0.09, 8: 0.0}
"""The refined search's walk: half the steps of the paper's at 2 bits (6 of 12 bins) and at 4 bits
(4 of 45), since both moves of every step are polished. Chosen on bench/quant_codecs.py's two
matrices, where its L2 is below that of the refined search over the paper's walk (12 and 9
steps, one polish per step) at 1.6-1.7x the speed; 3 bits keeps the paper's walk."""
FP16_MAX = 65504.0


def default_bins(bits: int, search: str = "greedy") -> int:
    """The walk's bins of `search` at `bits` where none are given. Local."""
    return (REFINED_BINS if search == "refined" else DEFAULT_BINS).get(bits, 25)


def default_ratio(bits: int, search: str = "greedy") -> float:
    """The walk's ratio (steps = bins * ratio) of `search` at `bits` where none is given. Local."""
    return (REFINED_RATIO if search == "refined" else DEFAULT_RATIO).get(bits, 0.2)


def check_search(search: str, num_bins: int, ratio: float) -> None:
    """Refuse an unknown search or out-of-range bins/ratio, naming the value. Local."""
    if search not in SEARCHES:
        raise ValueError(f"range search must be one of {SEARCHES}, got {search!r}")
    if int(num_bins) != num_bins or num_bins < 1:
        raise ValueError(f"--quant-bins must be a positive integer, got {num_bins!r}")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--quant-ratio must lie in [0, 1], got {ratio!r}")


def check_finite_range(x: np.ndarray, what: str = "rows") -> None:
    """float16 parameters need every value finite and within +-65504. Local."""
    if x.size == 0 or bool((np.abs(x) <= FP16_MAX).all()):  # one pass; NaN fails the test
        return
    bad = ~(np.abs(x) <= FP16_MAX)
    raise range_error(int(np.nonzero(bad.any(axis=-1) if x.ndim > 1 else bad)[0][0]), what)


def range_error(row: int, what: str = "rows") -> ValueError:
    """The error for a row float16 parameters cannot cover. Local."""
    return ValueError(f"{what}: row {row} holds a value that is not finite or exceeds float16's "
                      f"range (|x| > {FP16_MAX:g}); quantized checkpoints cannot store it, "
                      f"use --ckpt-bits 32")


def c_kernel():
    """The compiled CPU kernel (mpickpt._quant_cpu), or None where it was not built. Local."""
    try:
        from mpickpt import _quant_cpu
    except ImportError:
        return None
    return _quant_cpu


def search(x: np.ndarray, bits: int, search: str = "refined", num_bins: int | None = None,
           ratio: float | None = None, polish_rounds: int = 2, threads: int = 1,
           backend: str = "auto") -> tuple[np.ndarray, np.ndarray]:
    """float16 (scale, offset) per row of `x` (n, D) for the chosen search. Local.

    `backend`: "c" (the compiled kernel), "torch", or "auto" (c where built). `threads` > 1 splits
    the rows across that many threads."""
    num_bins, ratio = walk_of(bits, search, num_bins, ratio)
    kernel = c_kernel() if backend in ("auto", "c") else None
    if backend == "c" and kernel is None:
        raise RuntimeError("the CPU quantization kernel mpickpt._quant_cpu is not built "
                           "(reinstall mpickpt with a C compiler)")
    if kernel is not None:
        scale, offset, _, _ = _search_c(kernel, x, bits, search == "refined",
                                        int(num_bins * ratio), num_bins, polish_rounds, threads,
                                        packed=False)
        return scale, offset
    return _search_torch(x, bits, search, num_bins, ratio, polish_rounds, threads)


def search_encode(x: np.ndarray, bits: int, search: str = "refined", num_bins: int | None = None,
                  ratio: float | None = None, polish_rounds: int = 2, threads: int = 1,
                  what: str = "rows") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float16 (scale, offset) per row and the packed codes (n, ceil(D*bits/8)) uint8: what
    `search` then `encode_packed` give, in one pass per row through the compiled kernel where it
    is built. Refuses a row float16 cannot cover with `check_finite_range`'s error. Local."""
    num_bins, ratio = walk_of(bits, search, num_bins, ratio)
    kernel = c_kernel()
    if kernel is None:
        check_finite_range(x, what)
        scale, offset = _search_torch(x, bits, search, num_bins, ratio, polish_rounds, threads)
        return scale, offset, encode_packed(x, scale, offset, bits, threads)
    scale, offset, codes, bad = _search_c(kernel, x, bits, search == "refined",
                                          int(num_bins * ratio), num_bins, polish_rounds, threads,
                                          packed=True)
    if bad is not None:
        raise range_error(bad, what)
    return scale, offset, codes


def walk_of(bits: int, search: str, num_bins: int | None, ratio: float | None
            ) -> tuple[int, float]:
    """The walk's bins and ratio (the search's defaults for `bits` where None), checked. Local."""
    num_bins = default_bins(bits, search) if num_bins is None else num_bins
    ratio = default_ratio(bits, search) if ratio is None else ratio
    check_search(search, num_bins, ratio)
    return num_bins, ratio


C_BLOCK_ROWS = 2048


def _search_c(kernel, x, bits, refine, steps, bins, rounds, threads, packed: bool):
    """The compiled search over blocks of rows on `threads` threads: float16 scale and offset,
    the packed codes when `packed` (else None), and the first row out of float16's range (None
    when every row is in range). Local."""
    from mpickpt.quant.packing import packed_bytes

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    scale, offset = np.empty(n, np.float32), np.empty(n, np.float32)
    codes = np.empty((n, packed_bytes(d, bits)), np.uint8) if packed else None

    def run(a: int, b: int) -> int | None:
        out = (codes[a:b],) if packed else ()
        bad = kernel.search_rows(x[a:b], b - a, d, bits, int(refine), steps, bins, rounds,
                                 scale[a:b], offset[a:b], *out)
        return a + bad if bad >= 0 else None

    blocks = [(a, min(n, a + C_BLOCK_ROWS)) for a in range(0, n, C_BLOCK_ROWS)]
    if threads > 1 and len(blocks) > 1:
        with ThreadPoolExecutor(threads) as pool:
            bad = list(pool.map(lambda ab: run(*ab), blocks))
    else:
        bad = [run(0, n)] if n else []
    first_bad = min((b for b in bad if b is not None), default=None)
    return scale.astype(np.float16), offset.astype(np.float16), codes, first_bad


def _search_torch(x, bits, search, num_bins, ratio, polish_rounds, threads):
    from mpickpt.quant.search_torch import search_blocks

    return search_blocks(x, bits, search, num_bins, ratio, polish_rounds, threads)


def encode_packed(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int,
                  threads: int = 1) -> np.ndarray:
    """Packed codes (n, ceil(D*bits/8)) uint8 of rows `x`: the compiled kernel in one pass per
    row where built, else `encode_codes` + `packing.pack` (the same bytes). Local."""
    from mpickpt.quant.packing import pack, packed_bytes

    kernel = c_kernel()
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, d = x.shape
    if kernel is None:
        return pack(encode_codes(x, scale, offset, bits), bits)
    out = np.empty((n, packed_bytes(d, bits)), np.uint8)
    s, o = scale.astype(np.float32), offset.astype(np.float32)

    def run(a: int) -> None:
        b = min(n, a + C_BLOCK_ROWS)
        kernel.encode_rows(x[a:b], b - a, d, bits, s[a:b], o[a:b], out[a:b])

    if threads > 1 and n > C_BLOCK_ROWS:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, range(0, n, C_BLOCK_ROWS)))
    elif n:
        kernel.encode_rows(x, n, d, bits, s, o, out)
    return out


def encode_codes(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> np.ndarray:
    """Nearest codes (n, D) uint8 of rows `x` for float16 parameters (x*inv - o*inv, clamped,
    rounded half to even: the kernels' arithmetic). Local."""
    s = scale.astype(np.float32)[:, None]
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, np.float32(1)), np.float32(0))
    q = np.asarray(x, dtype=np.float32) * inv
    q += -offset.astype(np.float32)[:, None] * inv
    np.clip(q, 0, (1 << bits) - 1, out=q)
    return np.rint(q, out=q).astype(np.uint8)


def decode_codes(codes: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """Rows o + s*c as float32 (n, D). Local."""
    return (codes.astype(np.float32) * scale.astype(np.float32)[:, None]
            + offset.astype(np.float32)[:, None])


def decode_packed(packed: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int,
                  dim: int, out: np.ndarray | None = None) -> np.ndarray:
    """Rows o + s*c float32 (n, dim) of packed codes (n, ceil(dim*bits/8)): the compiled kernel
    in one pass where built, written into `out` when given (C-contiguous float32 of n*dim
    values: returned as (n, dim); any other array of n*dim values is filled by a copy and
    returned as it is); else `packing.unpack` + `decode_codes`. The same values either way.
    Local."""
    from mpickpt.quant.packing import packed_bytes, unpack

    n = len(packed)
    kernel = getattr(c_kernel(), "decode_rows", None)  # None too in a build that predates it
    fits = out is None or (out.dtype == np.float32 and out.flags.c_contiguous
                           and out.size == n * dim)
    if kernel is None or not fits or packed.ndim != 2 \
            or packed.shape[1] != packed_bytes(dim, bits):
        rows = decode_codes(unpack(packed, bits, dim), scale, offset)
        if out is None:
            return rows
        np.copyto(out, rows.reshape(out.shape))
        return out.reshape(n, dim) if out.flags.c_contiguous else out
    rows = np.empty((n, dim), np.float32) if out is None else out.reshape(n, dim)
    if n:
        kernel(np.ascontiguousarray(packed, dtype=np.uint8), n, dim, bits,
               np.ascontiguousarray(scale, dtype=np.float32),
               np.ascontiguousarray(offset, dtype=np.float32), rows)
    return rows


def row_loss(x: np.ndarray, scale: np.ndarray, offset: np.ndarray, bits: int) -> np.ndarray:
    """Exact squared L2 error per row of storing `x` with these parameters. Local."""
    err = decode_codes(encode_codes(x, scale, offset, bits), scale, offset) - x
    return np.einsum("ij,ij->i", err, err)
