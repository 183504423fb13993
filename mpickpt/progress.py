"""Progress lines printed by rank 0: step, loss, samples/s."""
from __future__ import annotations

import sys
import time


class ProgressLog:
    """Prints every `freq` steps on rank 0 with the mean loss and throughput since the last line.
    Local (the losses it receives are already global)."""

    def __init__(self, is_root: bool, total_steps: int, freq: int, stream=None):
        self.is_root, self.total, self.freq = is_root, total_steps, freq
        self.stream = stream or sys.stdout
        self._loss_sum, self._steps, self._samples = 0.0, 0, 0
        self._since = time.perf_counter()
        self._from: int | None = None
        """The step of the last restart, until the first line after it."""

    def restart_at(self, step: int, said: bool = True) -> None:
        """Start afresh after a restore or an in-place recovery to `step`: the next line's loss
        and samples/s cover only the steps trained since (those recorded before it may have
        been undone, rolled back or replayed), and, where `said`, it says from which step (a
        run's start says nothing). Local."""
        self._loss_sum, self._steps, self._samples = 0.0, 0, 0
        self._since = time.perf_counter()
        self._from = step if said else None

    def step(self, step: int, loss: float, samples: int) -> None:
        """Record one step; print when due. Local."""
        self._loss_sum += loss
        self._steps += 1
        self._samples += samples
        if self.freq and (step % self.freq == 0 or step == self.total):
            self._emit(step)

    def _emit(self, step: int) -> None:
        now = time.perf_counter()
        rate = self._samples / max(now - self._since, 1e-9)
        since = f"  (steps {self._from + 1}-{step}, since the restart)" \
            if self._from is not None else ""
        self.say(f"step {step}/{self.total}  loss {self._loss_sum / self._steps:.6f}  "
                 f"{rate:,.0f} samples/s{since}")
        self._loss_sum, self._steps, self._samples, self._since = 0.0, 0, 0, now
        self._from = None

    def say(self, line: str) -> None:
        """Print `line` on rank 0. Local."""
        if self.is_root:
            print(line, file=self.stream, flush=True)
