"""The pending rows of one copy-on-update snapshot and the copies that clear them, where the rows
live: `HostPendingRows` for CPU tables (a host mask, torch copies, done when the call returns)
and `DevicePendingRows` for CUDA tables (a device mask, kernels/pending_rows.cu enqueued on the
training stream, so every copy lands in stream order before the update that follows it; `drain`
waits for them). `CopyOnUpdate` owns one and serializes the calls (its locks). Local.

Both offer: `arm(rows, selected)` (make rows pending; on the training thread, in the stall),
`copy_listed(sources, targets, rows)` (the pending ones among a step's updated rows, before the
update), `drain()` (every copy so far is in the targets), `done()` (after the last chunk),
`hooked()` (rows the update hook copied in this snapshot). The copier's chunks differ:
`DevicePendingRows.copy_chunk(sources, targets, a, b)` enqueues the pending rows of a..b-1 (the
caller holds the state lock, so no update is enqueued between); `HostPendingRows` copies a chunk
beside the updates (`beside_updates`): `begin_chunk(a, b)` (under the caller's mask lock),
`read_chunk(sources, targets)` (no lock: rows may change meanwhile), `end_chunk(targets)` (under
the mask lock: rows the hook took during the chunk get back the values it copied, the chunk is
pending no more).
"""
from __future__ import annotations

import torch


class HostPendingRows:
    """A pending mask on the host; copies by torch on the calling thread (they release the GIL).
    The copier reads a chunk while updates go on, so that a step never waits for it: the update
    hook's copy of a row is the row's value at the snapshot (its first update since then has not
    begun), and where the copier's read of the same chunk may have seen the update, the chunk's
    end puts the hook's value back. A row the hook has not taken by the chunk's end was not
    being updated while the copier read it (an update begins after its hook). Local."""

    beside_updates = True

    def __init__(self):
        self._mask: torch.Tensor | None = None
        """Reused by every snapshot of the same row count."""
        self._full = False
        """The mask is all True already: `done` refilled it for the next full snapshot."""
        self._hooked = 0
        self._chunk: tuple[int, int, torch.Tensor | None] | None = None
        """(a, b, the chunk's pending rows when it began, None: all of a..b-1) of the chunk
        the copier is reading (set and cleared under the mask lock)."""
        self._taken: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        """(rows, their values by source) the hook copied inside the chunk being read."""

    @property
    def rows(self) -> int:
        return len(self._mask)

    def arm(self, rows: int, selected) -> None:
        """Make `selected` (sorted local rows; None: all) pending. A memset of a reused buffer:
        a fresh 4 MB mask took 1-34 ms under the writers' memory traffic."""
        if self._mask is None or len(self._mask) != rows:
            self._mask, self._full = torch.empty(rows, dtype=torch.bool), False
        full, self._full, self._hooked = self._full, False, 0
        self._chunk, self._taken = None, []
        if selected is None:
            if not full:
                self._mask.fill_(True)
        else:
            self._mask.zero_()
            self._mask[torch.as_tensor(selected, dtype=torch.int64)] = True

    def begin_chunk(self, a: int, b: int) -> None:
        """The copier is about to read rows a..b-1: their pending ones are listed now (a hook
        that clears one later records it for `end_chunk`; the mask is not read unlocked, where
        torch's two passes of `nonzero` over bits that change between them fail). The caller
        holds the mask lock."""
        mask = self._mask[a:b]
        rows = None if bool(mask.all()) else torch.nonzero(mask).flatten() + a
        self._chunk, self._taken = (a, b, rows), []

    def read_chunk(self, sources, targets) -> None:
        """Copy the chunk's rows pending when it began from the live sources into the targets.
        No lock: an update may change a row meanwhile, which `end_chunk` mends."""
        a, b, rows = self._chunk
        if rows is None:
            for name, src in sources.items():
                targets[name][a:b].copy_(src[a:b])
        elif len(rows):
            self._copy(sources, targets, rows)

    def end_chunk(self, targets) -> None:
        """The rows the hook took during the read get the values it copied back; the chunk is
        pending no more (also where putting them back fails). The caller holds the mask
        lock."""
        a, b, _ = self._chunk
        try:
            for rows, values in self._taken:
                for name, target in targets.items():
                    target.index_copy_(0, rows, values[name])
        finally:
            self._mask[a:b] = False
            self._chunk, self._taken = None, []

    def copy_listed(self, sources, targets, rows: torch.Tensor) -> None:
        idx = rows.cpu()
        idx = idx[self._mask[idx]]
        if len(idx):
            values = self._copy(sources, targets, idx)
            self._mask[idx] = False
            self._hooked += len(idx)
            if self._chunk is not None:
                a, b, _ = self._chunk
                inside = (idx >= a) & (idx < b)
                if bool(inside.any()):  # the copier's read may overwrite them, updated
                    self._taken.append((idx[inside], {name: v[inside]
                                                      for name, v in values.items()}))

    @staticmethod
    def _copy(sources, targets, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows `idx` of each source into its target; returns the values copied, by source."""
        values = {name: src.index_select(0, idx) for name, src in sources.items()}
        for name, v in values.items():
            targets[name].index_copy_(0, idx, v)
        return values

    def drain(self) -> None:
        """Nothing to wait for: every copy was done in its call."""

    def done(self) -> None:
        """Refill the mask for the next full snapshot now, outside its stall."""
        self._mask.fill_(True)
        self._full = True

    def hooked(self) -> int:
        return self._hooked


class DevicePendingRows:
    """A pending mask on the GPU; copies by kernels on the stream that was current when the
    snapshot was armed (the training stream), writing into mapped host staging. Local."""

    beside_updates = False

    def __init__(self, device: torch.device):
        from mpickpt.engine.pending_rows_cuda import PendingRowKernels

        self.device = device
        self._kernels = PendingRowKernels(device)
        self._mask: torch.Tensor | None = None
        self._hooked = torch.zeros(1, dtype=torch.int64, device=device)
        self._hooked_host = torch.zeros(1, dtype=torch.int64).pin_memory()
        self._stream: torch.cuda.Stream | None = None

    @property
    def rows(self) -> int:
        return len(self._mask)

    def arm(self, rows: int, selected) -> None:
        """Enqueued on the current stream (a selection's row numbers are copied to the device
        first, from pageable memory: in the stall, where the dense copy waits for the device
        anyway)."""
        self._stream = torch.cuda.current_stream(self.device)
        if self._mask is None or len(self._mask) != rows:
            self._mask = torch.empty(rows, dtype=torch.bool, device=self.device)
        self._hooked.zero_()
        if selected is None:
            self._mask.fill_(True)
        else:
            self._mask.zero_()
            idx = torch.as_tensor(selected, dtype=torch.int64)
            self._mask[idx.to(self.device)] = True

    def check(self, sources, targets) -> None:
        for name, src in sources.items():
            self._kernels.check(src, targets[name])

    def copy_chunk(self, sources, targets, a: int, b: int) -> None:
        with torch.cuda.stream(self._stream):
            for name, src in sources.items():
                self._kernels.copy_range(self._stream, src, targets[name], self._mask, a, b - a)
            self._mask[a:b].zero_()

    def copy_listed(self, sources, targets, rows: torch.Tensor) -> None:
        """Enqueued ahead of the update that follows on the caller's stream: on the snapshot's
        stream, which first waits for the caller's when the two differ (and the caller's then
        waits for the copies)."""
        caller = torch.cuda.current_stream(self.device)
        other = caller != self._stream
        if other:
            self._stream.wait_stream(caller)
        with torch.cuda.stream(self._stream):
            rows = rows.to(self.device, torch.int64).contiguous()
            for i, (name, src) in enumerate(sources.items()):
                self._kernels.copy_listed(self._stream, src, targets[name], self._mask, rows,
                                          self._hooked if i == 0 else None)
            self._mask.index_fill_(0, rows, False)
        if other:
            caller.wait_stream(self._stream)

    def drain(self) -> None:
        """Wait (this thread only) until every copy enqueued so far has landed in the host
        targets; the hook count comes back with them."""
        if self._stream is None:
            return
        with torch.cuda.stream(self._stream):
            self._hooked_host.copy_(self._hooked, non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        done.synchronize()

    def done(self) -> None:
        """Nothing to refill: `arm` fills the device mask with one memset on the stream."""

    def hooked(self) -> int:
        """Waits for the copies enqueued so far (the count is kept on the device)."""
        self.drain()
        return int(self._hooked_host[0])
