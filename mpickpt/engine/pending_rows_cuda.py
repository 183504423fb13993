"""CuPy wrapper of kernels/pending_rows.cu: copy-on-update copies of CUDA-resident rows straight
into page-locked, mapped host staging (the kernels write over PCIe; nothing is staged on the
device and the host never waits in a training step).

`unusable(device)` says why the kernels cannot run there (None when they can); `PendingRowKernels`
launches them on a given torch stream. CuPy is imported lazily. Local.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mpickpt.cupy_support import external_stream, gpu_available

SOURCE = Path(__file__).resolve().parents[2] / "kernels" / "pending_rows.cu"
THREADS = 256
WORDS = {16: "w16", 8: "w8", 4: "w4", 2: "w2", 1: "w1"}
CAN_USE_HOST_POINTER = 91
"""cudaDevAttrCanUseHostPointerForRegisteredMem: the device reads and writes registered host
memory through the host's own addresses."""
_modules: dict = {}


def unusable(device: torch.device) -> str | None:
    """Why copy-on-update kernels cannot run on `device` (None: they can). Local."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not gpu_available():
        return "CuPy with a CUDA device is not available (pip install -e '.[gpu]')"
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    if not cupy.cuda.runtime.deviceGetAttribute(CAN_USE_HOST_POINTER, index):
        return f"CUDA device {index} cannot use host pointers of registered memory"
    return None


def word_bytes(row_bytes: int, *addresses: int) -> int:
    """The widest word (16, 8, 4, 2 or 1 bytes) dividing a row and every base address. Local."""
    for size in WORDS:
        if row_bytes % size == 0 and all(a % size == 0 for a in addresses):
            return size
    return 1


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of a contiguous tensor. Local."""
    return (t[0].numel() if len(t) else 0) * t.element_size()


class PendingRowKernels:
    """The kernels of one CUDA device, launched on `stream` (a torch stream). Local."""

    def __init__(self, device: torch.device):
        import cupy

        self._cp = cupy
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _modules:
            with cupy.cuda.Device(index):
                _modules[index] = cupy.RawModule(code=SOURCE.read_text(), options=("-std=c++17",))
        module = _modules[index]
        self._listed = {size: module.get_function(f"copy_listed_{name}")
                        for size, name in WORDS.items()}
        self._range = {size: module.get_function(f"copy_range_{name}")
                       for size, name in WORDS.items()}
        self._streams: dict[int, object] = {}

    @staticmethod
    def check(src: torch.Tensor, dst: torch.Tensor) -> None:
        """A device source and a mapped host target of the same shape and dtype. Local."""
        if not src.is_cuda or dst.is_cuda or src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"copy-on-update needs a CUDA source and a host target of one shape "
                             f"and dtype, got {src.dtype}{tuple(src.shape)} on {src.device} and "
                             f"{dst.dtype}{tuple(dst.shape)} on {dst.device}")
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("copy-on-update sources and targets must be contiguous")

    def _stream(self, stream: torch.cuda.Stream):
        key = stream.cuda_stream
        if key not in self._streams:
            self._streams[key] = external_stream(self._cp, stream)
        return self._streams[key]

    def _word(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[int, int]:
        size = word_bytes(row_bytes(src), src.data_ptr(), dst.data_ptr())
        return size, row_bytes(src) // size

    def copy_listed(self, stream, src, dst, pending, rows, hooked=None) -> None:
        """dst[r] = src[r] for the pending `rows` (int64 on the device); `hooked` (a one-element
        int64 device tensor) counts them. Enqueued on `stream`. Local."""
        n = rows.numel()
        if n == 0 or row_bytes(src) == 0:
            return
        size, words = self._word(src, dst)
        blocks = -(-n * words // THREADS)
        with self._stream(stream):
            self._listed[size]((blocks,), (THREADS,),
                               (src.data_ptr(), dst.data_ptr(), pending.data_ptr(),
                                rows.data_ptr(), np.int64(n), np.int32(words),
                                hooked.data_ptr() if hooked is not None else 0))

    def copy_range(self, stream, src, dst, pending, first: int, n: int) -> None:
        """dst[r] = src[r] for the pending rows of first .. first + n - 1. Enqueued on
        `stream`. Local."""
        if n <= 0 or row_bytes(src) == 0:
            return
        size, words = self._word(src, dst)
        blocks = -(-n * words // THREADS)
        with self._stream(stream):
            self._range[size]((blocks,), (THREADS,),
                              (src.data_ptr(), dst.data_ptr(), pending.data_ptr(), np.int64(first),
                               np.int64(n), np.int32(words)))
