"""The bulk of a rebuild in flight beside training: pieces of whole periods (ECRM §3.4).

With r = 1 on gloo a lost unit is the XOR of its stripe's surviving units, and the group's own
process group reduces them with BXOR onto the lost rank. A piece of periods [p0, p1) is taken in
one round, when every member's data and parity are consistent (all folds of the previous step in,
none of this step's): each survivor copies its units of those periods by slices and the reduce is
posted without waiting, so gloo's worker threads move and XOR the bytes while training goes on.
The lost rank zeroes its parity rows of the piece when it is taken: the folds of later steps
accumulate there. It lands the piece in a later round, once the reduce is complete:

- data rows still lost are written: a lost row is not updated before it is rebuilt, so its value
  when the piece was taken is its value now. Rows a degraded read rebuilt meanwhile are current
  and kept.
- the decoded parity (as it was when the piece was taken) is XORed into the parity rows: with the
  folds since, that is the parity now, since folds are XORs.

One piece is in flight at a time, so the group's second gloo worker thread stays free for the
degraded reads, which travel synchronously in the rounds.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mpickpt.parity.periods import read_periods, write_periods, zero_parity

CALIBRATE_PERIODS = 8192


@dataclass
class Piece:
    """Periods [p0, p1) in flight: this member's units (the reduce's buffer) and the reduce."""

    p0: int
    p1: int
    units: torch.Tensor
    work: object


class PieceFlight:
    """The pieces of one rebuild on one member of a group that lost a rank (r = 1, gloo).
    `post` is collective over the parity group; `land` is local."""

    def __init__(self, store, lost_pos: int, mine: bool):
        self.store, self.mine = store, mine
        self.lost_rank = store.layout.base + lost_pos
        self.piece: Piece | None = None
        self.landed_stripes = 0
        self.land_seconds = 0.0
        self.cost_ns = 0
        """Nanoseconds per stripe of this member's last piece work (a survivor's copy, the lost
        rank's landing), 0 before any: what the lost rank sizes pieces by."""

    def post(self, p0: int, p1: int) -> None:
        """Take periods [p0, p1) now and start reducing them onto the lost rank. Collective over
        the parity group (every member posts the same periods in the same round)."""
        if p1 <= p0:
            return
        start = time.perf_counter()
        st, g = self.store, self.store.layout.g
        shape = (p1 - p0, g, st.words.width)
        if self.mine:
            units = torch.zeros(shape, dtype=torch.int32, device=st.words.device)
            with st.lock:
                zero_parity(st, p0, p1)
        else:
            units = torch.empty(shape, dtype=torch.int32, device=st.words.device)
            read_periods(st, p0, units)
            self._cost(time.perf_counter() - start, (p1 - p0) * g)
        work = dist.reduce(units.view(-1, st.words.width), dst=self.lost_rank,
                           op=dist.ReduceOp.BXOR, group=st.group_pg, async_op=True)
        self.piece = Piece(p0, p1, units, work)

    def land(self, lost: np.ndarray, wait: bool) -> int:
        """Land the piece in flight if its reduce is complete (`wait`: wait for it): on the lost
        rank, write its units as the module says and clear their stripes in `lost`; elsewhere
        only forget it. Returns the stripes landed here. Local."""
        x = self.piece
        if x is None or not (wait or x.work.is_completed()):
            return 0
        self.store.topo.wait(x.work)
        self.piece = None
        if not self.mine:
            return 0
        start = time.perf_counter()
        g, L = self.store.layout.g, self.store.layout
        stripes = np.arange(x.p0 * g, x.p1 * g)
        rows = L.row_of_stripe(self.store.pos, stripes[~lost[stripes]])
        self._write(x, torch.as_tensor(rows[rows >= 0], device=x.units.device))
        lost[stripes] = False
        self._cost(time.perf_counter() - start, len(stripes))
        return len(stripes)

    def _cost(self, seconds: float, stripes: int) -> None:
        self.land_seconds += seconds
        self.landed_stripes += stripes
        self.cost_ns = int(1e9 * seconds / max(stripes, 1))

    def _write(self, x: Piece, current: torch.Tensor) -> None:
        """Write the piece's units back, keeping the `current` rows as they are now."""
        st = self.store
        with st.lock:
            kept = st.words.gather(current) if len(current) else None
            write_periods(st, x.p0, x.units, xor_parity=True)
            if kept is not None:
                st.words.scatter(current, kept)

    def seconds_per_stripe(self, peers_ns: int = 0) -> float:
        """The foreground cost of a stripe: the larger of this member's measured piece work and
        its peers' (`peers_ns`, reported in the rounds), else a timed copy of its own rows into a
        fresh buffer (a survivor's copy costs about what a landing does). Local."""
        if self.landed_stripes or peers_ns:
            return max(self.cost_ns, peers_ns) / 1e9
        st = self.store
        n = min(CALIBRATE_PERIODS, st.layout.periods)
        start = time.perf_counter()
        scratch = torch.empty(n, st.layout.g, st.words.width, dtype=torch.int32,
                              device=st.words.device)
        read_periods(st, 0, scratch)
        return max(time.perf_counter() - start, 1e-6) / max(n * st.layout.g, 1)
