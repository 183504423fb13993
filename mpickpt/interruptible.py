"""Interruptible waits on a generation's collectives.

torch's gloo cannot cancel a collective in flight: `abort()`, `shutdown()` and destroying the group,
on this rank or on its peers, leave an operation waiting (measured on torch 2.13). Gloo raises only
on a rank whose own socket to the dead process closed. In a ring all-reduce that is the dead rank's
two neighbours; a survivor further round the ring waits for data from a live neighbour that has
already given up, forever. So the collectives of a generation are started with `async_op=True` and
waited on in short slices (`Work.wait(timeout)` raises "timed out" and leaves the operation
running); between slices the waiter looks at its generation's abort flag, which the peer watch sets
the moment a death is known, and raises `GenerationAborted`. The operation left behind never
completes; its group is retired, not destroyed (a destructor would join the stuck worker thread),
and the process leaves with `os._exit` once its generation changed.

NCCL needs none of this: `abort()` (ncclCommAbort) ends its kernels, and `Work.wait` there only
orders the streams, so a timed wait would make the host wait for the device on every call.
"""
from __future__ import annotations

import datetime
import threading

SLICE_S = 0.1
"""Seconds per wait slice: the longest an aborted wait goes on before it notices the abort. A
finished operation ends its wait at once, whatever the slice."""


_TIMED_OUT = "Operation timed out"
"""What `Work.wait(timeout)` raises when the slice ends before the operation (c10d's Work::wait);
gloo's own deadline says "Timed out waiting ...", which is a real failure."""


class GenerationAborted(RuntimeError):
    """A collective of a generation that a peer's death ended (a RuntimeError, as gloo's own
    errors are, so callers that survive a peer's death treat both alike)."""


class Interruptible:
    """The abort flag of one generation and the waits that obey it. Local; `abort` is safe from
    any thread and twice."""

    def __init__(self, sliced: bool, what: str = "generation"):
        """`sliced`: wait in slices (gloo); False: a plain wait (NCCL, whose abort ends it)."""
        self.sliced, self.what = sliced, what
        self._aborted = threading.Event()
        self._slice = datetime.timedelta(seconds=SLICE_S)

    @property
    def aborted(self) -> bool:
        return self._aborted.is_set()

    def abort(self) -> None:
        self._aborted.set()

    def check(self) -> None:
        """Raise GenerationAborted if the generation was aborted. Local."""
        if self._aborted.is_set():
            raise GenerationAborted(f"{self.what} was aborted: a peer died")

    def wait(self, work) -> None:
        """Wait for `work` (a torch.distributed Work) to finish; raise GenerationAborted once the
        generation is aborted, or the operation's own error. Local (the operation it waits for
        is collective)."""
        self.check()
        if not self.sliced:
            work.wait()
            return
        while True:
            try:
                work.wait(timeout=self._slice)
                return
            except RuntimeError as e:
                if _TIMED_OUT not in str(e):  # the operation's own error (a closed connection)
                    raise
            self.check()
