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

    def restart_at(self, step: int) -> None:
        """Start the throughput clock afresh (after a restore to `step`). Local."""
        self._since = time.perf_counter()

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
        self.say(f"step {step}/{self.total}  loss {self._loss_sum / self._steps:.6f}  "
                 f"{rate:,.0f} samples/s")
        self._loss_sum, self._steps, self._samples, self._since = 0.0, 0, 0, now

    def say(self, line: str) -> None:
        """Print `line` on rank 0. Local."""
        if self.is_root:
            print(line, file=self.stream, flush=True)
