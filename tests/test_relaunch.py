"""mpickpt-run's relaunch loop with real child processes standing in for the launcher (each run
exits with the next status of a script), the cause read from a run's output, the launch commands
it builds, its refusals, and signals sent to it reaching the run and ending the loop."""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from mpickpt.launch.command import (agents_respawn, launch_command, mpi_flavour,
                                     open_mpi_flavour)
from mpickpt.launch import relaunch
from mpickpt.launch.relaunch import (Relauncher, RunWatch, cause, ckpt_dir_of, command_fault,
                                     failure_of, main, repeated)
from mpickpt.launch.run_store import AgentWatch
from mpickpt.exit_codes import EXIT_SAVED
from mpickpt.job_variables import AGENTS_VARIABLE
from mpickpt.mpiexec import mpiexec


def runs(tmp_path, statuses, lines="", agent=True):
    """A command that, on its k-th run, starts as a launcher with one rank does (`agent`: its
    agent connects to the run's agent watch), prints `lines` and exits with statuses[k]."""
    counter = tmp_path / "count"
    script = tmp_path / "run.py"
    script.write_text(
        "import os, sys\n"
        "from mpickpt.launch.run_store import announce, goodbye\n"
        f"if {agent}: goodbye(announce(os.environ.get({AGENTS_VARIABLE!r}), 0))\n"
        f"p = {str(counter)!r}\n"
        "k = int(open(p).read()) if os.path.exists(p) else 0\n"
        "open(p, 'w').write(str(k + 1))\n"
        f"sys.stdout.write({lines!r})\n"
        f"sys.exit({list(statuses)!r}[k])\n")
    return [sys.executable, str(script)], counter


def test_relaunches_failures_until_one_succeeds_and_logs_each_cause(tmp_path, capsys):
    died = ("mpickpt: rank 0: peer rank(s) [3] died after step 41 (its connection closed); "
            "survivor state ...\n")
    cmd, counter = runs(tmp_path, [76, 137, 0], died)
    log = tmp_path / "ckpt" / "mpickpt-restarts.log"
    log.parent.mkdir()
    assert Relauncher(cmd, max_restarts=3, log_path=str(log)).run() == 0
    assert counter.read_text() == "3"
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    assert "run 1 failed" in lines[0] and "rank(s) [3] died after step 41" in lines[0]
    assert "relaunching (restart 1 of 3)" in lines[0]
    assert "restart 2 of 3" in lines[1]
    assert "run 3 finished" in capsys.readouterr().err


@pytest.mark.parametrize("status", [2, 74, 75])
def test_bad_input_and_a_stop_end_the_loop(tmp_path, status):
    """2: bad input; 75: stopped on a signal, saved; 74: stopped, the emergency checkpoint
    failed (a stop was asked for: a relaunch would go against it)."""
    cmd, counter = runs(tmp_path, [status, 0])
    assert Relauncher(cmd, max_restarts=3, log_path=None).run() == status
    assert counter.read_text() == "1"


def test_gives_up_after_max_restarts_with_the_last_status(tmp_path):
    cmd, counter = runs(tmp_path, [9, 9, 9, 9])
    log = tmp_path / "restarts.log"
    assert Relauncher(cmd, max_restarts=2, log_path=str(log)).run() == 9
    assert counter.read_text() == "3"
    assert "no restarts left (--max-restarts 2)" in log.read_text().splitlines()[-1]


def test_a_startup_error_that_repeats_ends_the_loop(tmp_path):
    """A startup that fails twice with the same error (a trainer's traceback, then its 'startup
    failed' line) is a fault of the command or its input, which every relaunch repeats: the
    second failure ends the loop, naming the error; a peer's death is not relaunched alike."""
    failed = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
              "[rank1]: ValueError: shard Shard(table=1) does not fit tables of [3, 1]\n"
              "mpickpt-train: startup failed in building the model and restoring; exit "
              "status 77 for a relaunch\n")
    cmd, counter = runs(tmp_path, [77, 77, 77, 0], failed)
    log = tmp_path / "restarts.log"
    assert Relauncher(cmd, max_restarts=3, log_path=str(log)).run() == 77
    assert counter.read_text() == "2"
    first, second = log.read_text().splitlines()
    assert "(a rank's startup failed: ValueError: shard Shard(table=1) does not fit" in first
    assert "relaunching (restart 1 of 3)" in first
    assert second.endswith("the same startup error as the run before: a fault a relaunch "
                           "repeats, not a peer's death; not relaunching"), second
    watch = RunWatch()
    for line in failed.splitlines():
        watch.read(line + "\n")
    assert watch.error.startswith("ValueError: shard")
    same = failure_of(77, watch)
    assert repeated(failure_of(77, watch), same) and not repeated(failure_of(77, watch), None)
    assert not repeated(failure_of(77, watch),
                        (77, frozenset({"RuntimeError: Connection closed"})))
    assert failure_of(77, RunWatch()) is None  # no error line: a deadline
    watch.read("EXIT CODE: 9\n")  # a rank killed: a death, whatever the errors say
    assert failure_of(77, watch) is None and not repeated(failure_of(77, watch), same)


@pytest.mark.parametrize("in_place", ["auto", "off"])
def test_a_launcher_that_refuses_its_command_twice_alike_ends_the_loop_as_bad_input(
        tmp_path, monkeypatch, in_place):
    """A real mpiexec given an argument it does not know starts no rank's agent: once is
    relaunched (a launcher may fail for a passing reason), the same refusal again ends the loop
    with exit 2, which the Slurm script does not requeue, in place or not; runs whose agents
    started, or whose output differs, are not taken for a refusal."""
    monkeypatch.setattr(relaunch, "REFUSAL_RETRY_S", 0.1)
    log = tmp_path / "restarts.log"
    status = main(["-n", "1", "--max-restarts", "3", "--launcher-arg=--bogus",
                   "--restart-log", str(log), "--", "--num-batches", "2", "--in-place",
                   in_place])
    first, second = log.read_text().splitlines()
    assert status == 2
    assert "no node agent started ([mpiexec@" in first and "unrecognized argument bogus" \
        in first and "relaunching (restart 1 of 3)" in first
    assert second.endswith("no node agent started, with the same output as the run before: a "
                           "fault of the launcher's command, which a relaunch or a requeue "
                           "repeats; not relaunching (exit status 2)"), second
    refusal = RunWatch(started=False)
    refusal.read("srun: error: Invalid MPI type 'x', --mpi=list for acceptable types\n")
    same = failure_of(1, refusal)
    assert repeated(failure_of(1, refusal), same)
    assert "no node agent started (srun: error: Invalid MPI type" in cause(1, refusal)
    other = RunWatch(started=False)
    other.read("srun: error: Unable to create step for job 9: Socket timed out\n")
    ran = RunWatch(started=True)
    ran.read("srun: error: Invalid MPI type 'x', --mpi=list for acceptable types\n")
    assert not repeated(failure_of(1, other), same) and not repeated(failure_of(1, ran), same)
    assert "no node agent started" not in cause(1, ran) and failure_of(0, refusal) is None
    faults = ["srun: unrecognized option '--bogus'", 'mpirun: Error: unknown option "--x"',
              "srun: error: Invalid numeric value \"x\" for --nodes.",
              'srun: error: unrecognized --cpu-bind argument "numa"',
              "srun: error: Invalid --distribution specification",
              "srun: error: Failed to parse --gres=gpu:x"]
    cluster = ["srun: error: Invalid node name specified", "srun: error: Unable to create step",
               "ssh: Could not resolve hostname n1: Name or service not known (unknown host)"]
    assert command_fault(refusal) and all(command_fault(RunWatch(head=[h])) for h in faults)
    assert not any(command_fault(RunWatch(head=[h])) for h in cluster)


def test_a_refusal_that_names_no_command_fault_ends_the_allocations_loop_with_its_status(
        tmp_path, monkeypatch):
    """srun failing twice alike to create a step (a timeout, no agent started): a relaunch in
    this allocation repeats it, but a requeue onto another may not; the loop ends with the
    launcher's status, which the Slurm script requeues, after waiting before the relaunch."""
    monkeypatch.setattr(relaunch, "REFUSAL_RETRY_S", 0.5)
    cmd, counter = runs(tmp_path, [1, 1, 1, 0], "srun: error: Unable to create step for job 9: "
                        "Socket timed out on send/recv operation\n", agent=False)
    log = tmp_path / "restarts.log"
    start = time.monotonic()
    assert Relauncher(cmd, max_restarts=3, log_path=str(log)).run() == 1
    assert counter.read_text() == "2" and time.monotonic() - start >= 0.5
    first, second = log.read_text().splitlines()
    assert "no node agent started (srun: error: Unable to create step" in first
    assert second.endswith("a relaunch in this allocation repeats it; not relaunching (exit "
                           "status 1)"), second


def test_a_stop_signal_during_the_wait_before_a_relaunch_ends_the_loop(tmp_path, monkeypatch):
    """SIGTERM (a time limit, scancel) while the loop waits to relaunch a refused run has no
    launcher to reach: the loop ends at once with the failed run's status instead of starting
    a run that would never hear of the stop."""
    monkeypatch.setattr(relaunch, "REFUSAL_RETRY_S", 60.0)
    cmd, counter = runs(tmp_path, [1, 0], "srun: error: Unable to create step for job 9\n",
                        agent=False)
    log = tmp_path / "restarts.log"

    def stop_in_the_wait():
        deadline = time.monotonic() + 60
        while not counter.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # the run has ended: the loop waits to relaunch it
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=stop_in_the_wait, daemon=True)
    killer.start()
    start = time.monotonic()
    assert Relauncher(cmd, max_restarts=3, log_path=str(log)).run() == 1
    killer.join()
    assert counter.read_text() == "1" and time.monotonic() - start < 30
    assert log.read_text().splitlines()[-1].endswith(
        " SIGTERM received before run 2 started: not relaunching")


def test_a_stop_signal_during_the_clean_up_before_the_first_run_starts_none(tmp_path):
    """SIGTERM while the clean-up step runs, before any launcher: none is started (it would
    get the signal before it could handle it), and the loop ends as a stop with the state on
    disk (exit 75, which train.sbatch requeues)."""
    cmd, counter = runs(tmp_path, [0], "", agent=False)
    log = tmp_path / "restarts.log"
    stop = [sys.executable, "-c", "import os, signal; os.kill(os.getppid(), signal.SIGTERM)"]
    assert Relauncher(cmd, max_restarts=3, log_path=str(log), cleanup=stop).run() == EXIT_SAVED
    assert not counter.exists()
    assert log.read_text().splitlines()[-1].endswith(
        " SIGTERM received before run 1 started: not launching")


def test_an_agent_says_it_started_to_the_agent_watch_in_place_or_not_at_any_size():
    """The run's agent watch counts a 1-rank run's agent too, and works without a store (not in
    place): a failed run whose agent started is never taken for the launcher's refusal."""
    watch = AgentWatch()
    try:
        env = dict(os.environ, **{AGENTS_VARIABLE: watch.address}, PMI_RANK="0", PMI_SIZE="1")
        proc = subprocess.run([sys.executable, "-m", "mpickpt.launch.rank_wrapper",
                               sys.executable, "-c", "import sys; sys.exit(3)"], env=env)
        assert proc.returncode == 3 and watch.started() and watch.lost == set()
    finally:
        watch.close()


def test_cause_names_the_dead_rank_the_signal_and_the_launcher_note():
    watch = RunWatch()
    for line in ["step 5/10\n",
                 "mpickpt: rank 1: peer rank(s) [2] died after step 7 (silent for 10 s); x\n",
                 "mpickpt: rank 0: peer rank(s) [2] died after step 7 (reported by rank 1); x\n",
                 "srun: error: node1: task 2: Killed\n"]:
        watch.read(line)
    text = cause(137, watch)
    assert "rank(s) [2] died after step 7 (silent for 10 s)" in text
    failed = RunWatch()
    failed.read("mpickpt: rank 0: peer rank(s) [1] died after step 85 (in-place recovery failed "
                "(generation 4: rank(s) [1] did not join within 60 s); noticed 2026-12-07T01:"
                "02:03+00:00); no survivor dump; exiting for a relaunch (status 76)\n")
    assert cause(76, failed) == ("rank(s) [1] died after step 85 (in-place recovery failed "
                                 "(generation 4: rank(s) [1] did not join within 60 s)); the "
                                 "survivors exited 76")
    assert "SIGKILL" in text and "task 2: Killed" in text
    assert cause(1, RunWatch()) == "exit status 1"
    startup = RunWatch()
    startup.read("mpickpt-agent: rank 1: its trainer (pid 4242) was killed by SIGKILL during "
                 "startup, before its first step; ending this rank the same way so that the "
                 "launcher ends the run\n")
    assert cause(9, startup) == ("rank 1's trainer was killed by SIGKILL during startup; exit "
                                 "status 9")
    assert "killed by SIGTERM" in cause(-15, RunWatch())


def test_ckpt_dir_is_found_among_the_trainer_flags():
    assert ckpt_dir_of(["--num-batches", "3", "--ckpt-dir", "/x/y"]) == "/x/y"
    assert ckpt_dir_of(["--ckpt-dir=/z"]) == "/z"
    assert ckpt_dir_of(["--digest"]) is None


def test_launch_commands():
    srun = launch_command("srun", None, ["--digest"], ["-N2"], srun_mpi="pmix")
    assert srun[:3] == ["srun", "--mpi=pmix", "--kill-on-bad-exit=0"] and "-N2" in srun
    assert srun[-3:] == ["-m", "mpickpt.train", "--digest"]
    assert srun[4:7] == [sys.executable, "-m", "mpickpt.launch.rank_wrapper"]  # an agent per task
    assert agents_respawn("srun")
    assert mpi_flavour(mpiexec()) == "hydra"
    hydra = launch_command("mpiexec", 4, ["--digest"])
    assert hydra[1:4] == ["-disable-auto-cleanup", "-n", "4"]
    assert hydra[4:7] == [sys.executable, "-m", "mpickpt.launch.rank_wrapper"]
    with pytest.raises(ValueError, match="needs the number of ranks"):
        launch_command("mpiexec", None, [])


@pytest.mark.parametrize("version,flavour", [
    ("mpirun.openmpi (OpenRTE) 4.1.4\n\nReport bugs to ...", "openmpi"),
    ("mpirun (Open MPI) 4.0.3", "openmpi"),
    ("mpirun (Open MPI) 5.0.6\n", "prrte"),
    ("prterun (PMIx Reference RunTime Environment) 3.0.3", "prrte"),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", "unknown"),
])
def test_open_mpi_versions(version, flavour):
    assert open_mpi_flavour(version) == flavour


def test_open_mpi_ranks_run_under_agents_that_may_end_without_finalize():
    if not os.path.exists("/usr/bin/mpirun.openmpi"):
        pytest.skip("Open MPI is not installed")
    program = "/usr/bin/mpirun.openmpi"
    if mpi_flavour(program) != "openmpi":
        pytest.skip(f"{program} is not Open MPI 4.x")
    cmd = launch_command("mpiexec", 3, ["--digest"], ["--oversubscribe"], program=program)
    assert cmd[:4] == [program, "--mca", "orte_allowed_exit_without_sync", "1"]
    exported = [cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"]
    assert exported == ["MPICKPT_IN_PLACE", "MPICKPT_RESTART", "MPICKPT_STORE", "MPICKPT_AGENTS",
                        "MPICKPT_WARM_RESPAWN", "MPICKPT_SIGUSR1_NOTICES"]
    at = cmd.index("-n")
    assert cmd[at:at + 6] == ["-n", "3", "--oversubscribe", sys.executable, "-m",
                              "mpickpt.launch.rank_wrapper"]
    assert agents_respawn("mpiexec", program) and agents_respawn("mpiexec")
    assert not agents_respawn("mpiexec", "/bin/true")


@pytest.mark.parametrize("argv,message", [
    (["--max-restarts", "-1", "--"], "--max-restarts -1: expected 0 or more"),
    (["-n", "0", "--"], "-n 0: expected 1 or more ranks"),
    (["--launcher", "mpiexec", "--"], "needs the number of ranks"),
])
def test_refusals(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


_STARTED_THEN_KILLED = ("import os; open(os.path.join(os.environ['MPICKPT_AGENT_DIR'], "
                        "'started'), 'w').close(); os.kill(os.getpid(), 9)")


def test_the_rank_wrapper_turns_a_death_by_signal_into_a_status():
    """After its trainer said it started; before that, the wrapper dies by the same signal."""
    proc = subprocess.run([sys.executable, "-m", "mpickpt.launch.rank_wrapper", sys.executable,
                           "-c", _STARTED_THEN_KILLED])
    assert proc.returncode == 128 + 9
    proc = subprocess.run([sys.executable, "-m", "mpickpt.launch.rank_wrapper", sys.executable,
                           "-c", "import os; os.kill(os.getpid(), 9)"], capture_output=True,
                          text=True)
    assert proc.returncode == -9, proc.stderr
    assert "killed by SIGKILL during startup, before its first step" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "mpickpt.launch.rank_wrapper", sys.executable,
                           "-c", "import sys; sys.exit(76)"])
    assert proc.returncode == 76


def test_the_folder_of_a_sigkilled_agent_goes_with_the_next_agent(tmp_path):
    """A SIGKILL runs no clean-up (hydra SIGKILLs a node's ranks when one ends by a signal):
    the next agent removes the folder of an agent of this PID namespace that is gone, names
    it, and leaves its own nowhere."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    killed = subprocess.run([sys.executable, "-m", "mpickpt.launch.rank_wrapper",
                             sys.executable, "-c", "import os; print(os.environ["
                             "'MPICKPT_AGENT_DIR'], flush=True); os.kill(os.getppid(), 9)"],
                            capture_output=True, text=True, env=env)
    assert killed.returncode == -9, killed.stderr
    left = killed.stdout.strip()
    assert os.path.isdir(left) and os.path.dirname(left) == str(tmp_path)
    pid, namespace = os.path.basename(left)[len("mpickpt-agent-"):].split("-")[:2]
    assert pid.isdigit() and not os.path.exists(f"/proc/{pid}") and namespace == \
        str(os.stat("/proc/self/ns/pid").st_ino)
    other = tmp_path / "mpickpt-agent-1-0-abc"  # another namespace's (or a name of old)
    other.mkdir()
    after = subprocess.run([sys.executable, "-m", "mpickpt.launch.rank_wrapper",
                            sys.executable, "-c", "pass"], capture_output=True, text=True,
                           env=env)
    assert after.returncode == 0, after.stderr
    assert f"removed 1 folder(s) of agents that are gone: {os.path.basename(left)}" in \
        after.stderr, after.stderr
    assert sorted(os.listdir(tmp_path)) == [other.name]


def test_a_signal_to_mpickpt_run_reaches_the_run_and_ends_the_loop(tmp_path):
    marker = tmp_path / "got"
    child = (f"import signal, sys, time, pathlib\n"
             f"def h(s, f):\n"
             f"    pathlib.Path({str(marker)!r}).write_text(str(s)); sys.exit(75)\n"
             f"signal.signal(signal.SIGTERM, h)\n"
             f"print('ready', flush=True)\n"
             f"time.sleep(60)\n")
    driver = (f"import sys\nfrom mpickpt.launch.relaunch import Relauncher\n"
              f"sys.exit(Relauncher([sys.executable, '-c', {child!r}], 3, None).run())\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 75 and time.monotonic() - start < 10
    assert marker.read_text() == str(int(signal.SIGTERM))
    assert "SIGTERM received" in proc.stderr.read()
    assert not os.path.exists(tmp_path / "count")
