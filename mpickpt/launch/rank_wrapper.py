"""`python -m mpickpt.launch.rank_wrapper CMD...`: the node agent of one rank. It runs the rank's
trainer as a child, outlives it, and exits with its status, never by a signal.

Two jobs:
- **Deaths by a signal become exit statuses.** MPICH's hydra proxy SIGKILLs every rank of its node
  at its next event once it reaps a rank that a signal ended, `-disable-auto-cleanup` or not; a
  rank that exits with a status only makes it send SIGUSR1 to the others. The wrapper is what
  hydra started, so a trainer killed by signal N shows as a wrapper exiting with 128 + N. The
  wrapper shares the rank's process group, so the launcher's signals reach the rank directly; it
  only outlives them (forwarding them would deliver each twice: a second SIGINT stops a rank at
  once).
- **A death during startup ends the job at once.** Until its trainer says it has started (a file
  `started` in the agent's folder, written once the model is built and restored), a trainer
  killed by a signal is a failed start: the others would wait for it in MPI_Init or in the
  groups' rendezvous forever. The agent then ends by the same signal, which makes hydra's proxy
  kill the node's ranks, and the run ends for `mpickpt-run` to relaunch (the trainers' own
  startup deadline, `mpickpt.phase_watch`, covers what this does not reach).
- **Leftover shared memory.** MPI's node-local segments (`/dev/shm/mpich_shm_*`, ...) that
  appeared while the agent ran and that no process holds any more are deleted when it ends: a
  killed rank, or a generation that skipped MPI_Finalize, leaves them behind.
- **In-place recovery** (`MPICKPT_IN_PLACE=1`, set by `mpickpt-run`, which hosts the run's
  rendezvous store and agent watch, `mpickpt.launch.run_store`): every agent tells the watch it
  lives, and starts a replacement when its trainer is killed by a signal: the same command,
  without MPI, told which rank it replaces (`MPICKPT_REPLACES`) and where the store is. The
  replacement joins the survivors' next generation (`mpickpt.generation`). A trainer that exits
  with a status (done, bad input, stopped on a signal, or a survivor leaving for a relaunch) is
  not replaced.
- **The trainer dies with its agent** (a parent-death signal, SIGKILL): a killed agent (or its
  lost node) takes its trainer along, instead of leaving an orphan that trains on while the
  launcher counts its rank gone. The survivors then see one death, and the agent watch tells
  them that no respawn will come for it.
Local.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from mpickpt.background import JOB_SIGNALS
from mpickpt.job_variables import AGENTS_VARIABLE, STORE_VARIABLE
from mpickpt.launch.run_store import announce, goodbye, no_respawn
from mpickpt.launch.standby import WARM_VARIABLE, Standby
from mpickpt.owned_names import owned_name, remove_stale
from mpickpt.stop_signals import SIGNALS as STOP_SIGNALS

IN_PLACE_VARIABLE = "MPICKPT_IN_PLACE"
AGENT_VARIABLE = "MPICKPT_AGENT_DIR"
"""Set by the agent for its trainer: a folder of the agent's where the trainer says it started."""
STARTED_FILE = "started"
"""Written by the trainer into the agent's folder once it has started (its first step is next):
the rendezvous store's address, or nothing."""
FOLDER_PREFIX = "mpickpt-agent-"
"""An agent's folder in the temporary directory: `owned_names.owned_name` (its PID and PID
namespace, then a random tag), so that the next agent removes one a SIGKILL left."""
REPLACES_VARIABLE = "MPICKPT_REPLACES"
"""Set by the agent for a process it started to replace a dead trainer: "rank/size/host:pid"
(launcher rank and size; the dead process, as it held its slot at the store)."""
RESPAWNS_VARIABLE = "MPICKPT_RESPAWNS"
DEFAULT_RESPAWNS = 3
"""Replacements one agent starts before it lets a death end its rank (a relaunch then)."""
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
_PR_SET_PDEATHSIG = 1
_MPI_ONLY = ("PMI_FD", "PMI_PORT", "PMI_ID", "PMI_RANK", "PMI_SIZE", "PMI_HOSTNAME",
             "PMIX_RANK", "PMIX_NAMESPACE", "PMIX_SERVER_URI2", "PMIX_SERVER_URI21")
FINISHED = "finished"
STORE_CHECK_S = 10.0
"""Seconds an agent waits for the job's store before it decides the job is gone."""


def launcher_slot(environ) -> tuple[int | None, int | None]:
    """(rank, size) the launcher gave this process, from its variables, or None each. Local."""
    def first(names):
        for name in names:
            value = environ.get(name, "").strip()
            if value.isdigit():
                return int(value)
        return None
    return first(_RANK_VARIABLES), first(_SIZE_VARIABLES)


class Agent:
    """One rank's agent. `run()` returns the exit status to leave with. Local."""

    def __init__(self, cmd: list[str], environ=None, say=None):
        self.cmd = cmd
        self.env = dict(os.environ if environ is None else environ)
        self.rank, self.size = launcher_slot(self.env)
        self.in_place = self.env.get(IN_PLACE_VARIABLE) == "1" and self.rank is not None \
            and (self.size or 0) > 1
        value = self.env.get(RESPAWNS_VARIABLE, "").strip()
        self.respawns_left = int(value) if value.isdigit() else DEFAULT_RESPAWNS
        self.say = say or (lambda m: print(f"mpickpt-agent: {m}", file=sys.stderr, flush=True))
        self.address = self.env.get(STORE_VARIABLE) or None
        self.folder: str | None = None
        self.respawned = 0
        self.end_by_signal: int | None = None
        """Set when the agent should end by this signal (a failed start) instead of a status."""
        self.standby: Standby | None = None
        """The warm standby (`--warm-respawn`, `mpickpt.launch.standby`), in place only."""

    def run(self) -> int:
        env = dict(self.env)
        gone = remove_stale(tempfile.gettempdir(), FOLDER_PREFIX)  # SIGKILLed agents' folders
        if gone:
            self.say(f"removed {len(gone)} folder(s) of agents that are gone: {' '.join(gone)}")
        self.folder = tempfile.mkdtemp(prefix=owned_name(FOLDER_PREFIX, ""))
        env[AGENT_VARIABLE] = self.folder
        watch = announce(self.env.get(AGENTS_VARIABLE), self.rank)  # in place or not
        if self.in_place and self.env.get(WARM_VARIABLE) == "1":
            self.standby = Standby(self.cmd, _without_mpi(env), _replacement_start)
        since, bye = time.time(), True
        try:  # PMI_FD goes along
            child = subprocess.Popen(self.cmd, close_fds=False, env=env,
                                     preexec_fn=_die_with_parent)
            _close_pmi_fd(self.env)
            status = self._wait(child)
            if status < 0 and not self._started():
                return self._failed_start(child.pid, -status)
            while status < 0:
                why_not = self._why_not_replace()
                if why_not == FINISHED:  # a replacement killed at the job's end: not needed
                    status = 0
                if why_not is not None:
                    bye = why_not == FINISHED  # else: no respawn will come for this rank
                    break
                child = self._replace(child.pid, -status, env)
                status = self._wait(child)
            return status
        finally:
            if self.standby is not None:
                self.standby.drop()
            (goodbye if bye else no_respawn)(watch)
            shutil.rmtree(self.folder, ignore_errors=True)
            from mpickpt.launch.mpich_shm import remove_orphans_saying

            remove_orphans_saying(since, self.say, areas=True)

    def _wait(self, child: subprocess.Popen) -> int:
        """Wait for the trainer's end; meanwhile keep a warm standby once it has started."""
        if self.standby is None:
            return child.wait()
        while True:
            try:
                return child.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
            if self._started() and self.standby.due():
                self.say(f"rank {self.rank}: warm standby started (pid "
                         f"{self.standby.start()})")

    def _started(self) -> bool:
        return os.path.exists(os.path.join(self.folder, STARTED_FILE))

    def _failed_start(self, pid: int, signum: int) -> int:
        """The trainer died before its first step: end as it did, so that the launcher ends the
        run instead of leaving the other ranks waiting for it."""
        self.say(f"rank {self.rank}: its trainer (pid {pid}) was killed by "
                 f"{_signal_name(signum)} during startup, before its first step; ending this "
                 f"rank the same way so that the launcher ends the run")
        self.end_by_signal = signum
        return 128 + signum

    def _why_not_replace(self) -> str | None:
        """None if the dead trainer is to be replaced; else why not: not in place, no respawns
        left, no store address, or the store's host is gone (FINISHED: its agent ends only after
        the job ended, so this rank has nothing left to do). Whether the job still needs the
        rank is the replacement's question (it leaves at once if not): asking the store here
        would import torch into the agent, seconds under load, while a death waits."""
        if self.in_place and self.respawns_left <= 0:
            self.say(f"rank {self.rank}: no respawn left ({self.respawned} made, "
                     f"{RESPAWNS_VARIABLE} allows {self.respawned + self.respawns_left}): the "
                     f"job goes on without one for this rank (a spare, or a relaunch)")
        if not self.in_place or self.respawns_left <= 0 or self._store_address() is None:
            return "no replacement"
        host, _, port = self._store_address().rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=STORE_CHECK_S).close()
        except (OSError, ValueError) as e:
            self.say(f"rank {self.rank}: no replacement: the job's store is gone, the job "
                     f"ended ({e})")
            return FINISHED
        return None

    def _store_address(self) -> str | None:
        """The store's address: mpickpt-run's (in this agent's environment), or the one the
        trainer left in the agent's folder."""
        if self.address is None and self.folder:
            try:
                with open(os.path.join(self.folder, STARTED_FILE)) as f:
                    self.address = f.read().strip() or None
            except OSError:
                return None
        return self.address

    def _replace(self, pid: int, signum: int, env: dict) -> subprocess.Popen:
        self.respawns_left -= 1
        self.respawned += 1
        self.say(f"rank {self.rank}: its trainer (pid {pid}) was killed by "
                 f"{_signal_name(signum)}; starting a replacement in place (respawn "
                 f"{self.respawned}, {self.respawns_left} left)")
        replaces = f"{self.rank}/{self.size}/{socket.gethostname()}:{pid}"
        warm = self.standby.take_over(replaces, self._store_address()) \
            if self.standby is not None else None
        if warm is not None:
            self.say(f"rank {self.rank}: the warm standby (pid {warm.pid}) takes over")
            return warm
        child_env = _without_mpi(env)
        child_env[REPLACES_VARIABLE] = replaces
        child_env[STORE_VARIABLE] = self._store_address()
        # born ignoring the stop signals (`_replacement_start`)
        return subprocess.Popen(self.cmd, env=child_env, preexec_fn=_replacement_start)


def main(argv=None) -> int:
    cmd = list(sys.argv[1:] if argv is None else argv)
    if not cmd:
        print("usage: python -m mpickpt.launch.rank_wrapper COMMAND [ARGS...]", file=sys.stderr)
        return 2
    for sig in JOB_SIGNALS:  # a handler, not SIG_IGN: the rank starts with default dispositions
        signal.signal(sig, _outlive)
    agent = Agent(cmd)
    status = agent.run()
    sys.stdout.flush()
    sys.stderr.flush()
    if agent.end_by_signal:  # a failed start: die by the trainer's signal, so hydra ends the run
        try:
            signal.signal(agent.end_by_signal, signal.SIG_DFL)
        except (OSError, ValueError):  # SIGKILL and SIGSTOP keep their default anyway
            pass
        os.kill(os.getpid(), agent.end_by_signal)
    # at once: an interpreter shutting down restores the default dispositions, and a SIGUSR1
    # meant for the rank would then end the wrapper by a signal after all
    os._exit(status if status >= 0 else 128 - status)


def _without_mpi(env: dict) -> dict:
    """A replacement's environment: no launcher connection (it never joins MPI). Local."""
    return {k: v for k, v in env.items() if k not in _MPI_ONLY}


def _close_pmi_fd(environ) -> None:
    """The rank owns the PMI connection; a copy held here would outlive its MPI_Finalize."""
    fd = environ.get("PMI_FD", "")
    if fd.isdigit():
        try:
            os.close(int(fd))
        except OSError:
            pass


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the agent dies (Linux's PR_SET_PDEATHSIG; the
    agent forks from its only thread). Elsewhere nothing."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    except (OSError, AttributeError):
        pass


def _replacement_start() -> None:
    """In a replacement (or warm standby) before exec: die with the agent, and be born ignoring
    the stop signals (an ignored disposition survives exec) until `StopSignals` takes them, a
    second or two into the interpreter (a standby: once it takes over; its agent ends it).
    Hydra's SIGUSR1 death notices of this very failure arrive then; and a stop sent to the job
    then (SIGTERM, SIGINT) would kill the process before it has a handler, which its agent would
    take for a crash and replace once more. The survivors got the same stop: they vote it in
    the first step the replacement joins."""
    _die_with_parent()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def _outlive(signum, frame) -> None:
    """The signal went to the whole process group: the rank has it and decides."""


if __name__ == "__main__":
    sys.exit(main())
