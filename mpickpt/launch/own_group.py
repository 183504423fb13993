"""The launcher (mpiexec, mpirun, srun) in a process group of its own, dying with `mpickpt-run`.

Why: a terminal's Ctrl-C, or any signal sent to `mpickpt-run`'s whole process group, reached the
launcher directly and again through `mpickpt-run`'s forwarding; hydra takes a second SIGINT for
"Ctrl-C again", a forced abort without the emergency checkpoint. In a group of its own the
launcher hears of a stop only from `mpickpt-run`, once. It must not outlive `mpickpt-run` then (a
SIGKILL of `mpickpt-run`'s group no longer reaches it, and a launcher left running would go on
training into the same checkpoint directory as the next job): `mpickpt-run` starts this shim in
the new group, which asks the kernel to SIGKILL it when `mpickpt-run` dies and then execs the
launcher (the request outlives the exec). Local.
"""
from __future__ import annotations

import os
import sys

from mpickpt.background import die_with_parent

POPEN = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
"""`subprocess.Popen` arguments that start the shim in a process group of its own."""


def command(launcher: list[str]) -> list[str]:
    """The command that runs `launcher` through this shim, bound to this process. Local."""
    return [sys.executable, "-m", "mpickpt.launch.own_group", str(os.getpid()), *launcher]


def main(argv: list[str]) -> None:
    """`<parent pid> <launcher command...>`: die with the parent, become the launcher."""
    die_with_parent(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
