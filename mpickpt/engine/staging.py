"""Host staging buffers shared with the background writers.

A `StagingArea` is one file in /dev/shm (tmpfs), memory-mapped by the training rank and by its
writer processes, holding named arrays at fixed offsets. It is allocated and pre-faulted once and
reused by every checkpoint, so the snapshot stall is a pure memory copy. On GPUs the mapping is
page-locked and mapped (cudaHostRegister): the device-to-host copies run on a side stream, and
copy-on-update kernels write rows into it directly.
"""
from __future__ import annotations

import math
import os
import uuid

import numpy as np

from mpickpt.owned_names import owned_name, remove_stale

ALIGN = 4096
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
PREFIX = "mpickpt-staging-"
PORTABLE, MAPPED = 1, 2
"""cudaHostRegisterPortable, cudaHostRegisterMapped."""


def layout_of(specs: dict[str, tuple[tuple[int, ...], str]]) -> tuple[dict, int]:
    """Offsets for named (shape, dtype) arrays, page-aligned; returns (layout, total bytes). Local."""
    layout, offset = {}, 0
    for name, (shape, dtype) in specs.items():
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        layout[name] = {"offset": offset, "shape": list(shape), "dtype": np.dtype(dtype).str}
        offset += -(-max(nbytes, 1) // ALIGN) * ALIGN
    return layout, offset


def map_arrays(path: str, layout: dict, writable: bool) -> tuple[np.memmap, dict[str, np.ndarray]]:
    """Map the staging file and return (mapping, {name: array view}). Local."""
    size = os.path.getsize(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r+" if writable else "r", shape=(size,))
    views = {}
    for name, spec in layout.items():
        dtype = np.dtype(spec["dtype"])
        count = int(np.prod(spec["shape"], dtype=np.int64))
        raw = mm[spec["offset"]:spec["offset"] + count * dtype.itemsize]
        views[name] = raw.view(dtype).reshape(spec["shape"])
    return mm, views


class StagingArea:
    """Named host arrays in shared memory. Created by a training rank; attached by writers."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], str]], pin_for_cuda: bool = False):
        self.layout, self.nbytes = layout_of(specs)
        self._specs = list(specs.items())
        directory = SHM_DIR or os.environ.get("TMPDIR", "/tmp")
        self.path = os.path.join(directory, owned_name(PREFIX, uuid.uuid4().hex[:8]))
        with open(self.path, "wb") as f:
            f.truncate(self.nbytes)
        self._mm, self.arrays = map_arrays(self.path, self.layout, writable=True)
        self._tensors = None
        self._mm[:] = 0  # pre-fault every page now, not during the first snapshot
        self._pinned = self._pin() if pin_for_cuda else None

    def _pin(self):
        """Page-lock the area for fast device-to-host copies, mapped into the device's address
        space (portable: every device) so that kernels can write rows into it directly."""
        import torch

        ptr = self._mm.ctypes.data
        err = torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, PORTABLE | MAPPED)
        return ptr if int(err) == 0 else None

    @property
    def mapped(self) -> bool:
        """Page-locked and mapped for the device (kernels may write into it). Local."""
        return self._pinned is not None

    def matches(self, specs) -> bool:
        """True when this area was laid out for exactly `specs`, in the same order (checked in
        every stall: the specs are compared, not laid out again). Local."""
        return self._specs == list(specs.items())

    def tensors(self):
        """torch views of the arrays (sharing the memory). Local."""
        import torch

        if self._tensors is None:  # made once: the views live as long as the mapping
            self._tensors = {name: torch.from_numpy(a) for name, a in self.arrays.items()}
        return self._tensors

    def describe(self) -> dict:
        """What a writer needs to attach: path and layout. Local."""
        return {"path": self.path, "layout": self.layout}

    def close(self) -> None:
        """Unmap and delete the backing file; safe twice. Local."""
        if getattr(self, "_mm", None) is None:
            return
        if self._pinned is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._pinned)
        self.arrays, self._mm, self._tensors = {}, None, None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __del__(self):
        self.close()


def remove_stale_areas() -> list[str]:
    """Delete this user's staging files left by processes of this PID namespace that no longer
    exist (`owned_names.stale`; names from before the namespace was in them too). Local."""
    if SHM_DIR is None:
        return []
    return remove_stale(SHM_DIR, PREFIX, legacy=True)
