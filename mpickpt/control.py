"""StoreControl: the job's control channel (votes, barriers, gathers, commit reports) on a gloo
process group and the rendezvous TCPStore, with the method names of the mpi4py calls it replaced.

Why not MPI: without ULFM (the pip MPICH cannot run it) an MPI collective waits forever once a peer
is gone, and a process started to replace a dead rank cannot join the MPI job at all. A gloo group
raises as soon as a peer's connection closes and can be aborted from another thread, and each
generation of the job (`mpickpt.generation`) gets a new one over the same store. MPI now serves
only to start the job.

Objects travel pickled. Reductions (`allreduce`, `Allreduce`) take the op names below. Point-to-
point messages (`isend`, `iprobe`, `recv`) go through the store: a sender numbers its message with
an atomic counter per (destination, tag), the receiver takes them in that order, so no message
waits for its receiver to be inside a call. A TCPStore client is not for two threads at once (a
blocking `wait` on one holds the connection that another thread's `set` needs: measured here as a
30 s timeout in one run of three), so a process calls its channel from one thread. Every method
but `isend`, `iprobe`, `recv`, `Get_rank` and `Get_size` is collective over the generation's
ranks.
"""
from __future__ import annotations

import datetime
import pickle
import time

import numpy as np
import torch
import torch.distributed as dist

from mpickpt.interruptible import Interruptible

MAX, MIN, SUM, LAND, LOR = "max", "min", "sum", "land", "lor"
_PYTHON_OPS = {MAX: max, MIN: min, SUM: lambda a, b: a + b,
               LAND: lambda a, b: bool(a) and bool(b), LOR: lambda a, b: bool(a) or bool(b)}
_TENSOR_OPS = {MAX: dist.ReduceOp.MAX, MIN: dist.ReduceOp.MIN, SUM: dist.ReduceOp.SUM}


def reduce_op(op) -> str:
    """The op's name; accepts the names above, their upper-case forms ('MAX', as the callers that
    spoke MPI used) and mpi4py's op objects. Local."""
    name = op if isinstance(op, str) else getattr(op, "name", None) or _mpi_op_name(op)
    name = name.lower()
    if name not in _PYTHON_OPS:
        raise ValueError(f"reduction {op!r}: expected one of {', '.join(_PYTHON_OPS)}")
    return name


def _mpi_op_name(op) -> str:
    from mpi4py import MPI  # only reached by a caller that passed an MPI op object

    for name in ("MAX", "MIN", "SUM", "LAND", "LOR"):
        if op == getattr(MPI, name):
            return name
    raise ValueError(f"reduction {op!r}: not an op this control channel knows")


class _Sent:
    """The request of an `isend`: the message is in the store once `isend` returns."""

    @staticmethod
    def Test() -> bool:  # noqa: N802 (mpi4py's name)
        return True

    def wait(self) -> None:
        return None


class _Reduction:
    """The request of an `Iallreduce`."""

    def __init__(self, control, work, tensor: torch.Tensor, recvbuf: np.ndarray):
        self.control, self.work, self.tensor, self.recvbuf = control, work, tensor, recvbuf

    def Wait(self) -> np.ndarray:  # noqa: N802 (mpi4py's name)
        """Wait (an abort of the channel ends the wait) and fill the receive buffer."""
        if self.work is not None:
            self.control._wait(self.work)
            self._take()
        return self.recvbuf

    def Finished(self) -> np.ndarray | None:  # noqa: N802 (as Wait)
        """The filled receive buffer if the reduction has completed, even on a channel aborted
        since (its result stands: every rank took part); None while it runs. Raises the
        operation's own error. Local."""
        if self.work is not None:
            if not self.work.is_completed():
                return None
            self.work.wait()
            self._take()
        return self.recvbuf

    def _take(self) -> None:
        self.recvbuf[...] = self.tensor.numpy()
        self.work = None


class StoreControl:
    """The control channel of one generation. Construction is collective (the gloo group's
    rendezvous over `store`)."""

    def __init__(self, store, prefix: str, rank: int, size: int, timeout_s: float = 300.0):
        self.store, self.prefix, self.rank, self.size = store, prefix, rank, size
        self.interrupt = Interruptible(sliced=True, what=f"control channel {prefix!r}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix + "pg/", store), rank, size,
                                        timeout)
        self._next_in: dict[int, int] = {}
        self.closed = False

    # ---- mpi4py's names ----------------------------------------------------------------------
    def Get_rank(self) -> int:  # noqa: N802
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Barrier(self) -> None:  # noqa: N802
        self._wait(self._group().barrier())

    def bcast(self, obj=None, root: int = 0):
        payload = _pickle(obj) if self.rank == root else None
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._wait(self._group().broadcast([size], opts))
        buf = payload if payload is not None else torch.empty(int(size[0]), dtype=torch.uint8)
        if int(size[0]):
            self._wait(self._group().broadcast([buf], opts))
        return obj if self.rank == root else _unpickle(buf)

    def allgather(self, obj) -> list:
        payload = _pickle(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(self._group().allgather([sizes], [torch.tensor([len(payload)],
                                                                  dtype=torch.int64)]))
        longest = max(int(s[0]) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:len(payload)] = payload
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self._group().allgather([parts], [padded]))
        return [_unpickle(p[:int(s[0])]) for p, s in zip(parts, sizes)]

    def gather(self, obj, root: int = 0):
        """Every rank's object on `root` (None elsewhere). Built on allgather: the control
        channel carries small objects and per-table parts, not the data plane."""
        everyone = self.allgather(obj)
        return everyone if self.rank == root else None

    def allreduce(self, obj, op=SUM):
        fn = _PYTHON_OPS[reduce_op(op)]
        values = self.allgather(obj)
        out = values[0]
        for v in values[1:]:
            out = fn(out, v)
        return out

    def Allreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op=SUM) -> None:  # noqa: N802
        """Elementwise reduction of a numeric array into `recvbuf` (MAX, MIN, SUM)."""
        self.Iallreduce(sendbuf, recvbuf, op).Wait()

    def Iallreduce(self, sendbuf: np.ndarray, recvbuf: np.ndarray, op=SUM) -> "_Reduction":  # noqa: N802
        """Start `Allreduce`; the request's Wait() fills `recvbuf`. It runs on gloo's threads
        meanwhile, in the order the ranks issued their collectives on this channel."""
        name = reduce_op(op)
        if name not in _TENSOR_OPS:
            raise ValueError(f"Allreduce {name}: arrays take max, min or sum")
        t = torch.from_numpy(np.ascontiguousarray(sendbuf).copy())
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TENSOR_OPS[name]
        return _Reduction(self, self._group().allreduce([t], opts), t, recvbuf)

    # ---- messages through the store (local) ----------------------------------------------------
    def isend(self, obj, dest: int, tag: int = 0) -> _Sent:
        n = self.store.add(self._mailbox(dest, tag) + "n", 1)
        self.store.set(self._mailbox(dest, tag) + str(n), _pickle(obj).numpy().tobytes())
        return _Sent()

    def iprobe(self, tag: int = 0) -> bool:
        """True if the next message for this rank with `tag` has arrived."""
        return self.store.check([self._next_key(tag)])

    def recv(self, tag: int = 0):
        """The next message for this rank with `tag`, waiting for it; an abort from another
        thread ends the wait (GenerationAborted: the sender may be dead). The store is polled
        (1 ms, backing off to 20 ms): TCPStore's own wait with a timeout logs a warning per
        slice."""
        key = self._next_key(tag)
        pause = 0.001
        while not self.store.check([key]):
            self.interrupt.check()
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        data = self.store.get(key)
        self.store.delete_key(key)
        self._next_in[tag] = self._next_in.get(tag, 1) + 1
        return pickle.loads(data)

    def _mailbox(self, dest: int, tag: int) -> str:
        return f"{self.prefix}mail/{dest}/{tag}/"

    def _next_key(self, tag: int) -> str:
        return self._mailbox(self.rank, tag) + str(self._next_in.get(tag, 1))

    # ---- life cycle -----------------------------------------------------------------------------
    def _group(self):
        """The gloo group, or GenerationAborted once the channel is aborted: an aborted group of
        one rank would otherwise still complete its collectives."""
        self.interrupt.check()
        return self.pg

    def _wait(self, work) -> None:
        """Wait for a collective of this channel; an abort from another thread ends the wait."""
        self.interrupt.wait(work)

    def abort(self) -> None:
        """Make every call in progress or to come on this channel raise. Local; any thread."""
        if not self.closed:
            self.closed = True
            self.interrupt.abort()
            try:
                self.pg.abort()
            except RuntimeError:
                pass

    def Free(self) -> None:  # noqa: N802
        """Release the group. Local."""
        self.abort()


def _pickle(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                            dtype=torch.uint8)


def _unpickle(buf: torch.Tensor):
    return pickle.loads(buf.numpy().tobytes())
