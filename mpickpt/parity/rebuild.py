"""Rebuild of lost ranks from their group's survivors while training goes on (ECRM §3.4).

The lost rank's units (its data rows and its parity rows) are decoded stripe by stripe. Each
training step runs one round, inside the lookup (after the indices reach their owners, before
rows are pooled or updated): a lost rank asks its surviving group members for the units of (a) the
stripes of rows this step reads that are not rebuilt yet, decoded on demand (degraded reads), and
(b) the next chunk of its lost stripes, sized so that its per-stripe work takes at most
--rebuild-budget of a step's time (see `_resize`). Survivors answer with their current data rows
and parity rows; the lost rank decodes and writes its units back. With r = 1 on gloo the answers
are XOR-reduced onto the lost rank (`ReduceOp.BXOR` over the parity group), which is the decode
itself; otherwise (r >= 2, or NCCL, which has no BXOR) they all travel to the lost rank. Every
member's data and parity are consistent at that point (all folds of the previous step are in,
none of this step's), so the decoded units are exact: a chunk is locked for exactly the span of one
round, and updates of this step land after it, the synchronous form of ECRM's lock and buffer.
Lost rows are never updated before they are rebuilt (a row a step updates is read first), so
parity held by survivors stays consistent with the lost rows' true values.
"""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from mpickpt.parity.exchange import exchange_counts, exchange_rows

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
        self.cursor = 0
        self.chunk = FIRST_CHUNK_STRIPES
        self.active = True
        self.rounds = self.degraded_rows = self.received_bytes = 0
        self.seconds = 0.0
        self.fixed: float | None = None
        self.started = time.perf_counter()
        self.finished_at = None

    def remaining(self) -> int:
        return int(self.lost.sum())

    def round(self, needed_rows: torch.Tensor | None, step_seconds: float | None,
              everything: bool = False) -> None:
        """One exchange: degraded reads of `needed_rows` (local rows this step reads) and the next
        chunk. Collective over the training process group."""
        start = time.perf_counter()
        request = self._request(needed_rows, everything)
        left = int(self.mine and self.remaining() - len(request) > 0)
        st = self.store
        world = st.topo.world_size
        survivors = [st.layout.base + p for p in range(st.layout.g) if p not in self.group_failed]
        counts = [[len(request) if (self.mine and d in survivors) else 0, left]
                  for d in range(world)]
        got = exchange_counts(st.topo, st.words.device, counts)
        req = torch.as_tensor(request, dtype=torch.int64, device=st.words.device).view(-1, 1)
        asked = exchange_rows(st.topo, st.words.device,
                              [req if c[0] else req[:0] for c in counts],
                              [c[0] for c in got], 1, torch.int64)
        answers = [self._units(a.view(-1).cpu().numpy()) for a in asked]
        if st.group_pg is not None:
            self._xor_onto_lost(request, answers, got)
        else:
            replies = exchange_rows(st.topo, st.words.device, answers,
                                    [len(request) if s in survivors and self.mine else 0
                                     for s in range(world)], st.words.width, torch.int32)
            if self.mine and len(request):
                self._decode(request, {s - st.layout.base: replies[s] for s in survivors})
                self.received_bytes += len(request) * len(survivors) * st.words.width * 4
        self.rounds += 1
        self.active = any(c[1] for c in got)
        took = time.perf_counter() - start
        self.seconds += took
        self._resize(len(request), took, step_seconds)
        if not self.active and self.finished_at is None:
            self.finished_at = time.perf_counter()

    def finish(self) -> None:
        """Rebuild everything that is left now. Collective."""
        while self.active:
            self.round(None, None, everything=True)

    def _request(self, needed_rows, everything: bool) -> np.ndarray:
        """Sorted stripes this round decodes: lost ones among `needed_rows` (degraded reads)
        and the next chunk. Local."""
        if not self.mine:
            return np.empty(0, dtype=np.int64)
        L = self.store.layout
        want = np.zeros(L.stripes, dtype=bool)
        if needed_rows is not None and len(needed_rows):
            s = L.stripe_of_row(self.store.pos, needed_rows.cpu().numpy())
            s = s[self.lost[s]]
            self.degraded_rows += len(s)
            want[s] = True
        todo = np.flatnonzero(self.lost[self.cursor:]) + self.cursor
        take = todo if everything else todo[:self.chunk]
        if len(take):
            self.cursor = int(take[-1]) + 1
            want[take] = True
        return np.flatnonzero(want)

    def _xor_onto_lost(self, request: np.ndarray, answers: list[torch.Tensor], got) -> None:
        """r = 1: the lost unit of a stripe is the XOR of the survivors' units, so the group
        reduces them with BXOR onto the lost rank instead of sending them all there (the XORs run
        on the way, and the lost rank receives one unit per stripe). Collective over the parity
        group of a group that lost a rank; nothing elsewhere."""
        if not self.group_failed:
            return
        st = self.store
        lost = st.layout.base + next(iter(self.group_failed))
        n = len(request) if self.mine else got[lost][0]
        if n == 0:
            return
        units = (torch.zeros(n, st.words.width, dtype=torch.int32, device=st.words.device)
                 if self.mine else answers[lost].contiguous())
        st.topo.wait(dist.reduce(units, dst=lost, op=dist.ReduceOp.BXOR, group=st.group_pg,
                                async_op=True))
        if self.mine:
            self.lost[request] = False
            self._store_units(request, units)
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

    def _decode(self, stripes: np.ndarray, units: dict[int, torch.Tensor]) -> None:
        """Decode this rank's units of `stripes` from the survivors' `units` (by position)."""
        st, L = self.store, self.store.layout
        self.lost[stripes] = False
        if L.r == 1:
            self._store_units(stripes, st.code.recover_one(list(units.values())))
            return
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
            s = stripes[sel.cpu().numpy()]
            if st.pos in dpos:
                self._store_units(s, data[int(np.flatnonzero(dpos == st.pos)[0])])
            else:
                q = int(np.flatnonzero(ppos == st.pos)[0])
                self._store_units(s, st.code.encode(q, [data[j] for j in range(L.k)]))

    def _store_units(self, stripes: np.ndarray, units: torch.Tensor) -> None:
        """Write this rank's decoded `units` of `stripes`: data rows into the shard (padding
        dropped), parity rows into the parity store."""
        with self.store.lock:
            self._write_units(stripes, units)

    def _write_units(self, stripes: np.ndarray, units: torch.Tensor) -> None:
        st, L = self.store, self.store.layout
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
        """Chunk for the next round. A round costs a fixed part (its three exchanges, paid even
        for an empty chunk) plus a part per stripe; the fixed part is estimated as the cheapest
        round seen. While the per-stripe part stays within `budget` of a step's time the chunk
        grows 4x; otherwise it is scaled to what the budget allows at the rate just measured."""
        self.fixed = took if self.fixed is None else min(self.fixed, took)
        if not self.mine or step_seconds is None or requested == 0:
            return
        variable, allowed = took - self.fixed, self.budget * step_seconds
        if variable <= allowed:
            self.chunk = min(4 * max(self.chunk, 64), MAX_CHUNK_STRIPES)
        else:
            self.chunk = int(min(max(64, self.chunk * allowed / variable), MAX_CHUNK_STRIPES))
