"""The throwaway Slurm cluster of tests/slurm_cluster.py starts, runs jobs, requeues them and
stops without leaving its processes behind."""
import os
import subprocess
import sys
import time

import pytest

from mpickpt.launch.mpich_shm import world_id as mpich_world_id
from tests.slurm_cluster import (SlurmCluster, SlurmClusterError, parse_scontrol, skip_reason,
                                 slurm_cluster_fixture)

slurm = slurm_cluster_fixture(scope="module")


def wait_for_text(path, text, timeout=30):
    """Wait until the file exists and contains `text`; returns its content."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return path.read_text()
        time.sleep(0.1)
    content = path.read_text() if path.exists() else "<missing>"
    raise AssertionError(f"{text!r} not in {path} after {timeout}s: {content!r}")


def test_parse_scontrol_keeps_values_with_spaces():
    rec = parse_scontrol("JobId=7 JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0 "
                         "Comment=a b c WorkDir=/tmp/x y")
    assert rec["JobState"] == "FAILED"
    assert rec["ExitCode"] == "3:0"
    assert rec["Comment"] == "a b c"
    assert rec["WorkDir"] == "/tmp/x y"


def test_slurmctld_runs_with_the_written_config(slurm):
    # Slurm replaces some rejected values silently (logging an error), e.g. MinJobAge=0 -> 2 s.
    conf = slurm.config()
    assert conf["MinJobAge"] == "86400 sec"
    assert conf["KillWait"] == f"{slurm.kill_wait} sec"
    assert conf["MpiDefault"] == "none"
    assert conf["FirstJobId"] == str(slurm.first_job_id)
    assert conf["SlurmctldPort"] == str(slurm.ctld_port)
    assert f"cred_expire={slurm.cred_expire}" in conf["AuthInfo"]
    assert conf["ProctrackType"] == "proctrack/linuxproc"


def test_srun_runs_two_tasks(slurm):
    out = slurm.run(["srun", "-n", "2", "hostname"]).stdout.splitlines()
    assert out == [slurm.node, slurm.node]


def test_four_tasks_fit_on_the_node(slurm):
    out = slurm.run(["srun", "-n", "4", "--mpi=none", "printenv", "SLURM_PROCID"]).stdout
    assert sorted(out.split()) == ["0", "1", "2", "3"]


def test_sbatch_job_writes_its_output(slurm):
    out = slurm.job_dir / "hello.out"
    job = slurm.sbatch("#!/bin/bash\necho hello from $SLURM_JOB_ID on $SLURMD_NODENAME\n",
                       f"--output={out}")
    result = slurm.wait_job(job, timeout=30)
    assert (result.state, result.exit_code) == ("COMPLETED", 0)
    assert out.read_text() == f"hello from {job} on {slurm.node}\n"


def test_failing_job_reports_its_exit_code(slurm):
    job = slurm.sbatch("#!/bin/bash\nexit 3\n", f"--output={slurm.job_dir / 'fail.out'}")
    result = slurm.wait_job(job, timeout=30)
    assert (result.state, result.exit_code, result.signal) == ("FAILED", 3, 0)


def test_requeued_job_runs_again(slurm):
    # With a job step running, an immediate restart would race slurmd's credential revocation
    # (see SlurmCluster.requeue); the step makes this test catch that.
    out = slurm.job_dir / "requeue.out"
    job = slurm.sbatch("#!/bin/bash\necho run ${SLURM_RESTART_COUNT:-0}\nsrun -n 1 sleep 60\n",
                       "--requeue", "--open-mode=append", f"--output={out}")
    wait_for_text(out, "run 0")
    started = time.monotonic()
    slurm.requeue(job)
    wait_for_text(out, "run 1")
    assert time.monotonic() - started < 10
    assert slurm.job_info(job)["Restarts"] == "1"
    slurm.run(["scancel", str(job)])
    assert slurm.wait_job(job, timeout=30).state == "CANCELLED"
    runs = [line for line in out.read_text().splitlines() if line.startswith("run ")]
    assert runs == ["run 0", "run 1"]


def test_job_ids_start_at_the_clusters_own_first_id(slurm):
    job = slurm.sbatch("#!/bin/bash\ntrue\n", f"--output={slurm.job_dir / 'id.out'}")
    assert job >= slurm.first_job_id >= 10_000
    assert slurm.wait_job(job, timeout=30).state == "COMPLETED"


def test_mpich_world_id_is_fnv1a_of_job_dot_step():
    assert mpich_world_id(4, 0) == "a620f805"  # seen as /dev/shm/mpich_shm_a620f805_0
    assert mpich_world_id(9, 0) == "e200f4fa"


def _mpich_mpi4py():
    """Whether mpi4py is importable here and built on MPICH (whose segments the test knows)."""
    proc = subprocess.run([sys.executable, "-c",
                           "from mpi4py import MPI; print(MPI.Get_library_version())"],
                          capture_output=True, text=True)
    return proc.returncode == 0 and proc.stdout.startswith("MPICH")


def test_stop_removes_the_shm_segments_of_killed_mpi_steps(tmp_path):
    reason = skip_reason() or (None if _mpich_mpi4py() else "mpi4py on MPICH not installed")
    if reason:
        pytest.skip(reason)
    prog = tmp_path / "mpi_sleep.py"
    prog.write_text("import sys, time\nfrom mpi4py import MPI\nMPI.COMM_WORLD.Barrier()\n"
                    "open(sys.argv[1] + str(MPI.COMM_WORLD.Get_rank()), 'w').close()\n"
                    "time.sleep(60)\n")
    cluster = SlurmCluster()
    try:
        with cluster:
            out = cluster.job_dir / "mpi.out"
            job = cluster.sbatch(f"#!/bin/bash\nsrun --mpi=pmi2 {sys.executable} {prog} "
                                 f"{tmp_path / 'ready'}\n", "-n", "2", f"--output={out}")
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
                state = cluster.job_info(job)["JobState"]
                assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, (
                    f"{state}: {out.read_text() if out.exists() else ''}")
                time.sleep(0.1)
            segment = f"/dev/shm/mpich_shm_{mpich_world_id(job, 0)}_0"
            assert os.path.exists(segment)
            cluster.run(["scancel", "--signal=KILL", str(job)])
            assert cluster.wait_job(job, timeout=30).state in ("CANCELLED", "FAILED")
            assert os.path.exists(segment)  # a killed step leaves its segment behind
        assert not os.path.exists(segment)
    finally:
        cluster.remove()


def test_wait_job_times_out(slurm):
    job = slurm.sbatch("#!/bin/bash\nsleep 60\n", f"--output={slurm.job_dir / 'slow.out'}")
    with pytest.raises(SlurmClusterError, match="still"):
        slurm.wait_job(job, timeout=0.5)
    slurm.run(["scancel", str(job)])
    assert slurm.wait_job(job, timeout=30).state == "CANCELLED"


def _alive(pid):
    """Whether a process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_stop_leaves_none_of_its_processes_and_only_those(tmp_path):
    bystander = subprocess.Popen(["sleep", "60"])  # not the cluster's: must survive stop()
    cluster = SlurmCluster()
    try:
        with cluster:
            daemons = cluster.pids()
            assert sorted(daemons) == ["munged", "slurmctld", "slurmd"]
            pids_file = tmp_path / "task_pids"
            job = cluster.sbatch(f"#!/bin/bash\necho $$ >> {pids_file}\n"
                                 f"srun -n 2 bash -c 'echo $$ >> {pids_file}; sleep 60'\n",
                                 "-n", "2", f"--output={cluster.job_dir / 'stop.out'}")
            # A process that dropped the environment: found as a descendant of its batch script.
            bare = cluster.sbatch(f"#!/bin/bash\n"
                                  f"env -i bash -c 'echo $$ >> {pids_file}; exec sleep 60'\n",
                                  f"--output={cluster.job_dir / 'bare.out'}")
            cluster.wait_state(job, {"RUNNING"})
            cluster.wait_state(bare, {"RUNNING"})
            deadline = time.monotonic() + 30
            while not (pids_file.exists() and len(pids_file.read_text().split()) == 4):
                assert time.monotonic() < deadline, "job's tasks did not start"
                time.sleep(0.1)
            job_pids = [int(p) for p in pids_file.read_text().split()]
            assert set(job_pids) <= set(cluster.leftover_pids())
        stopped = time.monotonic()
        while any(map(_alive, [*daemons.values(), *job_pids])) and time.monotonic() < stopped + 5:
            time.sleep(0.05)
        assert not [p for p in daemons.values() if _alive(p)]
        assert not [p for p in job_pids if _alive(p)]
        assert cluster.leftover_pids() == []
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        cluster.remove()


@pytest.mark.skipif(skip_reason() is not None, reason=str(skip_reason()))
def test_failed_start_reports_logs_and_leaves_nothing():
    cluster = SlurmCluster(extra_conf=["SelectType=select/no_such_plugin"])
    with pytest.raises(SlurmClusterError) as err:
        cluster.start(timeout=15)
    assert "slurmctld" in str(err.value)
    assert "no_such_plugin" in str(err.value)
    assert cluster.pids() == {}
    assert cluster.leftover_pids() == []
    cluster.remove()


def test_skip_reason_is_none_when_the_fixture_ran(slurm):
    assert skip_reason() is None
    assert os.environ.get("SLURM_CONF") is None  # the cluster never leaks into os.environ
