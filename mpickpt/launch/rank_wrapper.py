"""`python -m mpickpt.launch.rank_wrapper CMD...`: run one rank's command as a child and exit
with its status, never by a signal.

MPICH's hydra proxy SIGKILLs every rank of its node at its next event (any line of output) once
it reaps a rank that a signal ended, `-disable-auto-cleanup` or not; a rank that exits with a
status only makes it send SIGUSR1 to the others. The survivors of a killed rank need a moment to
undo their step and dump their state, so `mpickpt-run` starts each rank under this wrapper: a rank
killed by signal N becomes a wrapper exiting with 128 + N. The wrapper shares the rank's process
group, so the launcher's signals reach the rank directly; the wrapper itself only outlives them
(forwarding them would deliver each twice: a second SIGINT stops a rank at once). Local.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from mpickpt.background import JOB_SIGNALS


def main(argv=None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv)
    if not cmd:
        print("usage: python -m mpickpt.launch.rank_wrapper COMMAND [ARGS...]", file=sys.stderr)
        return 2
    for sig in JOB_SIGNALS:  # a handler, not SIG_IGN: the rank starts with default dispositions
        signal.signal(sig, _outlive)
    child = subprocess.Popen(cmd, close_fds=False)  # PMI_FD and the like go to the rank
    _close_pmi_fd()
    status = child.wait()
    sys.stdout.flush()
    sys.stderr.flush()
    # at once: an interpreter shutting down restores the default dispositions, and a SIGUSR1
    # meant for the rank would then end the wrapper by a signal after all
    os._exit(status if status >= 0 else 128 - status)


def _close_pmi_fd() -> None:
    """The rank owns the PMI connection; a copy held here would outlive its MPI_Finalize."""
    fd = os.environ.get("PMI_FD", "")
    if fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def _outlive(signum, frame) -> None:
    """The signal went to the whole process group: the rank has it and decides."""


if __name__ == "__main__":
    sys.exit(main())
