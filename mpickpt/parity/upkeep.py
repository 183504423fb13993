"""Parity store of one rank and its upkeep by difference propagation (ECRM §3.3).

After the owner applies a step's sparse update to rows R, it sends (R, old XOR new) of their words
to each parity holder of their stripes in one all-to-all; holders fold C[q, j] * (old XOR new) into
their parity rows before the step ends. A full encode is the same exchange with old = 0, in
bounded rounds. Dense state has no parity: it is replicated.
"""
from __future__ import annotations

import numpy as np
import torch

from mpickpt.parity.exchange import exchange_counts, exchange_rows
from mpickpt.parity.layout import group_layouts
from mpickpt.parity.row_words import RowWords
from mpickpt.parity.stripe_code import StripeCode

ENCODE_ROUND_ROWS = 1 << 16


class ParityStore:
    """This rank's parity rows for its group, kept current. Construction is local;
    `encode_all` and `propagate` are collective over the training process group."""

    def __init__(self, topo, embeddings, k: int, r: int):
        self.topo, self.k, self.r = topo, k, r
        plan = embeddings.plan
        world = topo.world_size
        self.layouts = group_layouts(k, r, [plan.local_rows(i) for i in range(world)])
        self.layout = self.layouts[topo.rank // (k + r)]
        self.pos = topo.rank - self.layout.base
        self.words = RowWords(embeddings)
        self.code = StripeCode(k, r, self.words.device)
        self.parity = torch.zeros(self.layout.parity_rows, self.words.width, dtype=torch.int32,
                                  device=self.words.device)
        self.max_rows = max(plan.local_rows(i) for i in range(world))
        self.sent_bytes = 0

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

    def before_update(self, rows: torch.Tensor) -> torch.Tensor:
        """Words of `rows` before the optimizer changes them. Local."""
        return self.words.gather(rows)

    def after_update(self, rows: torch.Tensor, old: torch.Tensor) -> None:
        """Propagate old XOR new of the updated `rows`. Collective."""
        self.propagate(rows, torch.bitwise_xor(old, self.words.gather(rows)))

    @torch.no_grad()
    def propagate(self, rows: torch.Tensor, delta: torch.Tensor) -> None:
        """Send (rows, delta) to the parity holders and fold what arrives. Collective."""
        blocks = self._outgoing(rows, delta)
        counts = exchange_counts(self.topo.pg, self.words.device, [[len(b)] for b in blocks])
        width = 1 + self.words.width
        got = exchange_rows(self.topo.pg, self.words.device, blocks, [c[0] for c in counts],
                            width, torch.int32)
        self.sent_bytes += sum(len(b) for b in blocks) * width * 4
        for src, block in enumerate(got):
            if len(block):
                self._fold_from(src - self.layout.base, block)

    def _outgoing(self, rows: torch.Tensor, delta: torch.Tensor) -> list[torch.Tensor]:
        L, world = self.layout, self.topo.world_size
        blocks = [torch.empty(0, 1 + self.words.width, dtype=torch.int32,
                              device=self.words.device) for _ in range(world)]
        if len(rows) == 0:
            return blocks
        local = rows.cpu().numpy()
        holders = L.parity_positions(L.stripe_of_row(self.pos, local) % L.g)  # (n, r)
        payload = torch.cat([rows.to(torch.int32).view(-1, 1), delta], dim=1)
        for q in range(self.r):
            dest = holders[:, q] + L.base
            for d in np.unique(dest):
                pick = torch.as_tensor(np.nonzero(dest == d)[0], device=payload.device)
                blocks[d] = torch.cat([blocks[d], payload[pick]])
        return blocks

    def _fold_from(self, src_pos: int, block: torch.Tensor) -> None:
        L = self.layout
        rows = block[:, 0].cpu().numpy().astype(np.int64)
        stripes = L.stripe_of_row(src_pos, rows)
        q = L.role(self.pos, stripes)
        if (q < 0).any():
            raise RuntimeError(f"rank {self.topo.rank} got parity deltas for stripes it does not "
                               f"hold from group position {src_pos}")
        prow = torch.as_tensor(L.parity_row(self.pos, stripes), device=block.device)
        coef = self.code.matrix[q, L.data_index(src_pos, rows)]
        self.code.fold(self.parity, prow, torch.as_tensor(coef), block[:, 1:])
