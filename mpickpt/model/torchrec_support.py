"""Loading TorchRec: the versions mpickpt's adapter is built and tested against, and a clear
error instead of an undefined-symbol traceback when another pair is installed. Local."""
from __future__ import annotations

import importlib
import importlib.metadata

SUPPORTED = {"torchrec": "1.8.", "fbgemm-gpu": "1.8."}
"""Distribution -> the version prefix that works with the torch here (fbgemm-gpu: the CPU or
the CUDA build, whichever is installed)."""
INSTALL = ("pip install --no-deps -r requirements-torchrec.txt && "
           "pip install -c constraints-cpu.txt -e '.[torchrec]'")


class TorchRecUnavailable(RuntimeError):
    """TorchRec cannot be used here: not installed, another version, or it fails to load."""


def installed_version(distribution: str) -> str | None:
    """The installed version of `distribution` (fbgemm-gpu: its -cpu or CUDA build), or None.
    Local."""
    names = [distribution] + ([f"{distribution}-cpu"] if distribution == "fbgemm-gpu" else [])
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_versions(versions: dict[str, str | None]) -> None:
    """Raise TorchRecUnavailable naming each distribution that is missing or outside its
    supported prefix. Local and pure."""
    wrong = [f"{name} {have or 'not installed'} (expected {prefix}x)"
             for name, prefix in SUPPORTED.items()
             if (have := versions.get(name)) is None or not have.startswith(prefix)]
    if wrong:
        raise TorchRecUnavailable(f"mpickpt's TorchRec adapter needs torchrec 1.8 with "
                                  f"fbgemm-gpu 1.8: found {', '.join(wrong)}; install with: "
                                  f"{INSTALL}")


def load_torchrec():
    """Import torchrec (and fbgemm_gpu's operators) after checking the versions; the torchrec
    module. TorchRecUnavailable with the install command otherwise. Local."""
    check_versions({name: installed_version(name) for name in SUPPORTED})
    try:
        importlib.import_module("fbgemm_gpu")
        return importlib.import_module("torchrec")
    except (ImportError, OSError, RuntimeError) as e:  # e.g. undefined symbols against torch
        raise TorchRecUnavailable(f"torchrec failed to load against torch "
                                  f"{importlib.import_module('torch').__version__}: {e}; "
                                  f"install the pinned pair with: {INSTALL}") from e
