"""`mpickpt-run`: run the trainer under mpiexec or srun and relaunch it after a failure.

    mpickpt-run -n 4 --max-restarts 3 -- --ckpt-dir ckpt --survivor-dumps shm --parity-k 3 ...
    mpickpt-run --launcher srun --max-restarts 3 -- <trainer flags>     # inside an allocation

What SCR's `scr_srun` does for a job script, for any launcher: each run's exit status decides.
0 is done; 2 (bad input), 75 (stopped by a signal, checkpoint committed: "requeue me") and 74
(stopped by a signal, but the emergency checkpoint failed) end the loop and are passed on;
anything else (a rank killed, the survivors' 76, an error) relaunches the job, up to
`--max-restarts` times, after deleting a killed Slurm step's MPICH segments; a failure that repeats
the run before's (a startup error, or the launcher's refusal to start any rank's agent) ends the
loop (`repeated`, `Relauncher._refused_twice`). The relaunch resumes by itself: survivors from
their dumps, the dead ranks by `--recovery`, or everything from the newest checkpoint. Every
restart is logged with its cause to stderr and, one line each, to
`<ckpt-dir>/mpickpt-restarts.log` (or `--restart-log`). Signals sent to `mpickpt-run` (TERM, INT,
USR1, USR2) go to the run and end the loop. Local.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from mpickpt.launch.command import (LAUNCHERS, agents_respawn, cleanup_command,
                                     launch_command, sends_death_notices,
                                     stop_signal_for)
from mpickpt.launch import own_group
from mpickpt.launch.mpich_shm import remove_orphans_saying, remove_stale_saying
from mpickpt.launch.rank_wrapper import IN_PLACE_VARIABLE
from mpickpt.launch.standby import WARM_VARIABLE
from mpickpt.stop_signals import NOTICES_VARIABLE
from mpickpt.job_variables import AGENTS_VARIABLE, RESTART_VARIABLE, STORE_VARIABLE
from mpickpt.exit_codes import (EXIT_BAD_INPUT, EXIT_PEER_LOST, EXIT_SAVE_FAILED, EXIT_SAVED,
                                EXIT_STARTUP_FAILED)

FINAL = {0: "finished", EXIT_BAD_INPUT: "refused its input", EXIT_SAVED:
         "stopped on a signal with its checkpoint committed", EXIT_SAVE_FAILED:
         "stopped on a signal but its emergency checkpoint failed"}
NOT_STARTED = -(1 << 16)
"""`_one_run`'s status when a stop signal came before its launcher started (none was)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
_DIED = re.compile(r"peer rank\(s\) \[([0-9, ]+)\] died after step (\d+) \(")
"""A survivor's line on a death; the cause in parentheses follows (`_parenthesized`)."""
_STARTUP_KILL = re.compile(r"rank (\d+): its trainer \(pid \d+\) was killed by (\w+) during "
                           r"startup")
"""A node agent's line on a trainer killed before its first step (`rank_wrapper`)."""
_HYDRA_BAD = re.compile(r"EXIT CODE: (\d+)")
_SRUN_TASK = re.compile(r"srun: error: \S+: tasks? ([0-9,\-]+): (.+)")
_ERROR = re.compile(r"^(?:\[rank\d+\]: )?([A-Za-z_][\w.]*(?:Error|Exception): .+)$")
"""The last line of a Python traceback (with torch's rank prefix, where it adds one)."""
_STARTUP_FAILED = "startup failed in "
STARTUP_KILL_GRACE_S = 3.0
"""How long a launcher may go on after an agent said its trainer died in startup."""
RELAYED_S = 0.5
"""A signal that comes again within this many seconds is the first one relayed (`_forward`)."""
HEAD_LINES = 40
"""Lines of a run's output kept to compare a launcher's refusal with the one before."""
REFUSAL_RETRY_S = 5.0
"""How long a run that no agent started waits before its relaunch (a passing fault may clear)."""
_COMMAND_FAULT = re.compile(
    r"\b(?:(?:unrecogni[sz]ed|unknown|invalid|illegal) (?:command[- ]line )?(?:--?[\w-]+ )?"
    r"(?:argument|option|parameter|(?:numeric )?value|mpi type|specification)"
    r"|failed to parse --?\w)", re.IGNORECASE)
"""How launchers name a fault of their command line (hydra's "unrecognized argument", srun's
"unrecognized option", "Invalid MPI type", "unrecognized --cpu-bind argument", "Invalid
--distribution specification" and "Failed to parse --gres", Open MPI's "unknown option"), and
not a fault of the cluster that merely says "invalid" or "unknown" (a node name, a host)."""


@dataclass
class RunWatch:
    """What one run's output says about how it failed (filled while it streams)."""

    dead: set = field(default_factory=set)
    step: int | None = None
    how: str = ""
    notes: list = field(default_factory=list)
    error: str = ""
    """The last error line (a traceback's) before a trainer first said its startup failed."""
    errors: set = field(default_factory=set)
    """Every distinct error line of the run (its ranks' streams interleave)."""
    startup_failed: bool = False
    killed_in_startup: dict = field(default_factory=dict)
    """rank -> the signal that killed its trainer before its first step (its agent said)."""
    started: bool | None = None
    """Whether any of the run's node agents started (None: the run had no agents)."""
    head: list = field(default_factory=list)
    """The run's first `HEAD_LINES` lines of output, stripped."""

    def read(self, line: str) -> None:
        text = line.strip()
        if len(self.head) < HEAD_LINES:
            self.head.append(text)
        m = _ERROR.match(text)
        if m:
            self.errors.add(m.group(1))
            self.error = self.error if self.startup_failed else m.group(1)
        if _STARTUP_FAILED in line:
            self.startup_failed = True
        m = _STARTUP_KILL.search(line)
        if m:
            self.killed_in_startup[int(m.group(1))] = m.group(2)
            return
        m = _DIED.search(line)
        if m:
            self.dead |= {int(r) for r in m.group(1).split(",") if r.strip()}
            self.step = int(m.group(2))
            self.how = self.how or _parenthesized(line[m.end():]).split("; noticed ")[0]
            return
        m = _SRUN_TASK.search(line) or _HYDRA_BAD.search(line)
        if m and len(self.notes) < 4:
            self.notes.append(line.strip())


def _parenthesized(text: str) -> str:
    """`text` up to the parenthesis that closes one opened just before it (parentheses inside
    it, "rank(s)", "(generation 4: ...)", are kept); all of it where none closes. Local."""
    depth = 0
    for i, c in enumerate(text):
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return text[:i]
    return text


def cause(status: int, watch: RunWatch) -> str:
    """One line on why a run ended with `status`. Local and pure."""
    parts = [f"rank {r}'s trainer was killed by {sig} during startup"
             for r, sig in sorted(watch.killed_in_startup.items())]
    if refused(status, watch):
        said = next((line for line in watch.head if line), "")
        parts.append("no node agent started" + (f" ({said})" if said else ""))
    if watch.dead:
        parts.append(f"rank(s) {sorted(watch.dead)} died after step {watch.step} "
                     f"({watch.how}); the survivors exited {EXIT_PEER_LOST}")
    if status < 0:
        parts.append(f"the launcher was killed by {signal.Signals(-status).name}")
    elif status > 128 and status - 128 < signal.NSIG:
        parts.append(f"exit status {status} (a process killed by "
                     f"{_signal_name(status - 128)})")
    elif status == EXIT_STARTUP_FAILED:
        parts.append(f"exit status {status} (a rank's startup failed: " + (
            f"{watch.error}" if watch.error else
            "a peer died before the first step, or --startup-timeout passed") + ")")
    elif status not in FINAL and status != EXIT_PEER_LOST:
        parts.append(f"exit status {status}")
    parts += watch.notes[:2]
    return "; ".join(parts) or f"exit status {status}"


def refused(status: int, watch: RunWatch) -> bool:
    """Whether the run failed without any rank's node agent starting: the launcher refused its
    command (`--launcher-arg`, `--srun-mpi`) or the allocation, or its tasks died before their
    agents could start. Local and pure."""
    return status != 0 and watch.started is False


def command_fault(watch: RunWatch) -> bool:
    """Whether a refused run's output names a fault of the command (an argument or plugin the
    launcher does not know, an invalid value), which any allocation would refuse alike, and
    not of the allocation or the cluster's state (a timeout, a busy node). Local and pure."""
    return any(_COMMAND_FAULT.search(line) for line in watch.head)


def repeated(failure: tuple | None, last: tuple | None) -> bool:
    """Whether a run's `failure_of` is the run before's, a failure every relaunch repeats: the
    launcher refused to start it with the same output, or its startup failed with the same
    error lines and no sign of a death (no rank reported dead, no launcher note of a rank
    killed or gone, no agent's note of a trainer killed in its startup). Local and pure."""
    return failure is not None and failure == last and bool(failure[1])


def failure_of(status: int, watch: RunWatch) -> tuple | None:
    """What `repeated` compares: (status, the run's first lines) of a launcher's refusal,
    (status, the run's error lines) of a startup failure with no sign of a death, else None.
    Local and pure."""
    if refused(status, watch):
        return status, tuple(sorted(watch.head))  # (its two streams interleave)
    if status != EXIT_STARTUP_FAILED or not watch.startup_failed or watch.dead or watch.notes \
            or watch.killed_in_startup:
        return None
    return status, frozenset(watch.errors)


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


class Relauncher:
    """The relaunch loop of one job. `run()` returns the exit status to pass on. Local."""

    def __init__(self, command: list[str], max_restarts: int, log_path: str | None,
                 cleanup: list[str] | None = None, say=None, in_place: bool = True,
                 warm: bool = False, notices: bool = True, stop_as: int | None = None,
                 agents: bool | None = None):
        """`in_place`: the rank agents replace a trainer killed by a signal inside the run
        (survivors keep their processes); a relaunch is then the fallback. `warm`: the agents
        keep a warm standby for that (`--warm-respawn`). `notices`: the launcher sends SIGUSR1
        as a death notice (hydra), so the ranks may mute it around a death. `stop_as`: the
        signal a first SIGTERM or SIGINT is forwarded as, where the launcher passes that one
        to its tasks and not those (srun: `launch.command.stop_signal_for`); None: as it is.
        `agents`: the command runs every rank under a node agent (`launch.rank_wrapper`),
        which says it started to the run's agent watch (default: `in_place`)."""
        self.notices, self.stop_as = notices, stop_as
        self.in_place = in_place
        self.agents = in_place if agents is None else agents
        self.warm = warm and in_place
        self.command, self.max_restarts = command, max_restarts
        self.log_path, self.cleanup = log_path, cleanup
        self.say = say or (lambda m: print(f"mpickpt-run: {m}", file=sys.stderr, flush=True))
        self.restarts = 0
        self.stop_signal: str | None = None
        self._forwarded: tuple[int, float] | None = None
        """(signal, monotonic time) of the last signal forwarded to the launcher."""
        self._proc: subprocess.Popen | None = None
        self._unsent: int | None = None
        """A signal that came while no launcher ran (after `_one_run`'s last look), sent to
        the next one as it starts."""
        self.last_status: int | None = None
        """The last run's status (a stop before the next one started ends the loop with it)."""

    def run(self) -> int:
        self.say(f"launching {' '.join(self.command[:6])} ... (up to {self.max_restarts} "
                 f"restarts)")
        previous = {sig: signal.signal(sig, self._forward) for sig in FORWARDED}
        remove_stale_saying(self.say)  # what runs killed as a whole left on this host
        last = None
        try:
            while True:
                status, watch, seconds = self._one_run()
                if status == NOT_STARTED:  # a stop came while no launcher ran
                    self._record(f"{self.stop_signal} received before run {self.restarts + 1} "
                                 f"started: not " + ("launching" if self.last_status is None
                                                     else "relaunching"))
                    return EXIT_SAVED if self.last_status is None else self.last_status
                self.last_status = status
                if status in FINAL or self.stop_signal is not None:
                    self.say(f"run {self.restarts + 1} {FINAL.get(status, f'ended ({status})')}"
                             f" after {seconds:.1f} s" + (f" ({self.stop_signal} received)"
                                                          if self.stop_signal else ""))
                    return status
                why = cause(status, watch)
                failure = failure_of(status, watch)
                if repeated(failure, last):
                    if refused(status, watch):
                        return self._refused_twice(status, watch, seconds, why)
                    self._record(f"run {self.restarts + 1} failed after {seconds:.1f} s: {why}; "
                                 f"the same startup error as the run before: a fault a "
                                 f"relaunch repeats, not a peer's death; not relaunching")
                    return status
                last = failure
                if self.restarts >= self.max_restarts:
                    self._record(f"run {self.restarts + 1} failed after {seconds:.1f} s: {why}; "
                                 f"no restarts left (--max-restarts {self.max_restarts})")
                    return status
                self.restarts += 1
                self._record(f"run {self.restarts} failed after {seconds:.1f} s: {why}; "
                             f"relaunching (restart {self.restarts} of {self.max_restarts})")
                if refused(status, watch):
                    self._wait_unless_stopped(REFUSAL_RETRY_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wait_unless_stopped(self, seconds: float) -> None:
        """Sleep `seconds`, or less when a stop signal comes (`_forward`). Local."""
        deadline = time.monotonic() + seconds
        while self.stop_signal is None and time.monotonic() < deadline:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    def _refused_twice(self, status: int, watch: RunWatch, seconds: float, why: str) -> int:
        """The run's launcher refused it as it did the run before: relaunching here repeats
        it. A fault of the command ends the job with exit status 2 (a requeue would repeat it
        too); any other (the allocation's, the cluster's) with the launcher's status, which
        the Slurm script requeues onto a new allocation. Local."""
        head = (f"run {self.restarts + 1} failed after {seconds:.1f} s: {why}; no node agent "
                f"started, with the same output as the run before")
        if command_fault(watch):
            self._record(f"{head}: a fault of the launcher's command, which a relaunch or a "
                         f"requeue repeats; not relaunching (exit status {EXIT_BAD_INPUT})")
            return EXIT_BAD_INPUT
        self._record(f"{head}: a relaunch in this allocation repeats it; not relaunching "
                     f"(exit status {status})")
        return status

    def _one_run(self) -> tuple[int, RunWatch, float]:
        """Clean up, then launch a run unless a stop signal came before (`NOT_STARTED`): there
        would be no launcher yet to forward it to. Its (status, output, seconds)."""
        if self.cleanup:  # a requeued job's first step needs it too
            subprocess.run(self.cleanup, check=False, stdin=subprocess.DEVNULL)
        if self.stop_signal is not None:
            return NOT_STARTED, RunWatch(), 0.0
        env = dict(os.environ, PYTHONUNBUFFERED="1", **{RESTART_VARIABLE: str(self.restarts),
                                                        IN_PLACE_VARIABLE: "0",
                                                        STORE_VARIABLE: "", AGENTS_VARIABLE: "",
                                                        WARM_VARIABLE: "1" if self.warm else "",
                                                        NOTICES_VARIABLE:
                                                            "1" if self.notices else "0"})
        host = agents = None
        if self.in_place:  # a store and agent watch of this run's own, outliving its ranks
            from mpickpt.launch.run_store import RunStore

            host = RunStore()
            agents = host.watch
            env.update(host.environment(), **{IN_PLACE_VARIABLE: "1"})
        elif self.agents:  # only to know whether any agent started
            from mpickpt.launch.run_store import AgentWatch

            agents = AgentWatch()
            env[AGENTS_VARIABLE] = agents.address
        try:
            status, watch, seconds = self._launch(env)
            if agents is not None and status != 0:
                watch.started = agents.started()
            done = host.completed() if status != 0 and host is not None else None
            if done is not None:
                self.say(f"the training completed (step {done}); the launcher's "
                         f"status {status} comes from rank(s) lost on the way (agents lost: "
                         f"{host.lost_agents() or 'none'}): the run counts as finished")
                status = 0
            return status, watch, seconds
        finally:
            if host is not None:
                host.close()
            elif agents is not None:
                agents.close()

    def _launch(self, env: dict) -> tuple[int, RunWatch, float]:
        watch, start, since = RunWatch(), time.monotonic(), time.time()
        # a group of its own: a stop reaches it once, forwarded (`own_group`)
        self._proc = subprocess.Popen(own_group.command(self.command), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      env=env, bufsize=0, **own_group.POPEN)
        if self._unsent is not None:  # came while no launcher ran (the clean-up, the Popen)
            self._proc.send_signal(self._unsent)
            self._unsent = None
        pumps = [threading.Thread(target=_pump, args=(src, dst, watch), daemon=True)
                 for src, dst in ((self._proc.stdout, sys.stdout), (self._proc.stderr,
                                                                     sys.stderr))]
        for t in pumps:
            t.start()
        status = self._wait_launcher(watch)
        for t in pumps:
            t.join(10)
        # the run's segments that ranks killed by their launcher left, their agents with them,
        # and the staging areas of trainers killed on this host
        remove_orphans_saying(since, self.say, areas=True)
        return status, watch, time.monotonic() - start

    def _wait_launcher(self, watch: RunWatch) -> int:
        """The launcher's exit status. A trainer killed during its startup makes its agent end
        its rank by the same signal, which ends the run under hydra; srun, told to keep going
        when a task fails (`--kill-on-bad-exit=0`), would wait for the others' startup
        deadline: a launcher still running `STARTUP_KILL_GRACE_S` after an agent said so gets
        SIGTERM (srun ends its step). Local."""
        deadline = None
        while True:
            try:
                return self._proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if deadline is None and watch.killed_in_startup:
                deadline = time.monotonic() + STARTUP_KILL_GRACE_S
            if deadline is not None and time.monotonic() > deadline:
                self.say(f"a trainer was killed during its startup and the launcher went on for "
                         f"{STARTUP_KILL_GRACE_S:.0f} s: ending the run")
                self._proc.terminate()
                deadline = float("inf")

    def _forward(self, signum, frame) -> None:
        """Pass a signal on to the launcher, once per event: the same signal again within
        `RELAYED_S` is that event relayed to this process a second time (by a wrapper such as
        timeout(1) in the same process group), not a second Ctrl-C, which hydra and srun take
        for an abort without the emergency checkpoint."""
        now = time.monotonic()
        if self._forwarded is not None and self._forwarded[0] == signum and \
                now - self._forwarded[1] < RELAYED_S:
            return
        first = self.stop_signal is None
        self._forwarded = (signum, now)
        self.stop_signal = signal.Signals(signum).name
        if first and self.stop_as is not None and signum in (signal.SIGTERM, signal.SIGINT):
            signum = self.stop_as  # later ones go as they are: the launcher's forced end
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signum)
        else:
            self._unsent = signum

    def _record(self, line: str) -> None:
        self.say(line)
        if self.log_path:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
            job = os.environ.get("SLURM_JOB_ID")
            where = f" job {job} (requeue {os.environ.get('SLURM_RESTART_COUNT', 0)})" \
                if job else ""
            with open(self.log_path, "a") as f:
                f.write(f"{stamp}{where} {line}\n")


def _pump(src, dst, watch: RunWatch) -> None:
    """Copy a run's output through, line by line, reading what it says about failures."""
    for raw in iter(src.readline, b""):
        text = raw.decode(errors="replace")
        watch.read(text)
        dst.write(text)
        dst.flush()


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of trainer flag `name` ("--name V" or "--name=V"), if given. Local."""
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            return flags[i + 1]
        if flag.startswith(name + "="):
            return flag.split("=", 1)[1]
    return None


def processes(ranks: int | None, flags: list[str]) -> int | None:
    """How many processes to launch for `ranks` training ranks: the trainer's --spares come on
    top (the trainer refuses a --spares that is not a count). Local."""
    spares = flag_value(flags, "--spares")
    if ranks is None or not spares or not spares.strip().isdigit():
        return ranks
    return ranks + int(spares)


def ckpt_dir_of(flags: list[str]) -> str | None:
    """The --ckpt-dir among trainer flags, if any. Local."""
    return flag_value(flags, "--ckpt-dir")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mpickpt-run", description="Run mpickpt-train under mpiexec or srun and relaunch "
        "it after a failure (trainer flags after --).")
    p.add_argument("-n", "--ranks", type=int, default=None,
                   help="training ranks (needed with mpiexec; srun: default the allocation's "
                        "tasks); the trainer's --spares S launch S more processes")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="relaunches after failures before giving up (default: 3)")
    p.add_argument("--launcher", choices=LAUNCHERS,
                   default="srun" if os.environ.get("SLURM_JOB_ID") else "mpiexec",
                   help="srun inside a Slurm allocation, else mpiexec")
    p.add_argument("--launcher-path", default=None,
                   help="the launcher program (default: the mpiexec beside this Python, or "
                        "srun on PATH)")
    p.add_argument("--launcher-arg", action="append", default=[], metavar="ARG",
                   help="an argument for the launcher (repeatable), e.g. --launcher-arg=-N2")
    p.add_argument("--srun-mpi", default=os.environ.get("SRUN_MPI", "pmi2"),
                   help="srun's MPI plugin (default: $SRUN_MPI, else pmi2 for MPICH)")
    p.add_argument("--restart-log", default=None,
                   help="file the restarts are recorded in (default: "
                        "<ckpt-dir>/mpickpt-restarts.log)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the trainer's flags")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if args.max_restarts < 0:
        print(f"mpickpt-run: error: --max-restarts {args.max_restarts}: expected 0 or more",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.ranks is not None and args.ranks < 1:
        print(f"mpickpt-run: error: -n {args.ranks}: expected 1 or more ranks", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        command = launch_command(args.launcher, processes(args.ranks, flags), flags,
                                 args.launcher_arg,
                                 args.srun_mpi, args.launcher_path)
    except ValueError as e:
        print(f"mpickpt-run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    ckpt = ckpt_dir_of(flags)
    log = args.restart_log or (os.path.join(ckpt, "mpickpt-restarts.log") if ckpt else None)
    if log:
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
    nodes = os.environ.get("SLURM_JOB_NUM_NODES")
    agents = agents_respawn(args.launcher, args.launcher_path)
    relauncher = Relauncher(command, args.max_restarts, log, cleanup_command(args.launcher, nodes),
                            in_place=(flag_value(flags, "--in-place") or "auto") != "off"
                            and agents, agents=agents,
                            warm="--warm-respawn" in flags,
                            notices=sends_death_notices(args.launcher, args.launcher_path),
                            stop_as=stop_signal_for(args.launcher))
    status = relauncher.run()
    if status != 0 and ckpt:
        say_dumps_left(ckpt, relauncher.say)
    return status


def say_dumps_left(ckpt: str, say) -> None:
    """Say what survivor dumps of `ckpt` a job that ends unfinished leaves in this node's shared
    memory (memory the node lacks until they go): a later job with the same --ckpt-dir resumes
    from them, or removes them where a newer checkpoint committed. Local."""
    from mpickpt.survivors.dump import held_here

    folder, dumps, partial, nbytes = held_here(ckpt)
    if dumps or partial:
        cut = f" and {partial} cut short while written" if partial else ""
        say(f"{dumps} survivor dump(s){cut}, {nbytes / 1e6:.1f} MB, stay in {folder} on this "
            f"node (and any on the run's other nodes): a later job with --ckpt-dir {ckpt} "
            f"resumes from them or, older than its newest checkpoint, removes them; remove "
            f"that folder if none will run")


if __name__ == "__main__":
    sys.exit(main())
