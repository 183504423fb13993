"""A node agent's warm standby (`--warm-respawn`): a process started with the trainer's command
that imports torch and mpickpt and warms up (`mpickpt.spares.warm_up`) while its trainer trains,
then waits on its standard input. When the trainer is killed, the agent hands the standby the
dead trainer's place in one line (the `MPICKPT_REPLACES` value and the store's address) and it
goes on as that replacement (`mpickpt.train.replacement_main`), without the seconds of Python and
torch start that a process started after the death pays. At the agent's end its input closes
and it leaves with status 0. It dies with its agent (parent-death signal), and is started only
after the trainer's startup (not to slow it) and again a while after it took over (not to slow
the recovery). Local: the agent's side.
"""
from __future__ import annotations

import subprocess
import time

STANDBY_VARIABLE = "MPICKPT_STANDBY"
"""Set for a standby process: wait on standard input for a rank to take over."""
WARM_VARIABLE = "MPICKPT_WARM_RESPAWN"
"""Set by `mpickpt-run` when the trainer flags ask for --warm-respawn: the agents keep one."""
RESTART_DELAY_S = 10.0
"""Seconds after a standby took over before the agent starts the next one."""


class Standby:
    """The agent's warm standby, if any. Local."""

    def __init__(self, cmd: list[str], env: dict, preexec_fn=None):
        self.cmd, self.env, self.preexec_fn = cmd, env, preexec_fn
        self.proc: subprocess.Popen | None = None
        self._took_over_at: float | None = None

    def due(self) -> bool:
        """Whether to start a standby now: none alive, and the last one took over long enough
        ago. Local."""
        if self.proc is not None and self.proc.poll() is None:
            return False
        return self._took_over_at is None or \
            time.monotonic() - self._took_over_at > RESTART_DELAY_S

    def start(self) -> int:
        """Start one; returns its pid. Local."""
        env = dict(self.env, **{STANDBY_VARIABLE: "1"})
        self.proc = subprocess.Popen(self.cmd, env=env, stdin=subprocess.PIPE,
                                     preexec_fn=self.preexec_fn)
        return self.proc.pid

    def take_over(self, replaces: str, store: str) -> subprocess.Popen | None:
        """Hand the standby the dead trainer's place; the process that now trains, or None if
        no standby lives (the caller starts a replacement the slow way). Local."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return None
        try:
            proc.stdin.write(f"{replaces} {store}\n".encode())
            proc.stdin.close()
        except OSError:  # it died just now
            return None
        self._took_over_at = time.monotonic()
        return proc

    def drop(self) -> None:
        """The agent ends: the standby leaves (its input closes), or is killed after 10 s.
        Local."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def read_assignment(stream) -> tuple[str, str] | None:
    """In the standby: wait for the agent's line; (replaces, store address), or None when the
    agent ended (end of input). Local."""
    line = stream.readline()
    if isinstance(line, bytes):
        line = line.decode()
    parts = line.split()
    return (parts[0], parts[1]) if len(parts) == 2 else None
