"""A throwaway single-node Slurm cluster for tests.

`SlurmCluster` starts munged, slurmctld and slurmd in the foreground as child processes, each
with its own configuration, state, spool and log files under one temporary directory, and
stops exactly what it started. Nothing is written to /etc, /var or /run: the daemons get every
path by flag, the clients find the configuration through SLURM_CONF (see `env()`), and
slurm.conf's `AuthInfo=socket=...` points all of them at the cluster's own munge socket.

Every process of the cluster carries a token in its environment (`SLURM_TEST_CLUSTER_TOKEN`):
the daemons get it at start, slurmstepd inherits it from slurmd, and jobs inherit it from the
environment that `env()` gives to sbatch/srun. `stop()` uses it to find the job steps and
tasks the cluster left behind, so that it never touches another process of the machine.

In a test module:

    from tests.slurm_cluster import slurm_cluster_fixture
    slurm = slurm_cluster_fixture(scope="module")

    def test_hostname(slurm):
        assert slurm.run(["srun", "-n", "2", "hostname"]).stdout.count("\\n") == 2

Needs root (SlurmUser=root) and Debian's `slurm-wlm` and `munge` packages.
"""
from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from mpickpt.launch.mpich_shm import remove_segments

TOKEN_VAR = "SLURM_TEST_CLUSTER_TOKEN"
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "scontrol", "sinfo", "squeue", "scancel")
# Job states after which a job will not run again by itself (REQUEUED/PENDING are not here).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                          "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
# Environment that would make the clients talk to another cluster or job.
_FOREIGN_ENV = re.compile(r"^(SLURM_|SBATCH_|SALLOC_|SRUN_|SQUEUE_|SINFO_|SCONTROL_|PMI_|PMIX_)")
# A unix socket path must fit in sockaddr_un.sun_path (108 bytes with the NUL); slurmd puts
# its step sockets at <spool>/<node>_<jobid>.<stepid>, so leave room for that.
_MAX_ROOT_LEN = 60


class SlurmClusterError(RuntimeError):
    """The cluster failed to start, a command against it failed, or a wait timed out."""


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How a job ended: its final state, exit code and signal (ExitCode=code:signal)."""

    job_id: int
    state: str
    exit_code: int
    signal: int
    info: Mapping[str, str]


def skip_reason() -> str | None:
    """Why the cluster cannot run on this machine, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/environ").exists():
        return "the Slurm test cluster needs Linux with /proc"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (SlurmUser=root)"
    missing = [b for b in DAEMONS + CLIENTS if _which(b) is None]
    if missing:
        return ("Slurm/munge binaries missing: " + ", ".join(missing)
                + " (apt-get install slurm-wlm munge)")
    return None


def _which(name: str) -> str | None:
    """Path of an executable on PATH or in the sbin directories, which PATH may lack."""
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/local/sbin")


def free_port() -> int:
    """A TCP port that nothing listens on right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    """Whether something accepts TCP connections on 127.0.0.1:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def parse_scontrol(line: str) -> dict[str, str]:
    """Parse one `scontrol show ... -o` record (Key=Value pairs; values may hold spaces)."""
    pairs = re.findall(r"(\S+?)=(.*?)(?=\s+[A-Za-z][\w/:.]*=|\s*$)", line.strip())
    return {k: v for k, v in pairs}


def tail(path: Path, lines: int = 30) -> str:
    """The last lines of a text file, or a note that it does not exist."""
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<{path}: {e.strerror}>"
    return "\n".join(text.splitlines()[-lines:])


def _environ_of(pid: int) -> bytes:
    """The initial environment of a process (b'' when it is gone or unreadable)."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _pids() -> list[int]:
    """Every process id in /proc."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _ppid(pid: int) -> int:
    """The parent process id of a process (0 when it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _alive(pid: int) -> bool:
    """Whether a process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _die_with_parent() -> None:
    """In a child before exec: ask the kernel to SIGTERM it when its parent dies, so that a
    test process killed without stop() does not leave the daemons behind."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)


class SlurmCluster:
    """One node, one partition, three daemons, all under `root`; see the module docstring."""

    def __init__(self, root: str | os.PathLike | None = None, *, cpus: int | None = None,
                 real_memory_mb: int = 4096, kill_wait: int = 5, cred_expire: int = 10,
                 debug: str = "info", extra_conf: Iterable[str] = ()):
        """Lay out the cluster under `root` (a new temporary directory when None).

        cpus: CPUs the node declares (default: max(8, os.cpu_count())); slurmd does not
        check them against the hardware (SlurmdParameters=config_overrides), so a 2-core
        machine can run 4 tasks. kill_wait: seconds between SIGTERM and SIGKILL of a job.
        cred_expire: job credential lifetime, which is also how long a requeued job waits
        before it may start again. extra_conf: lines appended to slurm.conf.
        """
        self._owns_root = root is None
        if root is None:
            root = tempfile.mkdtemp(prefix="slurm-")
        self.root = Path(root).resolve()
        if cred_expire < 5:
            raise SlurmClusterError("Slurm 22.05 rejects AuthInfo=cred_expire below 5 "
                                    "(and silently uses 120)")
        if len(str(self.root)) > _MAX_ROOT_LEN:
            raise SlurmClusterError(f"{self.root} is too long for the cluster's unix sockets "
                                    f"(at most {_MAX_ROOT_LEN} characters); pass a shorter root")
        self.node = socket.gethostname().split(".")[0]
        self.cpus = cpus or max(8, os.cpu_count() or 1)
        self.real_memory_mb = real_memory_mb
        self.kill_wait = kill_wait
        self.cred_expire = cred_expire
        self.debug = debug
        self.extra_conf = list(extra_conf)
        self.token = uuid.uuid4().hex
        # Job ids differ from cluster to cluster, so that what a killed job left behind on the
        # machine under a name derived from its id (MPICH's /dev/shm segments) is never met
        # again by a job of a later cluster.
        self.first_job_id = random.randrange(10_000, 60_000_000)
        self.ctld_port = self.slurmd_port = 0
        self._procs: dict[str, subprocess.Popen] = {}

    # --- paths -------------------------------------------------------------------------

    @property
    def conf_path(self) -> Path:
        """slurm.conf of this cluster (what SLURM_CONF names)."""
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        """The munge socket that the daemons and clients of this cluster use."""
        return self.root / "munge" / "munge.socket"

    @property
    def log_dir(self) -> Path:
        """Directory of the daemons' log files (<daemon>.log)."""
        return self.root / "log"

    @property
    def spool_dir(self) -> Path:
        """slurmd's spool directory (batch scripts, step sockets)."""
        return self.root / "spool"

    @property
    def job_dir(self) -> Path:
        """Where `sbatch(script_text)` writes job scripts; a handy place for job output."""
        return self.root / "jobs"

    def log(self, daemon: str) -> Path:
        """Log file of one daemon (munged, slurmctld or slurmd)."""
        return self.log_dir / f"{daemon}.log"

    def pids(self) -> dict[str, int]:
        """Process ids of the daemons this cluster started, by name."""
        return {name: p.pid for name, p in self._procs.items()}

    # --- environment and commands ---------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ for commands against this cluster: SLURM_CONF set, the cluster's token
        set (jobs inherit it, which is how stop() finds them), and any SLURM_*/PMI_* variables
        of an enclosing job removed."""
        env = {k: v for k, v in os.environ.items() if not _FOREIGN_ENV.match(k)}
        env["SLURM_CONF"] = str(self.conf_path)
        env[TOKEN_VAR] = self.token
        env["PATH"] = env.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
        env.update(extra or {})
        return env

    def run(self, args: Sequence[str], *, check: bool = True, timeout: float = 60,
            env: Mapping[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        """Run a command (srun, scontrol, ...) against the cluster; text output captured.

        check: raise SlurmClusterError with the command's output when it exits non-zero.
        env: extra variables on top of `env()`.
        """
        proc = subprocess.run(list(args), env=self.env(env), capture_output=True, text=True,
                              timeout=timeout, **kwargs)
        if check and proc.returncode != 0:
            raise SlurmClusterError(f"{' '.join(args)} exited {proc.returncode}\n"
                                    f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
        return proc

    def sbatch(self, script: str | os.PathLike, *options: str, script_args: Sequence[str] = (),
               env: Mapping[str, str] | None = None) -> int:
        """Submit a batch job and return its id.

        script: a path to a script, or the script's text (written under `job_dir`; text that
        does not start with '#!' gets '#!/bin/bash'). options: sbatch options. script_args:
        arguments of the script. The job starts in `job_dir` unless options hold --chdir.
        """
        path = self._script_path(script)
        proc = self.run(["sbatch", "--parsable", f"--chdir={self.job_dir}", *options, str(path),
                         *script_args], env=env)
        return int(proc.stdout.strip().split(";")[0])

    def _script_path(self, script: str | os.PathLike) -> Path:
        """The path of a script given as a path, or a new file holding the script's text."""
        if isinstance(script, os.PathLike) or "\n" not in script:
            return Path(script)
        text = script if script.startswith("#!") else "#!/bin/bash\n" + script
        fd, name = tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.job_dir)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(name, 0o755)
        return Path(name)

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` of one job as a dict (JobState, ExitCode, Restarts, ...)."""
        proc = self.run(["scontrol", "-o", "show", "job", str(job_id)])
        return parse_scontrol(proc.stdout.splitlines()[0])

    def wait_state(self, job_id: int, states: Iterable[str], timeout: float = 60,
                   poll: float = 0.2) -> dict[str, str]:
        """Wait until the job's JobState is one of `states` (or final); returns job_info."""
        wanted = set(states)
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in wanted | FINAL_STATES:
                return info
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"job {job_id} still {info.get('JobState')} after "
                                        f"{timeout}s waiting for {sorted(wanted)}: {info}")
            time.sleep(poll)

    def wait_job(self, job_id: int, timeout: float = 120, poll: float = 0.2) -> JobResult:
        """Wait until the job has ended for good (a final state, see FINAL_STATES)."""
        info = self.wait_state(job_id, FINAL_STATES, timeout=timeout, poll=poll)
        code, _, sig = info.get("ExitCode", "0:0").partition(":")
        return JobResult(job_id, info["JobState"], int(code), int(sig or 0), info)

    def requeue(self, job_id: int, start_now: bool = True, timeout: float = 60) -> None:
        """`scontrol requeue` a job; with start_now, let it start again within about a second
        instead of after the credential lifetime (cred_expire + 1 s).

        slurmctld holds a requeued job back (BeginTime) because slurmd revokes the job's
        credentials at the requeue, with a resolution of one second: a new allocation whose
        credential is stamped in the same second as the revocation is refused ("Job
        credential revoked") and the job ends FAILED for good. So BeginTime is moved to now
        only once the clock has passed into the next second.
        """
        self.run(["scontrol", "requeue", str(job_id)])
        requeued_at = time.time()
        if start_now:
            self.wait_state(job_id, {"PENDING", "RUNNING"}, timeout=timeout)
            time.sleep(max(0.0, int(requeued_at) + 1 - time.time()))
            self.run(["scontrol", "update", f"jobid={job_id}", "starttime=now"], check=False)

    # --- start ---------------------------------------------------------------------------

    def start(self, timeout: float = 30) -> "SlurmCluster":
        """Start munged, slurmctld and slurmd and wait until the node is idle.

        On failure the daemons already started are stopped and SlurmClusterError carries
        the tails of their logs.
        """
        try:
            self._layout()
            self._start_munged(timeout)
            self._popen("slurmctld", ["-D", "-f", str(self.conf_path),
                                      "-L", str(self.log("slurmctld"))])
            self._popen("slurmd", ["-D", "-f", str(self.conf_path),
                                   "-L", str(self.log("slurmd")), "-N", self.node])
            self._wait_for(lambda: _listening(self.ctld_port), timeout, "slurmctld's port")
            self.wait_idle(timeout)
        except BaseException as e:
            report = self.diagnostics()
            self.stop()
            if isinstance(e, SlurmClusterError):
                raise SlurmClusterError(f"{e}\n{report}") from None
            raise
        return self

    def _layout(self) -> None:
        """Create the directories, the munge key and slurm.conf."""
        for sub in ("etc", "state", "spool", "log", "run", "jobs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge_dir = self.root / "munge"
        munge_dir.mkdir(exist_ok=True)
        # munged wants its socket directory searchable by all and not writable by others.
        os.chmod(self.root, 0o755)
        os.chmod(munge_dir, 0o755)
        key = munge_dir / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            os.chmod(key, 0o400)
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        self.conf_path.write_text(self.slurm_conf())

    def slurm_conf(self) -> str:
        """The text of slurm.conf for this cluster."""
        r = self.root
        lines = [
            "ClusterName=testcluster",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={self.ctld_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.log('slurmctld')}",
            f"SlurmdLogFile={self.log('slurmd')}",
            f"SlurmctldDebug={self.debug}",
            f"SlurmdDebug={self.debug}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            # Batch jobs start on the next pass of a scheduling loop, not at submit: one pass a
            # second. (sched/builtin took ~2.8 s for a cluster's first batch job, backfill <1 s.)
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "JobRequeue=1",
            f"KillWait={self.kill_wait}",
            f"FirstJobId={self.first_job_id}",
            # Keep job records for a day: wait_job() and stop() read them. (0, "never purge" in
            # the man page, is rejected by 22.05 and becomes 2 s.)
            "MinJobAge=86400",
            "InactiveLimit=0",
            "Waittime=0",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "MessageTimeout=10",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={self.real_memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE "
            "OverSubscribe=NO State=UP",
            *self.extra_conf,
        ]
        return "\n".join(lines) + "\n"

    def _popen(self, name: str, args: list[str]) -> subprocess.Popen:
        """Start one daemon in the foreground, its stdout/stderr in log/<name>.out."""
        out = open(self.log_dir / f"{name}.out", "ab")
        try:
            proc = subprocess.Popen([_which(name) or name, *args], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(), cwd=self.root, start_new_session=True,
                                    preexec_fn=_die_with_parent)
        finally:
            out.close()
        self._procs[name] = proc
        return proc

    def _start_munged(self, timeout: float) -> None:
        """Start munged on the cluster's own socket and key; wait for the socket."""
        d = self.root / "munge"
        self._popen("munged", ["-F", f"--socket={self.munge_socket}",
                               f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
                               f"--log-file={self.log('munged')}", f"--seed-file={d / 'seed'}"])
        self._wait_for(lambda: self.munge_socket.exists(), timeout, "munged's socket")

    def _wait_for(self, ready, timeout: float, what: str, poll: float = 0.05) -> None:
        """Poll `ready()` until true; raise if it times out or a daemon exits meanwhile."""
        deadline = time.monotonic() + timeout
        while True:
            dead = {n: p.returncode for n, p in self._procs.items() if p.poll() is not None}
            if dead:
                raise SlurmClusterError(f"waiting for {what}: daemon exited: {dead}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(poll)

    def node_state(self) -> str:
        """The node's State as scontrol shows it (e.g. IDLE, IDLE+DRAIN, DOWN*), or ''."""
        try:
            proc = self.run(["scontrol", "-o", "show", "node", self.node], check=False,
                            timeout=5)
        except subprocess.TimeoutExpired:
            return ""
        if proc.returncode != 0 or not proc.stdout.strip():
            return ""
        return parse_scontrol(proc.stdout.splitlines()[0]).get("State", "")

    def wait_idle(self, timeout: float = 30) -> None:
        """Wait until the node is IDLE (up, registered, not drained, no jobs)."""
        states = [""]

        def idle() -> bool:
            states.append(self.node_state())
            return states[-1] == "IDLE"

        try:
            self._wait_for(idle, timeout, f"node {self.node} to be IDLE", poll=0.2)
        except SlurmClusterError as e:
            raise SlurmClusterError(f"{e} (last state: {states[-1]!r})") from None

    def diagnostics(self) -> str:
        """Exit codes and log tails of the daemons, for error messages."""
        parts = []
        for name in DAEMONS:
            proc = self._procs.get(name)
            status = "not started" if proc is None else (
                "running" if proc.poll() is None else f"exited {proc.returncode}")
            parts.append(f"--- {name} ({status})")
            for path in (self.log(name), self.log_dir / f"{name}.out"):
                if path.exists():
                    parts.append(f"- {path}:\n{tail(path)}")
        return "\n".join(parts)

    # --- stop ----------------------------------------------------------------------------

    def stop(self, timeout: float = 10) -> None:
        """Stop the cluster: slurmctld and slurmd (SIGTERM, SIGKILL after `timeout`), then
        whatever job steps and tasks it left (SIGKILL, found by the cluster's token), then
        munged; last, the MPICH shared-memory segments that killed steps of its jobs left in
        /dev/shm. Touches no process that does not carry this cluster's token. Idempotent."""
        last_job_id = self._last_job_id()
        for name in ("slurmctld", "slurmd"):
            self._signal_daemon(name, signal.SIGTERM)
        for name in ("slurmctld", "slurmd"):
            self._reap_daemon(name, timeout)
        self.kill_leftovers(timeout)
        self._signal_daemon("munged", signal.SIGTERM)
        self._reap_daemon("munged", timeout)
        if last_job_id is not None:
            self.remove_mpich_segments(range(self.first_job_id, last_job_id + 1))

    def _last_job_id(self) -> int | None:
        """The highest job id slurmctld knows (None when it has none or does not answer)."""
        if "slurmctld" not in self._procs or self._procs["slurmctld"].poll() is not None:
            return None
        try:
            proc = self.run(["scontrol", "-o", "show", "jobs"], check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return None
        ids = [int(m) for m in re.findall(r"^JobId=(\d+)", proc.stdout, re.M)]
        return max(ids, default=None)

    @staticmethod
    def remove_mpich_segments(job_ids: Iterable[int], shm_dir: str = "/dev/shm") -> list[str]:
        """Delete the MPICH shared-memory segments of these jobs' steps (see
        mpickpt.launch.mpich_shm); returns the names deleted. Call only when none of them runs."""
        return remove_segments(job_ids, shm_dir)

    def _signal_daemon(self, name: str, sig: int) -> None:
        """Send a signal to a daemon this cluster started, if it still runs."""
        proc = self._procs.get(name)
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)

    def _reap_daemon(self, name: str, timeout: float) -> None:
        """Wait for a daemon to exit, SIGKILL it after `timeout`, and forget it."""
        proc = self._procs.get(name)
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        del self._procs[name]

    def leftover_pids(self) -> list[int]:
        """Live processes other than the daemons that carry this cluster's token, and their
        descendants (a job started with --export=NONE has no token, but its slurmstepd has):
        job steps (slurmstepd), batch scripts, tasks and anything they started."""
        marker = f"{TOKEN_VAR}={self.token}".encode()
        own = {os.getpid(), *self.pids().values()}
        live = [pid for pid in _pids() if pid not in own and _alive(pid)]
        found = {pid for pid in live if marker in _environ_of(pid).split(b"\0")}
        children: dict[int, list[int]] = {}
        for pid in live:
            children.setdefault(_ppid(pid), []).append(pid)
        todo = list(found)
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return sorted(found)

    def kill_leftovers(self, timeout: float = 10) -> list[int]:
        """SIGKILL the processes that `leftover_pids()` finds until none is left; returns
        the pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while (pids := self.leftover_pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        return killed

    def config(self) -> dict[str, str]:
        """The configuration slurmctld runs with (`scontrol show config`), as a dict; it shows
        where Slurm replaced a rejected value by its default."""
        lines = self.run(["scontrol", "show", "config"]).stdout.splitlines()
        pairs = (line.split("=", 1) for line in lines if " = " in line)
        return {k.strip(): v.strip() for k, v in pairs}

    def remove(self) -> None:
        """Delete the cluster's directory if the cluster created it (root=None); call after
        stop(). Set SLURM_TEST_KEEP=1 to keep it (logs, job output) for a post-mortem."""
        if self._procs:
            raise SlurmClusterError("remove() while daemons run: call stop() first")
        if self._owns_root and os.environ.get("SLURM_TEST_KEEP") != "1":
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def slurm_cluster_fixture(scope: str = "module", **cluster_kwargs):
    """A pytest fixture that yields a started SlurmCluster and stops it afterwards, or skips
    the test with `skip_reason()`. Assign it to a name in a test module or conftest:

        slurm = slurm_cluster_fixture(scope="module", kill_wait=2)
    """
    import pytest

    @pytest.fixture(scope=scope)
    def _slurm_cluster():
        reason = skip_reason()
        if reason:
            pytest.skip(reason)
        cluster = SlurmCluster(**cluster_kwargs)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()
            cluster.remove()

    return _slurm_cluster
