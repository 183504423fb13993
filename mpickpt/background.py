"""Background worker processes shared by the checkpoint writers and the IncrCP extractor.

A worker is a `spawn`ed child (never `fork`: HDF5 and torch state do not survive a fork) that
serves jobs from a pipe until it receives None or the pipe closes, and dies with its parent
(`PR_SET_PDEATHSIG`), so a killed rank leaves no worker behind that could finish a stale file
later. Worker entry points must live in modules that never import mpi4py (a spawned child that
initialises MPI can hang the job) and should not import torch (start-up time). Local: nothing here
uses MPI.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.util  # noqa: F401  (its exit hook must be registered before `_reap`)
import os
import re
import signal
import sys
import threading
import time
import weakref

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies; exit now if it already has.
    Call first thing in a worker. Local."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent_pid:
        os._exit(1)


JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
"""What a terminal, a launcher or a scheduler sends to a job's whole process group or step:
Ctrl-C, a time limit, scancel, --signal=USR1@T, a closed terminal."""


def ignore_job_signals() -> None:
    """A signal aimed at the training job must not kill a worker in the middle of a file: its
    rank decides when the worker stops (and SIGKILL still ends it, as Slurm does KillWait
    seconds after SIGTERM). Call in the worker. Local."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


READY = "mpickpt-worker-ready"
"""A worker's first message: it imported what it needs and serves jobs from now on."""
START_TIMEOUT = 120.0
"""Seconds a worker may take to start (a cold import of h5py on a busy node takes a few)."""


class WorkerStartError(RuntimeError):
    """A background process died, or hung, before it could serve: the message says why."""


GONE = (EOFError, BrokenPipeError, ConnectionResetError)
"""What the pipe raises once the rank at its other end is gone (killed)."""


def serve(conn, handle) -> None:
    """Say READY, then answer each job received on `conn` with `handle(job)` until None or a
    closed pipe. A rank gone meanwhile (killed: its pipe is closed or reset) ends the loop
    quietly, with no traceback. Local."""
    if not _send(conn, READY):
        return
    while True:
        try:
            job = conn.recv()
        except GONE:
            return
        if job is None or not _send(conn, handle(job)):
            return


def _send(conn, message) -> bool:
    """Whether `message` went; False when the rank is gone. Local."""
    try:
        conn.send(message)
        return True
    except GONE:
        return False


HDF5_IO_DETAIL = re.compile(r"\(([^()]*?)(?:: time = [^()]*?)?error message = '([^']*)'[^()]*\)",
                            re.S)
"""HDF5's low-level I/O detail in h5py's messages ("(file write failed: time = <ctime, with a
newline>, filename = ..., errno = 28, error message = '...', buf = ..., offset = ...)")."""


def error_line(e: BaseException) -> str:
    """`e` as one line for a worker's failed result: HDF5's I/O detail cut to what failed and
    the system's reason, and the reason added where the errno is known but unsaid. Local."""
    text = f"{type(e).__name__}: {e}"
    text = HDF5_IO_DETAIL.sub(lambda m: f"({m.group(1).strip(' ,')}: {m.group(2)})", text)
    text = " ".join(text.split())
    errno = getattr(e, "errno", None)
    if isinstance(errno, int) and errno > 0 and os.strerror(errno) not in text:
        text += f" ({os.strerror(errno)})"
    return text


def start_worker(target, name: str, *args):
    """Spawn `target(conn, parent_pid, *args)` as a daemon child; returns (process, our end of
    the pipe). The job's signals are ignored while it starts, so that it, and the resource
    tracker multiprocessing starts beside the first worker, inherit that: a launcher's SIGUSR1
    (MPICH's hydra notifies survivors of a dead rank with it) must not kill the tracker, whose
    death made hydra kill the survivor. Local."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, os.getpid(), *args), daemon=True, name=name)
    with _job_signals_ignored():
        proc.start()
    child.close()
    _started.add(proc)
    await_ready(proc, parent, name)
    return proc, parent


def await_ready(proc, conn, name: str, timeout: float = START_TIMEOUT) -> None:
    """Block until the worker says READY; WorkerStartError naming the cause if it dies first (a
    failed import, a script without a main guard) or takes longer than `timeout`. Local."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if conn.poll(0.05):
                first = conn.recv()
                if first == READY:
                    return
                raise WorkerStartError(f"{name}: expected {READY!r} from the new process, got "
                                       f"{first!r}")
        except (EOFError, OSError):
            proc.join(5.0)
            raise WorkerStartError(start_failure(name, proc.exitcode)) from None
        if not proc.is_alive() and not conn.poll(0):
            raise WorkerStartError(start_failure(name, proc.exitcode))
        if time.monotonic() > deadline:
            proc.kill()
            raise WorkerStartError(f"background process {name} did not start within {timeout:.0f} "
                                   f"s")


def start_failure(name: str, code) -> str:
    """Why a spawned worker died before serving, with the likely cause. Local."""
    text = (f"background process {name} exited with status {code} before it could start (its "
            f"own traceback is above)")
    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script and getattr(main, "__spec__", None) is None:
        text += (f". Spawned processes import the main script, {script}: without an `if __name__ "
                 f"== '__main__':` guard around the code that creates the CheckpointManager (or "
                 f"anything else that starts mpickpt's background processes), each of them runs "
                 f"that code again and fails. Put it under the guard")
    return text


_started: "weakref.WeakSet" = weakref.WeakSet()
"""Every worker this process started (a process object, not a global state: `_reap` only)."""


@atexit.register
def _reap() -> None:
    """At interpreter exit, kill the workers still running: an exit on an error can leave them
    unclosed, and multiprocessing's own exit hook (registered earlier, by the import of
    multiprocessing.util above, so run after this one) would end them with SIGTERM, which they
    ignore, and then wait for them forever. A part left
    half written is a temporary file, never a committed checkpoint. Local."""
    for proc in list(_started):
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


@contextlib.contextmanager
def _job_signals_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in JOB_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
