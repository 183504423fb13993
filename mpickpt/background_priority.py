"""The CPU and I/O priority of mpickpt's background processes (the checkpoint writers, which also
CRC and quantize, and the IncrCP extractor), so that their work takes what training leaves.

Modes (`--ckpt-background`):
- `idle` (default): SCHED_IDLE and the idle I/O class: they run only on a core training leaves
  idle (on 2 cores with 2 ranks: while the ranks wait in their collectives) and their disk
  requests go after everyone else's. The kernel does the throttling: when the step time rises
  because a rank computes more, the background gets less.
- `low`: SCHED_BATCH and the lowest best-effort I/O level (7): they compete, but are never
  favoured as interactive.
- `normal`: SCHED_OTHER and best-effort level 4, as any process (what a final checkpoint before a
  stop signal runs at: nothing is left to protect then).

Linux keeps policies per thread: `apply` sets every thread of the process, and threads the
worker starts later inherit from the thread that starts them. An unprivileged process may move
its children from SCHED_IDLE back to SCHED_OTHER (within RLIMIT_NICE, default 0, which is where
they start) and between best-effort I/O levels, so every mode can be reached both ways without
root. Where the kernel refuses (another OS, a seccomp profile), `apply` says why and the workers
run as they are. `Background` adds where they run: the background cores of a core split
(`mpickpt.engine.core_split`), or anywhere. Local: nothing here uses MPI.
"""
from __future__ import annotations

import ctypes
import os
import platform
from contextlib import contextmanager
from dataclasses import dataclass

MODES = ("idle", "low", "normal")
IOPRIO_WHO_PROCESS = 1
IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE = 2, 3
_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274)}
"""Machine -> (ioprio_set, ioprio_get) syscall numbers."""


@dataclass(frozen=True)
class Setting:
    """What one mode means to the kernel."""

    policy: int
    io_class: int
    io_level: int


@dataclass(frozen=True)
class Background:
    """How and where background work runs: the priority `mode` and the `cores` it is kept on
    (None: anywhere the process may run)."""

    mode: str = "idle"
    cores: tuple[int, ...] | None = None

    @classmethod
    def of(cls, value) -> "Background":
        """`value` itself, or a mode name as a Background that runs anywhere. Local."""
        return value if isinstance(value, Background) else cls(setting_mode(value))

    def at(self, mode: str) -> "Background":
        """The same cores at priority `mode` (`normal` for a last checkpoint). Local."""
        return Background(setting_mode(mode), self.cores)

    @contextmanager
    def spawning(self):
        """The calling thread on these cores while inside, as it was after: a process spawned
        inside starts its interpreter there, not on training's cores. Local."""
        saved = None
        if self.cores is not None:
            try:
                saved = os.sched_getaffinity(0)
                os.sched_setaffinity(0, self.cores)
            except (OSError, AttributeError):
                saved = None
        try:
            yield
        finally:
            if saved is not None:
                os.sched_setaffinity(0, saved)

    def apply(self, pid: int) -> str | None:
        """Every thread of process `pid` at this priority and on these cores; None when done,
        else why not (it keeps running as it was). Local."""
        return self.apply_to_threads(threads_of(pid))

    def apply_to_threads(self, tids: list[int]) -> str | None:
        """The threads `tids` at this priority and on these cores, as `apply`. Local."""
        problems = [apply_to_threads(tids, self.mode),
                    set_cores(tids, self.cores) if self.cores is not None else None]
        return "; ".join(p for p in problems if p) or None


def set_cores(tids, cores) -> str | None:
    """Keep the threads `tids` (0: the calling one; of this process or another) on `cores`;
    None when done, else why not for each that refused. Local."""
    problems = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except (OSError, AttributeError) as e:
            problems.append(f"cores of thread {tid or 'self'}: {e}")
    return "; ".join(problems) or None


def setting_mode(mode: str) -> str:
    """`mode` when it names a mode; ValueError naming the choices otherwise. Local."""
    setting(mode)
    return mode


def setting(mode: str) -> Setting:
    """The scheduler policy and I/O class of `mode`; ValueError naming the choices. Local."""
    if mode == "idle":
        return Setting(os.SCHED_IDLE, IOPRIO_CLASS_IDLE, 0)
    if mode == "low":
        return Setting(os.SCHED_BATCH, IOPRIO_CLASS_BE, 7)
    if mode == "normal":
        return Setting(os.SCHED_OTHER, IOPRIO_CLASS_BE, 4)
    raise ValueError(f"--ckpt-background must be one of {', '.join(MODES)}, got {mode!r}")


def threads_of(pid: int) -> list[int]:
    """The thread ids of process `pid` (just `pid` where /proc is missing). Local."""
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return [pid]


def apply(pid: int, mode: str) -> str | None:
    """Give every thread of process `pid` the priority of `mode`; None when done, else why
    not (the process keeps running as it was). Local."""
    return apply_to_threads(threads_of(pid), mode)


def apply_to_threads(tids: list[int], mode: str) -> str | None:
    """Give the threads `tids` (of this process or another) the priority of `mode`, as
    `apply` does. Local."""
    want = setting(mode)
    problems = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, want.policy, os.sched_param(0))
        except (OSError, AttributeError) as e:
            problems.append(f"scheduler of thread {tid}: {e}")
        err = _ioprio_set(tid, want.io_class, want.io_level)
        if err:
            problems.append(f"I/O priority of thread {tid}: {err}")
    return "; ".join(problems) or None


def current(tid: int) -> tuple[int, int | None]:
    """(scheduler policy, I/O class or None where unknown) of thread `tid`. Local."""
    return os.sched_getscheduler(tid), _ioprio_class(tid)


def _syscall(index: int):
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or not hasattr(os, "sched_setscheduler"):
        return None, None
    return ctypes.CDLL(None, use_errno=True).syscall, numbers[index]


def _ioprio_set(tid: int, io_class: int, level: int) -> str | None:
    call, number = _syscall(0)
    if call is None:
        return f"no ioprio_set on {platform.machine()}"
    if call(number, IOPRIO_WHO_PROCESS, tid, (io_class << IOPRIO_CLASS_SHIFT) | level) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def _ioprio_class(tid: int) -> int | None:
    call, number = _syscall(1)
    if call is None:
        return None
    value = call(number, IOPRIO_WHO_PROCESS, tid)
    return None if value < 0 else value >> IOPRIO_CLASS_SHIFT
