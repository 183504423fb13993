"""The torch path of `mpickpt.quant.search` (used where the compiled CPU kernel is not built).

Same algorithm and float16 rounding as the kernels; see `mpickpt.quant.search` for the
specification. Blocks of `SUB_ROWS` rows are held transposed (D, n), so per-row parameters
broadcast along contiguous memory. Local.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

SUB_ROWS = 16384


def _h(t: torch.Tensor) -> torch.Tensor:
    """Round to float16 and back (what a stored parameter will be)."""
    return t.to(torch.float16).to(torch.float32)


class _Rows:
    """One transposed block of rows, centred, with its per-row sums. Codes are computed in
    float32 like the kernels'; the sums and closed-form losses accumulate in float64 like the
    kernels', since a loss far below the row's energy cancels catastrophically in float32 and the
    search would keep the wrong candidate. Local."""

    def __init__(self, xt: torch.Tensor, bits: int):
        self.levels = float((1 << bits) - 1)
        self.dim = xt.shape[0]
        self.mean = xt.mean(0)
        self.x = xt - self.mean
        self.xd = self.x.double()
        self.sx = self.xd.sum(0)
        self.sxx = torch.linalg.vecdot(self.xd, self.xd, dim=0)
        self.buf = torch.empty_like(self.x)

    def codes(self, s16: torch.Tensor, o16: torch.Tensor) -> torch.Tensor:
        """Nearest codes (in a shared buffer) for float16-valued parameters. Local."""
        inv = torch.where(s16 > 0, 1.0 / torch.where(s16 > 0, s16, 1.0), 0.0)
        oc = o16 - self.mean  # the stored offset, in centred coordinates
        torch.addcmul(-oc * inv, self.x, inv, out=self.buf)
        return self.buf.round_().clamp_(0.0, self.levels)

    def sums(self, s16, o16):
        c = self.codes(s16, o16).double()
        return c.sum(0), torch.linalg.vecdot(c, c, dim=0), torch.linalg.vecdot(self.xd, c, dim=0)

    def loss(self, s16, o16, sc, scc, sxc) -> torch.Tensor:
        o, s = o16.double() - self.mean.double(), s16.double()
        d = float(self.dim)
        return (self.sxx - 2 * o * self.sx - 2 * s * sxc + d * o * o + 2 * s * o * sc
                + s * s * scc).clamp_(min=0.0)

    def polish(self, sc, scc, sxc) -> tuple[torch.Tensor, torch.Tensor]:
        """float16 LS (scale, offset) for codes with these sums. Local."""
        d = float(self.dim)
        var = scc - sc * sc / d
        cov = sxc - sc * self.sx / d
        s = torch.where(var > 0, cov / torch.where(var > 0, var, 1.0), 0.0).clamp_(min=0.0)
        return _h(s.float()), _h(((self.sx - s * sc) / d + self.mean.double()).float())


class _Best:
    """Lowest loss per row seen so far, with its parameters. Local."""

    def __init__(self, loss, s16, o16):
        self.loss, self.s, self.o = loss, s16, o16

    def offer(self, loss, s16, o16) -> None:
        better = loss < self.loss
        self.loss = torch.where(better, loss, self.loss)
        self.s = torch.where(better, s16, self.s)
        self.o = torch.where(better, o16, self.o)


def range_params(lo: torch.Tensor, hi: torch.Tensor, levels: float):
    """float16-valued (scale, offset) mapping [lo, hi] onto [0, levels]. Local."""
    return _h((hi - lo) / levels), _h(lo)


def _search_block(xt: torch.Tensor, bits: int, search: str, num_bins: int, ratio: float,
                  polish_rounds: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = _Rows(xt, bits)
    lo, hi = xt.amin(0), xt.amax(0)
    s, o = range_params(lo, hi, rows.levels)
    best = _Best(rows.loss(s, o, *rows.sums(s, o)), s, o)
    refine = search == "refined"
    step = (hi - lo) / num_bins
    for _ in range(int(num_bins * ratio)):
        walk, sums = [], []
        for nlo, nhi in ((lo + step, hi), (lo, hi - step)):
            s, o = range_params(nlo, nhi, rows.levels)
            sums.append(rows.sums(s, o))
            walk.append(rows.loss(s, o, *sums[-1]))
            best.offer(walk[-1], s, o)
        up = walk[0] < walk[1]
        for candidate in sums if refine else ():  # polish both moves, up first
            ps, po = rows.polish(*candidate)
            best.offer(rows.loss(ps, po, *candidate), ps, po)
        lo, hi = torch.where(up, lo + step, lo), torch.where(up, hi, hi - step)
    for _ in range(polish_rounds if refine else 0):
        sums = rows.sums(best.s, best.o)
        ps, po = rows.polish(*sums)
        best.offer(rows.loss(ps, po, *sums), ps, po)
    return best.s, best.o


def search_blocks(x, bits, search, num_bins, ratio, polish_rounds, threads):
    n = x.shape[0]
    scale, offset = np.empty(n, np.float16), np.empty(n, np.float16)
    xs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))

    def run(a: int) -> None:
        b = min(n, a + SUB_ROWS)
        s, o = _search_block(xs[a:b].t().contiguous(), bits, search, num_bins, ratio,
                             polish_rounds)
        scale[a:b], offset[a:b] = s.to(torch.float16).numpy(), o.to(torch.float16).numpy()

    starts = range(0, n, SUB_ROWS)
    with single_threaded_ops(threads):
        if threads > 1 and n > SUB_ROWS:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(run, starts))
        else:
            for a in starts:
                run(a)
    return scale, offset


class single_threaded_ops:
    """Within the block, torch ops run single-threaded when Python threads split the work."""

    def __init__(self, threads: int):
        self.threads, self.saved = threads, None

    def __enter__(self):
        if self.threads > 1:
            self.saved = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.set_num_threads(self.saved)


