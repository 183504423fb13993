"""StopSignals: SIGTERM, SIGUSR1 and SIGINT ask the job to stop at a step boundary and save.

Schedulers end jobs with signals: Slurm sends SIGTERM at a time limit, at `scancel` and at
preemption (and SIGKILL `KillWait` seconds later, 30 s by default); `--signal=USR1@T` sends SIGUSR1
T seconds before the limit; a user at a terminal sends SIGINT. The handler only records the
signal; the trainer agrees with every other rank at the next step boundary (the stop vote rides
the step's dense allreduce) and writes an emergency checkpoint there, committed before the
process exits with `EXIT_SAVED` (`EXIT_SAVE_FAILED` when that commit failed). A second SIGINT
stops at once (the usual Ctrl-C twice).
Background writers and the extractor ignore these signals (`mpickpt.background`), so a signal
sent to the whole job does not kill a file in the middle. Local.
"""
from __future__ import annotations

import os
import signal
import time

from mpickpt.exit_codes import EXIT_SAVE_FAILED, EXIT_SAVED  # noqa: F401 (its outcomes)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_DEFAULTS = {signal.SIGINT: signal.default_int_handler}
"""Python's own dispositions at start where they are not SIG_DFL (Ctrl-C: KeyboardInterrupt)."""
NOTICES_VARIABLE = "MPICKPT_SIGUSR1_NOTICES"
"""Set by `mpickpt-run` to "0" where the launcher sends no SIGUSR1 death notices (srun, Open
MPI): every SIGUSR1 is then a stop (Slurm's `--signal=USR1@T` before the time limit), never
muted. Unset or "1": MPICH's hydra, which sends one to every rank when a rank exits."""


def stop_failed_message(name: str, step: int, last_valid: int | None, directory: str) -> str:
    """What a rank 0 says when the emergency checkpoint of `step` did not commit. Local, pure."""
    last = f"step {last_valid}" if last_valid is not None else "none"
    return (f"stopping on {name} after step {step}: the emergency checkpoint of step {step} "
            f"FAILED (it was not committed; see the messages above); the last valid "
            f"checkpoint in {directory}: {last}; exit status {EXIT_SAVE_FAILED}")


class StopSignals:
    """The first stop signal received (name and time), while installed. Local."""

    def __init__(self, environ=None):
        """`environ` (default os.environ) says whether the launcher sends SIGUSR1 as a death
        notice (NOTICES_VARIABLE)."""
        environ = os.environ if environ is None else environ
        self.launcher_notices = environ.get(NOTICES_VARIABLE, "1") != "0"
        self.received: str | None = None
        self.at: float | None = None
        self._previous = {}
        self.muted_until = 0.0
        self.muted: list[float] = []
        """Arrival times (perf_counter) of the SIGUSR1s taken for a launcher's death notice."""

    def install(self, restore_defaults: bool = False) -> "StopSignals":
        """Take over the stop signals (main thread only). `restore_defaults`: `uninstall`
        gives back the default dispositions instead of the ones found (a replacement is born
        ignoring them; the handlers replace SIG_IGN directly, with no moment at the defaults
        when a stop would kill it). Local."""
        for sig in SIGNALS:
            found = signal.signal(sig, self._handle)
            self._previous[sig] = _DEFAULTS.get(sig, signal.SIG_DFL) if restore_defaults \
                else found
        return self

    def mute_death_notices(self, seconds: float, looking_back: float = 2.0) -> None:
        """A peer just died and the job recovers in place: MPICH's hydra sends SIGUSR1 to every
        rank when a rank's PMI connection closes, which is no request to stop. Forget a SIGUSR1
        that arrived in the last `looking_back` seconds and ignore those of the next `seconds`.
        SIGTERM and SIGINT are never muted, nor is SIGUSR1 under a launcher that sends no such
        notices. Local; any thread."""
        if not self.launcher_notices:
            return
        now = time.perf_counter()
        self.muted_until = max(self.muted_until, now + seconds)
        if self.received == "SIGUSR1" and self.at is not None and self.at >= now - looking_back:
            self.muted.append(self.at)
            self.received, self.at = None, None

    def notices_only(self) -> None:
        """From now on every SIGUSR1 is a launcher's death notice, never a stop: under in-place
        recovery with hydra, where a process of the job dying (a waiting hot spare included,
        whose death no peer watch reports) makes hydra send it to every rank. A no-op under a
        launcher that sends no such notices (srun: SIGUSR1 stays the time limit's stop).
        Local."""
        if self.launcher_notices:
            self.muted_until = float("inf")

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGUSR1 and time.perf_counter() < self.muted_until:
            self.muted.append(time.perf_counter())
            return
        if self.received is not None and signum == signal.SIGINT:
            os._exit(128 + signum)  # a second Ctrl-C: stop now
        if self.received is None:
            self.received, self.at = signal.Signals(signum).name, time.perf_counter()

    @property
    def requested(self) -> bool:
        return self.received is not None

    def since(self) -> float:
        """Seconds since the signal arrived. Local."""
        return time.perf_counter() - self.at if self.at is not None else 0.0

    def uninstall(self) -> None:
        """Give the signals back, except that SIGUSR1 stays ignored where it had its default
        (ending the process): MPICH's hydra under -disable-auto-cleanup sends it to every rank
        still running each time a rank's PMI connection closes, a normal exit included, and a
        rank that is only finishing must not die of it. Local. Safe twice."""
        for sig, handler in self._previous.items():
            keep = sig == signal.SIGUSR1 and handler in (signal.SIG_DFL, None)
            signal.signal(sig, signal.SIG_IGN if keep else handler)
        self._previous = {}
