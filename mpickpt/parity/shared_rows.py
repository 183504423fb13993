"""Row memory that a lost rank on the same host maps instead of copying (`--rebuild-transport
auto`).

A rank whose group may rebuild by reading its memory keeps its rows, sparse optimizer state and
parity in anonymous shared memory (`memfd_create`, `SharedRows.adopt`: the tensors keep their
identity, only their storage moves), and publishes each buffer's descriptor number with its
addresses. A lost rank opens `/proc/<pid>/fd/<n>` of each survivor and maps the buffer read-only
(`PeerMaps`): its sweep XORs the survivors' rows where they lie, and a degraded read is a load,
where `process_vm_readv` copied every byte into scratch first and pinned a page per row.
Measured on the 2-core VM: the whole sweep of the parity bench's lost rank (283k units, 58 MB of
survivors' rows) took ~16 ms by copies and a degraded row ~3.8 us; mapped, ~2 ms for the same
XOR and well under 1 us a row.

The memory has no name in any filesystem: it is freed with the last process that maps it, so a
crash leaves nothing behind. Opening another process's descriptor needs the same permission as
reading its memory (ptrace read access: same user, no Yama attach restriction); where it is
refused, or a survivor's buffer is not shared, the rebuild copies (`cross_memory`) as before.
A survivor that dies while mapped leaves its memory as it was at its death; the rounds read a
survivor only while it waits in the round (`peer_rows`), so what is read is consistent either
way. Local.
"""
from __future__ import annotations

import mmap
import os
import warnings

import torch

MEMFD_NAME = "mpickpt-rows"
"""The name the kernel shows for the memory (`/proc/<pid>/fd/<n>` links to /memfd:<name>)."""


class SharedRows:
    """This process's row buffers in shared memory. Local."""

    def __init__(self):
        self._held: list[tuple[int, int, int]] = []  # (descriptor, address, bytes)

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "memfd_create")

    def adopt(self, t: torch.Tensor) -> bool:
        """Move `t`'s storage into shared memory in place (the same tensor object, its values
        copied; views of the old storage would no longer see it, so call this before any are
        taken). False, and `t` unchanged, where it is not a contiguous CPU tensor that owns all
        of its storage or the kernel refuses."""
        if self.locate(t) is not None:
            return True
        nbytes = t.numel() * t.element_size()
        if not self.supported() or t.device.type != "cpu" or not t.is_contiguous() or \
                t.storage_offset() != 0 or t.untyped_storage().nbytes() != nbytes or not nbytes:
            return False
        try:
            fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        except OSError:
            return False
        try:
            os.ftruncate(fd, nbytes)
            buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            return False
        if hasattr(mmap, "MADV_HUGEPAGE"):  # huge pages where shmem_enabled allows (advise)
            try:
                buf.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        shared = torch.frombuffer(buf, dtype=t.dtype, count=t.numel()).view(t.shape)
        with torch.no_grad():
            shared.copy_(t)
            t.set_(shared.untyped_storage(), 0, t.shape, t.stride())
        self._held.append((fd, t.data_ptr(), nbytes))
        return True

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(descriptor, byte offset) of `t`'s first element in shared memory, or None where it
        is not in any of this process's shared buffers."""
        if t.device.type != "cpu":
            return None
        address = t.data_ptr()
        for fd, base, nbytes in self._held:
            if base <= address < base + nbytes:
                return fd, address - base
        return None

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self._held)

    def close(self) -> None:
        """Close the descriptors (peers can no longer open the buffers; the tensors keep their
        memory until they go). Local."""
        for fd, _, _ in self._held:
            os.close(fd)
        self._held.clear()


def for_parity(model, config) -> SharedRows | None:
    """This rank's rows and sparse optimizer state moved into shared memory, where parity may
    rebuild by mapping them (`config`: the job's ParityConfig or None; transport auto) and the
    model's embeddings can move them (`share_rows`: mpickpt's own; a TorchRec table's memory
    belongs to FBGEMM, and is copied). Call it before anything takes views of the rows. None
    where nothing was moved. Each tensor is copied once into its new memory, so a rank holds it
    twice for a moment. Local."""
    if config is None or config.transport != "auto" or not SharedRows.supported():
        return None
    share = getattr(model.embeddings, "share_rows", None)
    if share is None:
        return None
    shared = SharedRows()
    share(shared)  # a tensor that cannot move stays private: its buffers are not offered
    return shared if shared.nbytes else None


class PeerMapError(OSError):
    """A survivor's shared buffer could not be mapped (refused, gone, or not what it said)."""


class PeerMaps:
    """Read-only maps of survivors' shared buffers, by (pid, descriptor). Local; `close` unmaps
    what no tensor still views."""

    def __init__(self):
        self._maps: dict[tuple[int, int], torch.Tensor] = {}
        self.mapped: set[int] = set()
        """Pids whose every buffer is mapped (decided at a rebuild's probe)."""

    def words(self, pid: int, fd: int, offset: int, nbytes: int) -> torch.Tensor:
        """int32 words [offset, offset + nbytes) of buffer `fd` of process `pid`, a view of its
        memory (mapped on first use). PeerMapError where it cannot be mapped or is too short."""
        if offset < 0 or offset % 4 or nbytes < 0:
            raise PeerMapError(f"a shared buffer of process {pid} was published at byte "
                               f"{offset} ({nbytes} bytes), not a word of it")
        words = self._maps.get((pid, fd))
        if words is None:
            words = self._maps[pid, fd] = _map(pid, fd)
        if offset + nbytes > words.numel() * 4:
            raise PeerMapError(f"shared buffer {fd} of process {pid} holds "
                               f"{words.numel() * 4} bytes, not {offset + nbytes}")
        return words[offset // 4:(offset + nbytes) // 4]

    def close(self) -> None:
        self._maps.clear()
        self.mapped.clear()


def _map(pid: int, fd: int) -> torch.Tensor:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        link = os.readlink(path)
    except OSError as e:
        raise PeerMapError(f"cannot open {path}: {e.strerror or e}") from e
    if not link.startswith(f"/memfd:{MEMFD_NAME}"):
        raise PeerMapError(f"{path} is not an mpickpt row buffer (it is {link})")
    try:
        f = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise PeerMapError(f"cannot open {path}: {e.strerror or e}") from e
    try:
        size = os.fstat(f).st_size
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no fault per page later
        buf = mmap.mmap(f, size, flags, mmap.PROT_READ) if size else None
    except OSError as e:
        raise PeerMapError(f"cannot map {path}: {e.strerror or e}") from e
    finally:
        os.close(f)
    if buf is None:
        return torch.zeros(0, dtype=torch.int32)
    with warnings.catch_warnings():  # read-only on purpose: a write would fault, not corrupt
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.int32, count=size // 4)
