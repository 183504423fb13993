"""What the CuPy kernel wrappers share: is a GPU usable, is an array a torch tensor, CuPy views of
torch streams and tensors. CuPy is imported lazily, so this module imports without it. Local."""
from __future__ import annotations


def gpu_available() -> bool:
    """CuPy importable and at least one CUDA device. Local."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or a CUDA runtime error without a driver or device
        return False


def is_torch(x) -> bool:
    """`x` is a torch tensor (checked without importing torch). Local."""
    return type(x).__module__.split(".")[0] == "torch"


def external_stream(cupy, stream):
    """A CuPy view of a torch stream (CuPy >= 14's `Stream.from_external` where available). Local."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)
