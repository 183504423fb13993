"""Phase timing for the training step: where does an iteration's time go?"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch


class PhaseTimer:
    """Accumulates wall time per named phase. Local. Synchronises CUDA around each phase when the
    device is a GPU, so asynchronous kernels are charged to the phase that launched them."""

    def __init__(self, device: torch.device | None = None, enabled: bool = True):
        self.enabled = enabled
        self._cuda = device is not None and device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        """Time the enclosed block as `name`. Local."""
        if not self.enabled:
            yield
            return
        if self._cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._cuda:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start
            self.counts[name] += 1

    def reset(self) -> None:
        """Forget all accumulated times. Local."""
        self.totals.clear()
        self.counts.clear()
