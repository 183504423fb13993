"""Parity store of one rank and its upkeep by difference propagation (ECRM §3.3).

After the owner applies a step's sparse update to rows R, it sends (R, old XOR new) of their words
to each parity holder of their stripes in one all-to-all; holders fold C[q, j] * (old XOR new) into
their parity rows before the step ends. The exchange runs on a process group of its own, beside
the training data plane, in non-blocking parts of the step:

    rows_known     (in the lookup, once the indices reach their owner) routes R and posts the
                   row counts, which travel during the dense forward and backward
    before_update  gathers the old words (and posts the counts if rows_known was not called)
    after_update   XORs old and new words, waits for the counts, posts the deltas
    step_done      (after the dense allreduce) waits for the deltas and folds them

so the deltas travel during the dense gradient allreduce. A full encode is the same exchange with
old = 0, in bounded rounds. Dense state has no parity: it is replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from mpickpt.parity.layout import group_layouts
from mpickpt.parity.row_words import RowWords
from mpickpt.parity.stripe_code import StripeCode

ENCODE_ROUND_ROWS = 1 << 16


@dataclass
class _Exchange:
    """One step's delta exchange in flight."""

    pick: torch.Tensor  # rows of (rows, delta) in destination order
    send_rows: list[int]
    recv_counts: torch.Tensor
    work: object  # the count exchange, then the delta exchange
    send: torch.Tensor | None = None
    recv: torch.Tensor | None = None
    recv_rows: list[int] | None = None


class ParityStore:
    """This rank's parity rows for its group, kept current. Construction is collective the first
    time a job builds one (it creates the upkeep process group); `encode_all`, `propagate` and
    the update hooks are collective over that group."""

    def __init__(self, topo, embeddings, plan, k: int, r: int):
        """`embeddings`: the model's rows (`RowWords` reads them); `plan`: its `ShardPlan`."""
        self.topo, self.k, self.r = topo, k, r
        topo.side_group("parity")  # created here (collective), read per call after
        self._flight: _Exchange | None = None
        world = topo.world_size
        self.layouts = group_layouts(k, r, [plan.local_rows(i) for i in range(world)])
        self.layout = self.layouts[topo.rank // (k + r)]
        self.pos = topo.rank - self.layout.base
        self.words = RowWords(embeddings)
        self.lock = embeddings.state_lock
        self.code = StripeCode(k, r, self.words.device)
        self.parity = torch.zeros(self.layout.parity_rows, self.words.width, dtype=torch.int32,
                                  device=self.words.device)
        self.max_rows = max(plan.local_rows(i) for i in range(world))
        self.sent_bytes = 0
        self.last_fold = None
        """(sender positions, received block) of the last fold, for `unfold`."""
        self._own: np.ndarray | None = None
        # r = 1 rebuilds XOR-reduce the survivors' units onto the lost rank (gloo has BXOR;
        # NCCL has not, and sends them all to the lost rank instead)
        self._xor_reduce = r == 1 and topo.backend == "gloo"
        if self._xor_reduce:
            topo.part_group("parity-groups", [
                list(range(L.base, L.base + L.g)) for L in self.layouts])

    @property
    def pg(self):
        """The upkeep's side group of the current generation."""
        return self.topo.side_group("parity")

    @property
    def group_pg(self):
        """This rank's parity group's own group of the current generation (None: rebuilds send
        the units to the lost rank instead of XOR-reducing them)."""
        return self.topo.part_group("parity-groups", []) if self._xor_reduce else None

    def own_stripes(self) -> np.ndarray:
        """The stripes in which this rank holds a data row or a parity row (what its loss takes
        away), as a mask over its group's stripes: computed on the first call (`encode` makes
        it, so that a rebuild does not pay for it at the failure), then shared (read-only).
        Local."""
        if self._own is None:
            L = self.layout
            own = np.zeros(L.stripes, dtype=bool)
            own[L.stripe_of_row(self.pos, np.arange(L.rows[self.pos]))] = True
            own[L.stripe_of_parity(self.pos, np.arange(L.parity_rows))] = True
            own.flags.writeable = False
            self._own = own
        return self._own

    def nbytes(self) -> int:
        """Bytes of parity held here."""
        return self.parity.numel() * 4

    def encode_all(self) -> None:
        """Recompute every parity row from the data (after start or a restore). Collective."""
        self.parity.zero_()
        for a in range(0, self.max_rows, ENCODE_ROUND_ROWS):
            b = min(a + ENCODE_ROUND_ROWS, self.words.rows)
            rows = torch.arange(min(a, b), b, device=self.words.device)
            self.propagate(rows, self.words.gather(rows))

    def rows_known(self, rows: torch.Tensor) -> None:
        """The training lookup found the rows this step updates: post their counts now, so they
        travel during the dense forward and backward. Collective, non-blocking."""
        self._post_counts(rows)

    def before_update(self, rows: torch.Tensor) -> torch.Tensor:
        """Words of `rows` before the optimizer changes them; posts this step's row counts unless
        `rows_known` did. Collective, non-blocking."""
        if self._flight is None or self._flight.recv is not None:
            self._post_counts(rows)  # refuses an exchange whose deltas were never folded
        return self.words.gather(rows)

    def after_update(self, rows: torch.Tensor, old: torch.Tensor) -> None:
        """Posts old XOR new of the updated `rows` to their parity holders. Collective,
        non-blocking (waits only for the counts)."""
        self._post_deltas(rows, torch.bitwise_xor(old, self.words.gather(rows)))

    def step_done(self) -> None:
        """Waits for this step's deltas and folds them: parity is current again. Collective."""
        x, self._flight = self._flight, None
        if x is None:
            return
        self.topo.wait(x.work)
        if len(x.recv):
            src = np.repeat(np.arange(len(x.recv_rows)) - self.layout.base, x.recv_rows)
            with self.lock:
                self._fold(src, x.recv)
                self.last_fold = (src, x.recv)

    def unfold(self, fold) -> None:
        """Take a fold back out of the parity (a fold XORs, so folding again undoes it): the
        parity of the step before. Local."""
        src, block = fold
        with self.lock:
            self._fold(src, block)

    def abandon(self) -> None:
        """Forget an exchange a failure interrupted (nothing of it was folded). Local."""
        self._flight = None

    @torch.no_grad()
    def propagate(self, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """Send (rows, delta) to the parity holders and fold what arrives. Collective."""
        self._post_counts(rows)
        self._post_deltas(rows, delta)
        self.step_done()

    def _post_counts(self, rows: torch.Tensor) -> None:
        if self._flight is not None:
            raise RuntimeError("parity upkeep: a new exchange began before the last one was "
                               "folded (step_done was not called)")
        pick, send_rows = self._route(rows)
        send = torch.tensor(send_rows, dtype=torch.int64, device=self.words.device)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.pg, async_op=True)
        self._flight = _Exchange(pick, send_rows, recv, work, send=send)

    def _post_deltas(self, rows: torch.Tensor, delta: torch.Tensor) -> None:
        x = self._flight
        payload = torch.cat([rows.to(torch.int32).view(-1, 1), delta], dim=1)
        send = payload.index_select(0, x.pick)
        self.topo.wait(x.work)
        x.send = send
        x.recv_rows = x.recv_counts.tolist()
        x.recv = torch.empty(sum(x.recv_rows), payload.shape[1], dtype=torch.int32,
                             device=payload.device)
        x.work = dist.all_to_all_single(x.recv, x.send, x.recv_rows, x.send_rows, group=self.pg,
                                        async_op=True)
        self.sent_bytes += x.send.numel() * 4

    def _route(self, rows: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Order of `rows` (each once per parity unit, r in all) by destination rank, and the
        number of rows for each rank. Local."""
        L, world = self.layout, self.topo.world_size
        local = rows.cpu().numpy()
        holders = L.parity_positions(L.stripe_of_row(self.pos, local) % L.g)  # (n, r)
        dest = holders.T.reshape(-1) + L.base  # q-major: all rows for q=0, then q=1, ...
        order = np.argsort(dest, kind="stable")
        pick = torch.as_tensor(np.tile(np.arange(len(local)), self.r)[order],
                               device=rows.device)
        return pick, np.bincount(dest, minlength=world).tolist()

    def _fold(self, src_pos: np.ndarray, block: torch.Tensor) -> None:
        """Fold received (row, delta) `block`s; `src_pos`: the sender's group position per row."""
        L = self.layout
        if ((src_pos < 0) | (src_pos >= L.g)).any():
            raise RuntimeError(f"rank {self.topo.rank} got parity deltas from outside its group "
                               f"(positions {sorted(set(src_pos.tolist()))})")
        rows = block[:, 0].cpu().numpy().astype(np.int64)
        stripes = L.stripe_of_row(src_pos, rows)
        q = L.role(self.pos, stripes)
        if (q < 0).any():
            raise RuntimeError(f"rank {self.topo.rank} got parity deltas for stripes it does not "
                               f"hold (from group positions {sorted(set(src_pos[q < 0].tolist()))})")
        prow = torch.as_tensor(L.parity_row(self.pos, stripes), device=block.device)
        coef = self.code.matrix[q, L.data_index(src_pos, rows)]
        self.code.fold(self.parity, prow, torch.as_tensor(coef), block[:, 1:])
