"""Module-level guard of the GPU kernel tests: CuPy and a CUDA device, or the module is skipped."""
import pytest


def cupy_with_gpu(what: str):
    """CuPy, or skip the calling test module, saying that `what` needs CuPy and a CUDA GPU."""
    cupy = pytest.importorskip("cupy", reason=f"{what} needs CuPy")
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver, or no device
        devices = 0
    if devices == 0:
        pytest.skip(f"{what} needs a CUDA GPU", allow_module_level=True)
    return cupy
