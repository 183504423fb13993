"""Copy-on-update snapshots (`--ckpt-snapshot copy-on-update`): a checkpoint at step s copies
only the dense part at once; its embedding rows become *pending* and a background thread copies
them into the staging area in chunks while training goes on. Before the sparse update of a later
step overwrites a row that is still pending, that row (with its optimizer state) is copied first,
from the update hook that already brackets every sparse update (`before_update`, which sees the
rows the update will touch before it touches them). Every staged row therefore holds its value at
step s: the staging area ends byte-identical to a stop-the-world copy at s, and the stall no
longer grows with the table size.

Exclusion: the copier copies a chunk while holding the model's `state_lock` (the lock every
sparse update holds) and the mask lock, and the hook copies and clears its rows under the mask
lock before the update runs, so a row is copied exactly once and always before its first update
after s. Anything else that rewrites rows (a recovery, a restore, an emulated loss) must call
`finish()` first; the trainer does.

CPU tensors only (on CUDA the snapshot stays a stop-the-world copy on its side stream). Local:
the copier is a thread of this rank; nothing here is collective.
"""
from __future__ import annotations

import threading
import time

import torch

CHUNK_ROWS = 1 << 15
"""Rows copied per chunk (one hold of the state lock: a few ms at D = 64)."""
SLOW_COPY_ROWS = 16
"""Rows per chunk under `--inject-slow-copy` (fault tests: small models' copies span steps)."""


class CopyOnUpdate:
    """An update hook that copies pending rows of one snapshot before their first update, plus
    the background copier. Construction registers the hook (local)."""

    def __init__(self, model, chunk_rows: int = CHUNK_ROWS, pause_s: float = 0.0):
        """`pause_s`: the copier sleeps this long between chunks (0: only yields the lock)."""
        self.model, self.chunk_rows, self.pause_s = model, chunk_rows, pause_s
        self._mask_lock = threading.Lock()
        self._pending: torch.Tensor | None = None
        self._sources: dict[str, torch.Tensor] = {}
        self._targets: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._go = threading.Event()
        self.error: BaseException | None = None
        self.by_hook = 0
        """Rows of the current snapshot copied by the update hook (the rest by the copier)."""
        model.embeddings.add_update_hook(self)

    # ---- the snapshot -----------------------------------------------------------------------
    def start(self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
              selected=None) -> None:
        """Make the `selected` rows (sorted local rows; None: every row) of `sources`
        (row-aligned, live) pending for `targets` (same shapes) and start copying them in the
        background. Local."""
        self.finish()
        rows = len(next(iter(sources.values())))
        self._sources, self._targets = sources, targets
        self.by_hook, self.error = 0, None
        self._stop.clear()
        if selected is None:
            pending = torch.ones(rows, dtype=torch.bool)
        else:
            pending = torch.zeros(rows, dtype=torch.bool)
            pending[torch.as_tensor(selected, dtype=torch.int64)] = True
        with self._mask_lock:
            self._pending = pending
        self._go.clear()
        self._thread = threading.Thread(target=self._copy_all, name="mpickpt-copy-on-update",
                                        daemon=True)
        self._thread.start()

    def go(self) -> None:
        """Let the copier begin (the checkpoint's save() calls this last, so that the copier's
        first chunk does not compete with the rest of the stall for the GIL and the locks).
        `finish` and `cancel` let it go too. Local."""
        self._go.set()

    @property
    def active(self) -> bool:
        """Rows of the current snapshot are still being copied. Local."""
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> None:
        """Copy whatever is still pending now (in this thread's wait on the copier); the staging
        area then holds the whole snapshot. Re-raises a copier failure. Local."""
        thread, self._thread = self._thread, None
        self._go.set()
        if thread is not None:
            thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"copy-on-update snapshot failed: {error}") from error

    def cancel(self) -> None:
        """Stop copying and forget the snapshot (it will not be written). Local."""
        self._stop.set()
        self._go.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._mask_lock:
            self._pending = None
        self.error = None

    def _copy_all(self) -> None:
        self._go.wait()
        try:
            rows = len(self._pending)
            for a in range(0, rows, self.chunk_rows):
                if self._stop.is_set():
                    return
                with self.model.state_lock, self._mask_lock:
                    self._copy_range(a, min(rows, a + self.chunk_rows))
                time.sleep(self.pause_s)  # a waiting training thread takes the lock here
            with self._mask_lock:
                self._pending = None
        except BaseException as e:  # reported by finish(); the checkpoint is not written
            self.error = e

    def _copy_range(self, a: int, b: int) -> None:
        mask = self._pending[a:b]
        if bool(mask.all()):
            for name, src in self._sources.items():
                self._targets[name][a:b].copy_(src[a:b])
        elif bool(mask.any()):
            idx = torch.nonzero(mask).flatten() + a
            self._copy_rows(idx)
        mask.zero_()

    def _copy_rows(self, idx: torch.Tensor) -> None:
        for name, src in self._sources.items():
            self._targets[name].index_copy_(0, idx, src.index_select(0, idx))

    # ---- update hook -------------------------------------------------------------------------
    def before_update(self, rows: torch.Tensor):
        """Copy the pending ones among `rows` before the update overwrites them. Local."""
        if self._pending is None:
            return None
        with self._mask_lock:
            pending = self._pending
            if pending is None:
                return None
            idx = rows.cpu()
            idx = idx[pending[idx]]
            if len(idx):
                self._copy_rows(idx)
                pending[idx] = False
                self.by_hook += len(idx)
        return None

    def after_update(self, rows: torch.Tensor, token) -> None:
        pass

    def step_done(self) -> None:
        pass
