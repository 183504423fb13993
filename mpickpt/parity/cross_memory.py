"""Reads of a peer process's memory on the same host (Linux cross-memory attach,
`process_vm_readv`), for parity rebuilds whose group shares a host.

This is the mechanism intra-node MPI uses for large messages (CMA in MPICH and Open MPI): the
kernel copies straight from the peer's pages into the reader's buffer, so the peer spends no CPU
and nothing crosses a socket. A reader names the peer by pid and its memory by address, which
only means something within one kernel and one pid namespace (`host_key`). The kernel allows it
for processes of the same user unless Yama's ptrace_scope is 1 (Ubuntu's default), where the
peer must name its readers: `allow_readers` lets any process of the same user read this one, as
Open MPI does for CMA; ptrace_scope 2 or 3, or a seccomp profile, refuses, and the rebuild goes
over the network instead.

All calls are local. A read of a peer that died fails with `CrossMemoryError` (a RuntimeError,
as a collective's error on a peer's death is).
"""
from __future__ import annotations

import ctypes
import errno
import hashlib
import os

import numpy as np

IOV_MAX = 1024
PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


class CrossMemoryError(RuntimeError):
    """A read of a peer's memory failed: the peer is gone (ESRCH), may not be read (EPERM), or
    the address is not mapped there (EFAULT)."""

    def __init__(self, pid: int, err: int, what: str):
        self.errno = err
        super().__init__(f"reading {what} of process {pid} on this host failed: "
                         f"{errno.errorcode.get(err, err)} ({os.strerror(err)})")


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_readv", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return libc


_LIBC = _libc()


def available() -> bool:
    """Whether this platform has `process_vm_readv` (Linux with glibc or musl)."""
    return _LIBC is not None


def host_key() -> int:
    """A 63-bit key equal for two processes exactly when a pid means the same process to both:
    same kernel boot (its boot id) and same pid namespace. 0 where either is unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
    digest = hashlib.blake2b(f"{boot}/{ns}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1 or 1


def allow_readers() -> None:
    """Let processes of the same user read this one under Yama's ptrace_scope 1 (a no-op
    elsewhere; failures are ignored: the rebuild then finds out by trying)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0)


def read_span(pid: int, address: int, out: np.ndarray, what: str = "memory") -> None:
    """Copy len(out) bytes (`out` C-contiguous, any dtype) from `address` in process `pid`."""
    local = np.array([[out.ctypes.data, out.nbytes]], dtype=np.uint64)
    remote = np.array([[address, out.nbytes]], dtype=np.uint64)
    _readv(pid, local, remote, out.nbytes, what)


def read_rows(pid: int, base: int, stride: int, rows: np.ndarray, out: np.ndarray,
              what: str = "rows") -> None:
    """Copy rows `rows` of a peer's array at `base` (`stride` bytes from row to row) into `out`
    ((len(rows), row bytes), C-contiguous): one iovec per row, IOV_MAX of them per call."""
    n = len(rows)
    if n == 0:
        return
    width = out.nbytes // n
    if width * n != out.nbytes or not out.flags.c_contiguous:
        raise ValueError(f"read_rows needs a C-contiguous output of {n} equal rows, got "
                         f"{out.shape} {out.dtype}")
    remote = np.empty((n, 2), dtype=np.uint64)
    remote[:, 0] = np.uint64(base) + np.asarray(rows, dtype=np.uint64) * np.uint64(stride)
    remote[:, 1] = width
    for a in range(0, n, IOV_MAX):
        b = min(n, a + IOV_MAX)
        local = np.array([[out.ctypes.data + a * width, (b - a) * width]], dtype=np.uint64)
        _readv(pid, local, remote[a:b], (b - a) * width, what)


def _readv(pid: int, local: np.ndarray, remote: np.ndarray, nbytes: int, what: str) -> None:
    """One `process_vm_readv` of `remote` (iovec pairs) into `local` (one iovec); a short read
    (the kernel stops at a page it cannot read) is an error."""
    if _LIBC is None:
        raise CrossMemoryError(pid, errno.ENOSYS, what)
    got = _LIBC.process_vm_readv(pid, local.ctypes.data, len(local), remote.ctypes.data,
                                 len(remote), 0)
    if got < 0:
        raise CrossMemoryError(pid, ctypes.get_errno(), what)
    if got != nbytes:
        raise CrossMemoryError(pid, errno.EFAULT, f"{what} ({got} of {nbytes} bytes)")
