"""Rebuild of lost ranks from their group's survivors while training goes on (ECRM §3.4).

The lost rank's units (its data rows and its parity rows) are decoded stripe by stripe. Each
training step runs one round, inside the lookup (after the indices reach their owners, before
rows are pooled or updated). A round serves (a) degraded reads: the lost stripes of rows this step
reads, decoded at once from the survivors' current units, and (b) the next chunk of the sweep over
the lost stripes, whole periods of g stripes. Every member's units of a chunk of periods [p0, p1)
are consecutive rows of its shard and parity store, taken and written back by slices
(`periods.py`), so a chunk travels as its two ends; only degraded reads travel as stripe numbers.
Every member's data and parity are consistent in a round (all folds of the previous step are in,
none of this step's), so what is decoded from them is exact. Lost rows are never updated before
they are rebuilt (a row a step updates is read first), so parity held by survivors stays
consistent with the lost rows' true values.

- r = 1 on gloo: the answers are XOR-reduced onto the lost rank (`ReduceOp.BXOR` over the parity
  group), which is the decode itself. The chunk is a piece in flight beside training
  (`pieces.py`): taken in one round, reduced by gloo's threads while steps go on, landed in a
  later round; it holds what a survivor copies (and the lost rank lands) in --rebuild-budget of a
  step's time.
- otherwise (r >= 2, or NCCL, which has no BXOR) every survivor's units travel to the lost rank
  and are decoded there within the round: the synchronous form of ECRM's lock and buffer, with
  the chunk sized by the round's fitted cost per stripe (`_resize`).
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from mpickpt.parity.exchange import exchange_counts, exchange_rows
from mpickpt.parity.periods import read_periods, write_periods
from mpickpt.parity.pieces import PieceFlight

FIRST_CHUNK_STRIPES = 4096
MAX_CHUNK_STRIPES = 1 << 22


class Rebuild:
    """One rebuild of the failed ranks `failed` (a set of world ranks, at most r per group).

    Every rank holds one; `round` and `finish` are collective until `active` is False."""

    def __init__(self, store, failed: set[int], budget: float):
        self.store, self.failed, self.budget = store, set(failed), budget
        L, me = store.layout, store.topo.rank
        self.mine = me in self.failed
        self.group_failed = {f - L.base for f in self.failed if L.base <= f < L.base + L.g}
        self.lost = np.zeros(L.stripes, dtype=bool)
        if self.mine:
            self.lost[L.stripe_of_row(store.pos, np.arange(L.rows[store.pos]))] = True
            self.lost[L.stripe_of_parity(store.pos, np.arange(L.parity_rows))] = True
        self.total = int(self.lost.sum())
        self.flight = None
        """The pieces in flight beside training (r = 1 on gloo, in a group that lost a rank)."""
        if store.group_pg is not None and self.group_failed:
            self.flight = PieceFlight(store, next(iter(self.group_failed)), self.mine)
        self.cursor = 0
        self.chunk = FIRST_CHUNK_STRIPES
        self.peers_ns = 0  # the survivors' last piece work, ns per stripe
        self.active = True
        self.rounds = self.degraded_rows = self.received_bytes = 0
        self.seconds = 0.0
        self.sizes: list[tuple[int, float]] = []  # (stripes, seconds) of this rank's rounds
        self.started = time.perf_counter()
        self.finished_at = None

    def remaining(self) -> int:
        return int(self.lost.sum())

    def round(self, needed_rows: torch.Tensor | None, step_seconds: float | None,
              everything: bool = False) -> None:
        """One exchange: degraded reads of `needed_rows` (local rows this step reads) and the next
        chunk (`everything`: all that is left, landed before returning). Collective over the
        training process group."""
        start = time.perf_counter()
        st = self.store
        if self.flight is not None:
            self.flight.land(self.lost, wait=everything)
            if self.mine and step_seconds is not None and self.chunk > 0:
                self.chunk = self._piece_stripes(step_seconds)
        degraded, (p0, p1) = self._request(needed_rows, everything)
        world = st.topo.world_size
        survivors = [st.layout.base + p for p in range(st.layout.g) if p not in self.group_failed]
        left = self._left(p0, p1, everything)
        cost = self.flight.cost_ns if self.flight is not None else 0
        counts = [[len(degraded), p0, p1, left, cost] if (self.mine and d in survivors)
                  else [0, 0, 0, left, cost] for d in range(world)]
        got = exchange_counts(st.topo, st.words.device, counts)
        self.peers_ns = max(got[s][4] for s in survivors)
        req = torch.as_tensor(degraded, dtype=torch.int64, device=st.words.device).view(-1, 1)
        asked = exchange_rows(st.topo, st.words.device,
                              [req if c[0] else req[:0] for c in counts],
                              [c[0] for c in got], 1, torch.int64)
        if self.flight is not None:
            self._in_flight(degraded, (p0, p1), asked, got, everything)
        else:
            self._in_round(degraded, (p0, p1), asked, got, survivors)
        self.rounds += 1
        self.active = any(c[3] for c in got)
        if not self.active and self.flight is not None:
            self.flight.land(self.lost, wait=True)  # a survivor's sends of the last piece
        took = time.perf_counter() - start
        self.seconds += took
        if self.flight is None:
            self._resize(len(degraded) + (p1 - p0) * st.layout.g, took, step_seconds)
        if not self.active and self.finished_at is None:
            self.finished_at = time.perf_counter()

    def finish(self) -> None:
        """Rebuild everything that is left now. Collective."""
        while self.active:
            self.round(None, None, everything=True)

    def _left(self, p0: int, p1: int, everything: bool) -> int:
        """1 while this rank has stripes to rebuild after this round. Local."""
        if not self.mine:
            return 0
        posted = self.flight is not None and not everything and \
            (p1 > p0 or self.flight.piece is not None)
        return int(p1 < self.store.layout.periods or posted)

    def _in_round(self, degraded, chunk, asked, got, survivors) -> None:
        """Degraded reads and the chunk, answered and decoded within this round."""
        st = self.store
        p0, p1 = chunk
        request = np.concatenate([degraded, np.arange(p0 * st.layout.g, p1 * st.layout.g,
                                                      dtype=np.int64)])
        answers = [self._answer(a.view(-1).cpu().numpy(), c[1], c[2]) for a, c in zip(asked, got)]
        if st.group_pg is not None:
            self._xor_onto_lost(request, answers, got, len(degraded))
            return
        replies = exchange_rows(st.topo, st.words.device, answers,
                                [len(request) if s in survivors and self.mine else 0
                                 for s in range(st.topo.world_size)], st.words.width, torch.int32)
        if self.mine and len(request):
            self._decode(request, {s - st.layout.base: replies[s] for s in survivors},
                         len(degraded))
            self.received_bytes += len(request) * len(survivors) * st.words.width * 4

    def _in_flight(self, degraded, chunk, asked, got, everything: bool) -> None:
        """Degraded reads XOR-reduced within this round; the chunk posted as a piece that lands
        in a later round (`pieces.py`), or at once with `everything`."""
        answers = [self._units(a.view(-1).cpu().numpy()) for a in asked]
        self._xor_onto_lost(degraded, answers, got, len(degraded))
        p0, p1 = chunk if self.mine else got[self.flight.lost_rank][1:3]
        self.flight.post(p0, p1)
        if everything:
            self.flight.land(self.lost, wait=True)
        if self.mine:
            self.received_bytes += (p1 - p0) * self.store.layout.g * self.store.words.width * 4

    def _request(self, needed_rows, everything: bool) -> tuple[np.ndarray, tuple[int, int]]:
        """What this round decodes: the sorted lost stripes among `needed_rows` (degraded reads;
        outside the chunk when it is decoded in this round), and the chunk, the periods [p0, p1)
        from the cursor on (none while a piece is in flight). Local."""
        L = self.store.layout
        if not self.mine:
            return np.empty(0, dtype=np.int64), (0, 0)
        p0 = self.cursor
        step = max(1, self.chunk // L.g) if self.chunk > 0 else 0  # chunk 0: degraded reads only
        if self.flight is not None and self.flight.piece is not None and not everything:
            step = 0
        p1 = L.periods if everything else min(L.periods, p0 + step)
        self.cursor = p1
        degraded = np.empty(0, dtype=np.int64)
        if needed_rows is not None and len(needed_rows):
            s = np.unique(L.stripe_of_row(self.store.pos, needed_rows.cpu().numpy()))
            s = s[self.lost[s]]
            if self.flight is None:
                s = s[(s < p0 * L.g) | (s >= p1 * L.g)]
            self.degraded_rows += len(s)
            degraded = s
        return degraded, (p0, p1)

    def _xor_onto_lost(self, request: np.ndarray, answers: list[torch.Tensor], got,
                       degraded: int) -> None:
        """r = 1: the lost unit of a stripe is the XOR of the survivors' units, so the group
        reduces them with BXOR onto the lost rank instead of sending them all there (the XORs run
        on the way, and the lost rank receives one unit per stripe). `request`: the degraded
        reads, then (decoded in this round) whole periods. Collective over the parity group of a
        group that lost a rank; nothing elsewhere."""
        if not self.group_failed:
            return
        st = self.store
        lost = st.layout.base + next(iter(self.group_failed))
        asked = got[lost]  # [degraded, p0, p1, left, cost] from the lost rank
        whole = 0 if self.flight is not None else (asked[2] - asked[1]) * st.layout.g
        n = len(request) if self.mine else asked[0] + whole
        if n == 0:
            return
        units = (torch.zeros(n, st.words.width, dtype=torch.int32, device=st.words.device)
                 if self.mine else answers[lost].contiguous())
        st.topo.wait(dist.reduce(units, dst=lost, op=dist.ReduceOp.BXOR, group=st.group_pg,
                                async_op=True))
        if self.mine:
            self._store_units(request, units, degraded)
            self.received_bytes += n * st.words.width * 4

    def _units(self, stripes: np.ndarray) -> torch.Tensor:
        """This member's units (data row or parity row; zeros for padding) of `stripes`."""
        st, L = self.store, self.store.layout
        dev = st.words.device
        out = torch.zeros(len(stripes), st.words.width, dtype=torch.int32, device=dev)
        if len(stripes) == 0:
            return out
        rows = L.row_of_stripe(st.pos, stripes)
        data = np.flatnonzero(rows >= 0)
        out.index_copy_(0, torch.as_tensor(data, device=dev),
                        st.words.gather(torch.as_tensor(rows[data], device=dev)))
        prow = L.parity_row(st.pos, stripes)
        par = np.flatnonzero(prow >= 0)
        out.index_copy_(0, torch.as_tensor(par, device=dev),
                        st.parity.index_select(0, torch.as_tensor(prow[par], device=dev)))
        return out

    def _answer(self, stripes: np.ndarray, p0: int, p1: int) -> torch.Tensor:
        """This member's units of `stripes` (degraded reads, by index), then of the stripes of
        periods [p0, p1) in stripe order, copied from its data rows [p0 k, p1 k) and parity rows
        [p0 r, p1 r) by strided slices straight into place (zeros for padding). Local."""
        st = self.store
        n, w = len(stripes), st.words.width
        out = torch.empty(n + (p1 - p0) * st.layout.g, w, dtype=torch.int32,
                          device=st.words.device)
        out[:n] = self._units(stripes)
        read_periods(st, p0, out[n:].view(p1 - p0, st.layout.g, w))
        return out

    def _write_range(self, p0: int, p1: int, units: torch.Tensor) -> None:
        """Write this rank's decoded units of periods [p0, p1) (stripe order) back: the inverse of
        `_answer`'s range part, padding dropped. Local."""
        st = self.store
        write_periods(st, p0, units.view(p1 - p0, st.layout.g, st.words.width))

    def _decode(self, stripes: np.ndarray, units: dict[int, torch.Tensor],
                degraded: int) -> None:
        """Decode this rank's units of `stripes` (the first `degraded` of them the degraded reads,
        then whole periods) from the survivors' `units` (by position)."""
        st, L = self.store, self.store.layout
        if L.r == 1:
            self._store_units(stripes, st.code.recover_one(list(units.values())), degraded)
            return
        decoded = torch.empty(len(stripes), st.words.width, dtype=torch.int32,
                              device=st.words.device)
        offsets = stripes % L.g
        for o in np.unique(offsets):
            sel = torch.as_tensor(np.flatnonzero(offsets == o), device=st.words.device)
            dpos = L.data_positions(int(o))
            ppos = L.parity_positions(int(o))
            data = {j: units[int(p)].index_select(0, sel) for j, p in enumerate(dpos)
                    if int(p) not in self.group_failed}
            parity = {q: units[int(p)].index_select(0, sel) for q, p in enumerate(ppos)
                      if int(p) not in self.group_failed}
            erased = [j for j, p in enumerate(dpos) if int(p) in self.group_failed]
            data.update(st.code.decode(data, parity, erased))
            if st.pos in dpos:
                mine = data[int(np.flatnonzero(dpos == st.pos)[0])]
            else:
                q = int(np.flatnonzero(ppos == st.pos)[0])
                mine = st.code.encode(q, [data[j] for j in range(L.k)])
            decoded.index_copy_(0, sel, mine)
        self._store_units(stripes, decoded, degraded)

    def _store_units(self, stripes: np.ndarray, units: torch.Tensor, degraded: int) -> None:
        """Write this rank's decoded `units` of `stripes` (the first `degraded` of them by index,
        the rest whole periods, by slices): data rows into the shard (padding dropped), parity rows
        into the parity store; they are lost no more."""
        g = self.store.layout.g
        with self.store.lock:
            self._write_units(stripes[:degraded], units[:degraded])
            if len(stripes) > degraded:
                self._write_range(int(stripes[degraded]) // g, int(stripes[-1]) // g + 1,
                                  units[degraded:])
        self.lost[stripes] = False

    def _write_units(self, stripes: np.ndarray, units: torch.Tensor) -> None:
        st, L = self.store, self.store.layout
        if len(stripes) == 0:
            return
        dev = st.words.device
        rows = L.row_of_stripe(st.pos, stripes)
        keep = np.flatnonzero(rows >= 0)
        if len(keep):
            st.words.scatter(torch.as_tensor(rows[keep], device=dev),
                             units.index_select(0, torch.as_tensor(keep, device=dev)))
        prow = L.parity_row(st.pos, stripes)
        par = np.flatnonzero(prow >= 0)
        if len(par):
            st.parity.index_copy_(0, torch.as_tensor(prow[par], device=dev),
                                  units.index_select(0, torch.as_tensor(par, device=dev)))

    def _resize(self, requested: int, took: float, step_seconds: float | None) -> None:
        """Chunk for the next round. A round costs a fixed part (its exchanges, paid even for an
        empty chunk) plus a part per stripe: the slope of a least-squares line through the rounds'
        (stripes, seconds); until two rounds of different sizes give one, the chunk grows 4x.
        The next chunk is what `budget` of a step's time buys at that slope, at most 8x the last
        and at least 64 stripes."""
        if not self.mine or step_seconds is None or requested == 0:
            return
        self.sizes.append((requested, took))
        slope = _slope(self.sizes)
        if slope is None or slope <= 0:
            self.chunk = min(4 * max(self.chunk, 64), MAX_CHUNK_STRIPES)
            return
        target = self.budget * step_seconds / slope
        self.chunk = int(min(max(64, target), 8 * max(self.chunk, 64), MAX_CHUNK_STRIPES))


    def _piece_stripes(self, step_seconds: float) -> int:
        """Stripes of the next piece: what `budget` of a step's time buys at this rank's
        foreground cost per stripe (a survivor copies its units, the lost rank lands them; the
        reduce between runs in gloo's threads). Local."""
        per = self.flight.seconds_per_stripe(self.peers_ns)
        return int(min(max(64, self.budget * step_seconds / per), MAX_CHUNK_STRIPES))


def _slope(points: list[tuple[int, float]]) -> float | None:
    """Seconds per stripe: the least-squares slope of seconds on stripes, or None while the
    stripes do not vary."""
    n = np.array([p[0] for p in points], dtype=np.float64)
    t = np.array([p[1] for p in points], dtype=np.float64)
    if len(points) < 2 or np.ptp(n) == 0:
        return None
    n0 = n - n.mean()
    return float((n0 * (t - t.mean())).sum() / (n0 * n0).sum())
