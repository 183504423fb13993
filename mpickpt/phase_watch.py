"""PhaseWatch: a deadline on a phase of a trainer's life that no peer-death detector covers.

Before the first step nothing watches the job yet: a peer that dies inside MPI_Init leaves the
others waiting there forever (MPICH has no fault tolerance here), and after the last step a peer
that dies leaves the others in MPI_Finalize's PMI read. A watch is a daemon thread with a
deadline: if the phase has not ended by then, it says which phase hung and ends the process at
once with the phase's status (`os._exit`: no MPI_Finalize, no interpreter teardown that could
wait on the dead peer), so the launcher's run ends and `mpickpt-run` relaunches.

A thread needs the GIL, and a C call may hold it while it waits: MPI_Init does (measured: mpi4py's
`MPI.Init` with a stopped peer starves every Python thread). So each watch also arms
`faulthandler`'s C watchdog `BACKSTOP` seconds after its own deadline: it needs no GIL, writes
every thread's stack to stderr (where it hung) and ends the process with status 1. faulthandler
has one such watchdog per process, so one watch runs at a time. Local.
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

HOOK_LIMIT = 5.0
"""Seconds the exit hooks may take once a deadline has passed (they may wait on the stuck phase)."""
POLL_S = 0.5
"""Seconds between two questions to `abandoned`."""
BACKSTOP = HOOK_LIMIT + 3.0
"""Seconds after the deadline at which faulthandler ends a process whose Python threads cannot
run."""


class PhaseWatch:
    """One deadline over named phases (`phase` moves on, `end` disarms). Local; any thread."""

    def __init__(self, what: str, limit_s: float, status: int, say=None, before_exit=None,
                 abandoned=None):
        """`before_exit`: run (at most `HOOK_LIMIT` seconds, on a thread of its own) before the
        process ends on an expired deadline, e.g. the exit hooks that stop background
        workers. `abandoned()`: asked every `POLL_S` seconds; a reason (str) ends the process
        at once as a passed deadline does: the job gave up on what this phase waits for (a
        replacement stuck in a group's rendezvous after the survivors fell back to a
        relaunch)."""
        if not limit_s > 0:
            raise ValueError(f"{what} deadline {limit_s!r}: expected seconds > 0")
        self.what, self.limit_s, self.status = what, float(limit_s), status
        self.say = say or (lambda m: print(f"mpickpt: {m}", file=sys.stderr, flush=True))
        self.current = "start"
        self.before_exit, self.abandoned = before_exit, abandoned
        self.started = time.monotonic()
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"mpickpt-{what}-watch",
                                        daemon=True)
        self._thread.start()
        faulthandler.dump_traceback_later(self.limit_s + BACKSTOP, exit=True)

    def phase(self, name: str) -> None:
        """The phase the process enters now (named in the message if the deadline passes)."""
        self.current = name

    def end(self) -> float:
        """Disarm; returns the seconds the watched phases took."""
        self._ended.set()
        faulthandler.cancel_dump_traceback_later()
        return time.monotonic() - self.started

    def _watch(self) -> None:
        deadline = self.started + self.limit_s
        why = None
        while why is None:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"did not finish within {self.limit_s:g} s"
            elif self._ended.wait(min(left, POLL_S) if self.abandoned else left):
                return
            elif self.abandoned is not None:
                reason = self._abandoned()
                why = f"was abandoned ({reason})" if reason else None
        self.say(f"{self.what} {why} (stuck in {self.current}); ending this process with "
                 f"status {self.status}")
        if self.before_exit is not None:
            hooks = threading.Thread(target=self.before_exit, daemon=True)
            hooks.start()
            hooks.join(HOOK_LIMIT)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(self.status)

    def _abandoned(self) -> str | None:
        try:
            return self.abandoned()
        except Exception as e:  # noqa: BLE001 (a failed question is no reason to end)
            self.say(f"{self.what}: could not ask whether it was abandoned: {e}")
            self.abandoned = None
            return None
