"""Background worker processes shared by the checkpoint writers and the IncrCP extractor.

A worker is a `spawn`ed child (never `fork`: HDF5 and torch state do not survive a fork) that
serves jobs from a pipe until it receives None or the pipe closes, and dies with its parent
(`PR_SET_PDEATHSIG`), so a killed rank leaves no worker behind that could finish a stale file
later. Worker entry points must live in modules that never import mpi4py (a spawned child that
initialises MPI can hang the job) and should not import torch (start-up time). Local: nothing here
uses MPI.
"""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal

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


def ignore_job_signals() -> None:
    """A Ctrl-C aimed at the training job must not kill a worker in the middle of a file: its
    rank decides when the worker stops. Call in the worker. Local."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def serve(conn, handle) -> None:
    """Answer each job received on `conn` with `handle(job)` until None or a closed pipe. Local."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(handle(job))


def start_worker(target, name: str, *args):
    """Spawn `target(conn, parent_pid, *args)` as a daemon child; returns (process, our end of
    the pipe). Local."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, os.getpid(), *args), daemon=True, name=name)
    proc.start()
    child.close()
    return proc, parent
