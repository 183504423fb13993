"""Copy-on-update snapshots (`--ckpt-snapshot copy-on-update`): a checkpoint at step s copies
only the dense part at once; its embedding rows become *pending* and a background thread copies
them into the staging area in chunks while training goes on. Before the sparse update of a later
step overwrites a row that is still pending, that row (with its optimizer state) is copied first,
from the update hook that already brackets every sparse update (`before_update`, which sees the
rows the update will touch before it touches them). Every staged row therefore holds its value at
step s, in its place: the files written are byte-identical to a stop-the-world copy's at s (which
on the CPU stages an incremental save's rows compactly instead), and the stall no longer grows
with the table size.

Exclusion on the CPU: the hook copies and clears its rows under the mask lock before the update
runs, so its copy is the row at s. The copier holds no lock a step needs while it reads a chunk:
it marks the chunk under the mask lock, copies the chunk's pending rows while updates go on, and
under the mask lock again puts back the hook's copies of the rows the hook took meanwhile (the
copier's read may have seen their update) and clears the chunk (`HostPendingRows`); a row the
hook has not taken by then was not being updated during the read. So a step never waits for a
chunk (it did while the copier held the model's state lock: ~1-3 ms in each of the ~15 steps
after a checkpoint of 750k rows). On CUDA the copies are enqueued under the state lock, and
stream order does the rest (below). Anything else that rewrites rows (a recovery, a restore, an
emulated loss) must call `finish()` first; the trainer does.

A failure of the copy (the copier's or the hook's) abandons the snapshot, never training: the
rows stop being pending, the hook copies nothing more, and `finish()` raises it for the manager,
which drops that checkpoint.

Where the rows live decides how they are copied (`mpickpt.engine.pending_rows`): CPU tables by
torch copies under a host mask; CUDA tables by kernels (kernels/pending_rows.cu) that write the
rows straight into the page-locked, mapped host staging, all enqueued on the training stream (an
update on another stream is ordered after the copies by stream waits), so stream order puts every
copy before the update that follows it and the step never waits for the device.

Local: the copier is a thread of this rank; nothing here is collective.
"""
from __future__ import annotations

import threading
import time

import torch

from mpickpt.engine.pending_rows import DevicePendingRows, HostPendingRows

CHUNK_ROWS = 1 << 15
"""Rows per chunk of the copier (on the CPU read beside the updates, a few ms at D = 64; on CUDA
enqueued under one hold of the state lock)."""
SLOW_COPY_ROWS = 16
"""Rows per chunk under `--inject-slow-copy` (fault tests: small models' copies span steps)."""


class CopyOnUpdate:
    """An update hook that copies pending rows of one snapshot before their first update, plus
    the background copier. Construction registers the hook (local).

    The stall of `start` does not grow with the table: the pending mask is one buffer, refilled
    in place (a memset, no fresh pages to fault in: a new 4 MB mask took 1-34 ms under the
    writers' memory traffic), and the copier is one thread for the manager's life, woken per
    snapshot (starting a thread took up to 7 ms)."""

    def __init__(self, model, chunk_rows: int = CHUNK_ROWS, pause_s: float = 0.0, place=None):
        """`pause_s`: the copier sleeps this long between chunks (0: only yields the lock).
        `place`: called on the copier thread when it starts (its cores: a core split's
        background cores, `mpickpt.engine.core_split`)."""
        self.model, self.chunk_rows, self.pause_s = model, chunk_rows, pause_s
        self._place = place
        self._mask_lock = threading.Lock()
        self._pending: HostPendingRows | DevicePendingRows | None = None
        """The current snapshot's pending rows (None: nothing pending)."""
        self._kept: dict[str, HostPendingRows | DevicePendingRows] = {}
        """One pending-rows object per device type, reused by every snapshot."""
        self._last: HostPendingRows | DevicePendingRows | None = None
        self._sources: dict[str, torch.Tensor] = {}
        self._targets: dict[str, torch.Tensor] = {}
        self._wake = threading.Condition()
        self._state = "idle"
        """idle, ready (started, waiting for `go`), queued (let go) or copying."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.cpu_seconds = 0.0
        """CPU the copier thread spent copying, all snapshots (background work: the issue's
        bound on the time a checkpoint costs counts it)."""
        device = getattr(getattr(model, "topo", None), "device", None)
        if device is not None and device.type == "cuda":
            self._pending_rows(device)  # compiles the kernels now (not in the first stall),
            # before anything is registered: a failure here leaves the model untouched
        model.embeddings.add_update_hook(self)
        self._ensure_thread()  # here, not in a checkpoint's stall

    @property
    def by_hook(self) -> int:
        """Rows of the last snapshot copied by the update hook (the rest by the copier); on CUDA
        counted on the device: reading it waits for the copies enqueued so far. Local."""
        return self._last.hooked() if self._last is not None else 0

    # ---- the snapshot -----------------------------------------------------------------------
    def start(self, sources: dict[str, torch.Tensor], targets: dict[str, torch.Tensor],
              selected=None) -> None:
        """Make the `selected` rows (sorted local rows; None: every row) of `sources`
        (row-aligned, live) pending for `targets` (same shapes; for CUDA sources, host memory
        registered as mapped); the copier begins at `go`. Local."""
        self.finish()
        rows = len(next(iter(sources.values())))
        self._sources, self._targets = sources, targets
        self.error = None
        self._stop.clear()
        pending = self._pending_rows(next(iter(sources.values())).device)
        if isinstance(pending, DevicePendingRows):
            pending.check(sources, targets)
        pending.arm(rows, selected)
        self._last = pending
        with self._mask_lock:
            self._pending = pending
        with self._wake:
            self._state = "ready"
        self._ensure_thread()

    def _pending_rows(self, device: torch.device):
        if device.type not in self._kept:
            self._kept[device.type] = DevicePendingRows(device) if device.type == "cuda" \
                else HostPendingRows()
        return self._kept[device.type]

    def go(self) -> None:
        """Let the copier begin (the checkpoint's save() calls this last, so that the copier's
        first chunk does not compete with the rest of the stall for the GIL and the locks).
        `finish` and `cancel` let it go too. Local."""
        with self._wake:
            if self._state == "ready":  # once per snapshot: a later go() is no second copy
                self._state = "queued"
                self._wake.notify_all()

    @property
    def active(self) -> bool:
        """Rows of the current snapshot are still being copied. Local."""
        return self._state != "idle"

    def finish(self) -> None:
        """Copy whatever is still pending now (in this thread's wait on the copier); the staging
        area then holds the whole snapshot. Re-raises a copier failure. Local."""
        self._wait_idle()
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"copy-on-update snapshot failed: {error}") from error

    def cancel(self) -> None:
        """Stop copying and forget the snapshot (it will not be written). Local."""
        self._stop.set()
        self._wait_idle()
        with self._mask_lock:
            self._pending = None
        if self._last is not None:
            try:
                self._last.drain()  # no kernel writes into staging after this
            except Exception:  # a dead CUDA context: nothing more lands either; the caller
                pass  # (abort, close) must still free the writers and the staging
        self.error = None

    def close(self) -> None:
        """Cancel any snapshot and end the copier thread. Local; safe twice."""
        self.cancel()
        with self._wake:
            self._closed = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _wait_idle(self) -> None:
        self.go()
        with self._wake:
            while self._state != "idle":
                self._wake.wait()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._closed = False
            self._thread = threading.Thread(target=self._serve, name="mpickpt-copy-on-update",
                                            daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        """The copier thread: one snapshot per `go`, until `close`."""
        if self._place is not None:
            self._place()
        while True:
            with self._wake:
                while self._state != "queued" and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                self._state = "copying"
            cpu = time.thread_time()
            self._copy_all()
            self.cpu_seconds += time.thread_time() - cpu
            with self._wake:
                self._state = "idle"
                self._wake.notify_all()

    def _copy_all(self) -> None:
        pending = self._pending
        try:
            for a in range(0, pending.rows, self.chunk_rows):
                if self._stop.is_set():
                    return
                b = min(pending.rows, a + self.chunk_rows)
                if pending.beside_updates:
                    self._copy_beside(pending, a, b)
                else:
                    with self.model.state_lock, self._mask_lock:
                        pending.copy_chunk(self._sources, self._targets, a, b)
                time.sleep(self.pause_s)  # a waiting training thread takes the lock here
            pending.drain()  # CUDA: the enqueued copies have landed
            with self._mask_lock:
                self._pending = None
            pending.done()
        except BaseException as e:  # reported by finish(); the checkpoint is not written
            self._fail(e)

    def _copy_beside(self, pending: HostPendingRows, a: int, b: int) -> None:
        """One chunk read while updates go on (see `HostPendingRows`)."""
        with self._mask_lock:
            pending.begin_chunk(a, b)
        try:
            pending.read_chunk(self._sources, self._targets)
        finally:
            with self._mask_lock:
                pending.end_chunk(self._targets)

    def _fail(self, error: BaseException) -> None:
        """Abandon the snapshot: nothing is pending any more, `finish` raises `error`."""
        if self.error is None:
            self.error = error
        self._stop.set()
        with self._mask_lock:
            self._pending = None

    # ---- update hook -------------------------------------------------------------------------
    def before_update(self, rows: torch.Tensor):
        """Copy the pending ones among `rows` before the update overwrites them (on CUDA:
        enqueue their copy ahead of the update). Local."""
        if self._pending is None:
            return None
        try:
            with self._mask_lock:
                if self._pending is not None:
                    self._pending.copy_listed(self._sources, self._targets, rows)
        except Exception as e:  # the snapshot is lost, training is not
            self._fail(e)
        return None

    def after_update(self, rows: torch.Tensor, token) -> None:
        pass

    def step_done(self) -> None:
        pass
