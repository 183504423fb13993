"""Launch checks and the MPICH segment cleanup, as the trainer, mpickpt-run and the sbatch script
use them: a launcher's task count against MPI's world size (in process, and one real 1-rank
trainer told by its environment that srun started 2 tasks), and stale `/dev/shm/mpich_shm_*`
segments named as MPICH names them for a Slurm job step, removed before each run while other jobs'
segments stay."""
import os
import subprocess
import sys

import pytest

from mpickpt.launch.checks import launch_error, launched_tasks
from mpickpt.launch.command import cleanup_command
from mpickpt.launch.mpich_shm import SHM_DIR, remove_segments, world_id
from mpickpt.launch.relaunch import Relauncher
from tests.launch import REPO, SMALL_MODEL


@pytest.mark.parametrize("name,launcher", [
    ("SLURM_STEP_NUM_TASKS", "srun"),
    ("PMI_SIZE", "PMI launcher"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
    ("PMIX_SIZE", "PMIx launcher"),
])
def test_n_tasks_but_a_world_of_one_is_an_error_naming_the_fix(name, launcher):
    error = launch_error(1, {name: "2"})
    assert error is not None
    assert "launched as 2 separate 1-rank jobs" in error and f"{name}=2" in error
    assert launcher in error
    assert "srun --mpi=pmi2" in error and "SRUN_MPI" in error and "mpi4py.get_config()" in error


@pytest.mark.parametrize("world,env", [
    (2, {"SLURM_STEP_NUM_TASKS": "2", "PMI_SIZE": "2"}),  # srun --mpi=pmi2: consistent
    (4, {"OMPI_COMM_WORLD_SIZE": "4"}),
    (1, {"SLURM_STEP_NUM_TASKS": "1", "PMI_SIZE": "1"}),  # a 1-rank job is one job
    (1, {"SLURM_NTASKS": "8"}),  # a batch script's job count is not a step's task count
    (1, {"SLURM_STEP_NUM_TASKS": ""}),
    (1, {}),
])
def test_consistent_launches_pass(world, env):
    assert launch_error(world, env) is None


def test_the_step_count_is_read_before_the_pmi_one():
    assert launched_tasks({"SLURM_STEP_NUM_TASKS": "3", "PMI_SIZE": "2"})[0] == 3
    assert launched_tasks({"PMI_SIZE": "x"}) is None


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "PMIX_", "OMPI_"))}
    return dict(env, OMP_NUM_THREADS="1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def test_the_trainer_stops_at_once_when_srun_started_singletons(tmp_path):
    """What `srun -n 2` without --mpi starts: a process that MPI sees alone while srun says 2."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "mpickpt.train", *SMALL_MODEL, "--num-batches",
                           "5", "--ckpt-dir", str(ckpt), "--digest"], capture_output=True,
                          text=True, timeout=120, env=_env(SLURM_STEP_NUM_TASKS="2"))
    assert proc.returncode == 2, proc.stderr
    assert "mpickpt-train: error: launched as 2 separate 1-rank jobs" in proc.stderr
    assert "SLURM_STEP_NUM_TASKS=2" in proc.stderr and "srun --mpi=pmi2" in proc.stderr
    assert "Traceback" not in proc.stderr and "digest" not in proc.stdout
    assert not ckpt.exists() or os.listdir(ckpt) == []  # stopped before anything was saved


# ---- stale MPICH segments -----------------------------------------------------------------------
JOB = 987_650_123  # no real job: its segments are made by the test


def _segments(shm, job, steps, kind="shm", node=0):
    paths = []
    for step in steps:
        path = os.path.join(shm, f"mpich_{kind}_{world_id(job, step)}_{node}")
        with open(path, "wb") as f:
            f.write(b"\0" * 64)
        paths.append(path)
    return paths


def test_world_id_is_mpichs_name_for_a_slurm_step():
    # seen on the real cluster (tests/test_slurm_cluster.py): job 4's step 0 left
    # /dev/shm/mpich_shm_a620f805_0; FNV-1a of "4.0"
    assert world_id(4, 0) == "a620f805"
    assert world_id(JOB, 3) != world_id(JOB, 4) != world_id(JOB + 1, 3)


def test_the_cleanup_module_removes_this_jobs_stale_segments_in_dev_shm_only():
    """What the sbatch script runs before each step (through mpickpt-run's cleanup command):
    `python -m mpickpt.launch.mpich_shm` with the job id from $SLURM_JOB_ID, in /dev/shm."""
    mine = _segments(SHM_DIR, JOB, [0, 1]) + _segments(SHM_DIR, JOB, [7], "vci", node=3)
    others = _segments(SHM_DIR, JOB + 1, [0]) + _segments(SHM_DIR, JOB, [300])
    try:
        cmd = cleanup_command("srun", None)
        if cmd is not None:  # srun installed: the module is what it runs on every node
            assert cmd[-3:] == [sys.executable, "-m", "mpickpt.launch.mpich_shm"]
        proc = subprocess.run([sys.executable, "-m", "mpickpt.launch.mpich_shm"],
                              capture_output=True, text=True, timeout=60,
                              env=_env(SLURM_JOB_ID=str(JOB)))
        assert proc.returncode == 0, proc.stderr
        assert [p for p in mine if os.path.exists(p)] == []
        assert all(os.path.exists(p) for p in others)  # another job's, a step beyond 255
        assert f"removed 3 stale MPICH segment(s) of job {JOB}" in proc.stderr
    finally:
        for p in mine + others:
            if os.path.exists(p):
                os.unlink(p)


def test_the_cleanup_needs_a_job_id():
    proc = subprocess.run([sys.executable, "-m", "mpickpt.launch.mpich_shm"],
                          capture_output=True, text=True, timeout=60, env=_env())
    assert proc.returncode == 2 and "--job is needed" in proc.stderr


def test_mpickpt_run_cleans_before_every_run(tmp_path):
    """Each run stands for a step that leaves its segment behind when it is killed: the run finds
    none of its job's segments at its start only because the cleanup ran before it."""
    shm = tmp_path / "shm"
    shm.mkdir()
    stale = _segments(str(shm), JOB, [0])[0]
    other = _segments(str(shm), JOB + 1, [0])[0]
    seen = tmp_path / "seen"
    run = (f"import os, sys\n"
           f"open({str(seen)!r}, 'a').write(str(os.path.exists({stale!r})))\n"
           f"open({stale!r}, 'w').close()\n"  # the step dies and leaves its segment
           f"sys.exit(0 if os.path.getsize({str(seen)!r}) > 5 else 137)\n")
    cleanup = [sys.executable, "-m", "mpickpt.launch.mpich_shm", "--job", str(JOB),
               "--shm-dir", str(shm)]
    status = Relauncher([sys.executable, "-c", run], max_restarts=2, log_path=None,
                        cleanup=cleanup, say=lambda line: None).run()
    assert status == 0
    assert seen.read_text() == "FalseFalse"  # two runs, each started without the segment
    assert os.path.exists(other)
    assert remove_segments([JOB], str(shm)) == [os.path.basename(stale)]


def test_orphaned_segments_of_this_run_are_removed_and_held_or_older_ones_kept(tmp_path):
    """remove_orphans: an MPI segment that appeared since the run started and that no process of
    this user holds goes; one still mapped or open by a process, one from before the run, and
    files that are not MPI segments stay."""
    import time

    from mpickpt.launch.mpich_shm import remove_orphans

    old = tmp_path / "mpich_shm_abc_0"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 600, time.time() - 600))
    since = time.time()
    names = ["mpich_shm_1f2e_0", "mpich_vci_1f2e_1", "vader_segment.vm.1.0", "mpich_shm_beef_0",
             "mpich_shm_cafe_0", "notes.txt"]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); "
         "g = open(sys.argv[2], 'r+b'); m = mmap.mmap(g.fileno(), 4096); g.close(); "
         "print('ok', flush=True); time.sleep(60)", str(tmp_path / "mpich_shm_beef_0"),
         str(tmp_path / "mpich_shm_cafe_0")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        removed = remove_orphans(since, str(tmp_path))
        assert removed == ["mpich_shm_1f2e_0", "mpich_vci_1f2e_1", "vader_segment.vm.1.0"]
        assert sorted(os.listdir(tmp_path)) == ["mpich_shm_abc_0", "mpich_shm_beef_0",
                                                "mpich_shm_cafe_0", "notes.txt"]
    finally:
        holder.kill()
        holder.wait()
    assert remove_orphans(since, str(tmp_path)) == ["mpich_shm_beef_0", "mpich_shm_cafe_0"]


def test_stale_segments_of_any_run_go_once_unheld_and_older_than_the_grace(tmp_path):
    """remove_stale: what a run killed as a whole left (no agent of it removed it) goes at the
    next start when no process holds it and nobody changed it for the grace period; a segment
    just created (a job starting beside it) and one still mapped stay."""
    import time

    from mpickpt.launch.mpich_shm import remove_stale

    old = time.time() - 600
    for name in ("mpich_shm_dead_0", "vader_segment.vm.2.0", "mpich_shm_beef_0", "other.txt"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        os.utime(tmp_path / name, (old, old))
    (tmp_path / "mpich_shm_cafe_0").write_bytes(b"\0" * 4096)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys, time; g = open(sys.argv[1], 'r+b'); "
         "m = mmap.mmap(g.fileno(), 4096); g.close(); print('ok', flush=True); time.sleep(60)",
         str(tmp_path / "mpich_shm_beef_0")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        assert remove_stale(str(tmp_path)) == ["mpich_shm_dead_0", "vader_segment.vm.2.0"]
        assert sorted(os.listdir(tmp_path)) == ["mpich_shm_beef_0", "mpich_shm_cafe_0",
                                                "other.txt"]
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale(str(tmp_path)) == ["mpich_shm_beef_0"]
    assert remove_stale(str(tmp_path), grace_s=0.0) == ["mpich_shm_cafe_0"]


def test_stale_staging_areas_are_those_of_gone_processes_of_this_pid_namespace_only():
    """A PID names a process only inside its PID namespace, and containers that share /dev/shm
    have their own: a staging area's name carries its creator's namespace, and the clean-up
    removes this user's areas of gone processes of this namespace (and of names from before
    the namespace was in them), never a live one's, another namespace's or another user's."""
    from mpickpt import owned_names
    from mpickpt.engine import staging

    if staging.SHM_DIR is None:
        pytest.skip("no /dev/shm")
    area = staging.StagingArea({"x": ((4,), "<f4")})
    ns, prefix = owned_names.pid_namespace(), staging.PREFIX
    try:
        name = os.path.basename(area.path)
        assert ns.isdigit() and name.startswith(f"{prefix}{os.getpid()}-{ns}-"), name
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True).stdout.strip()
        names = {"dead": f"{prefix}{gone}-{ns}-0123abcd",
                 "legacy": f"{prefix}{gone}-0123abcd",
                 "foreign": f"{prefix}{gone}-{int(ns) + 1}-0123abcd",
                 "live": f"{prefix}{os.getpid()}-{ns}-0123abcd"}
        mine = lambda n: os.getuid()  # noqa: E731
        judged = {k: owned_names.stale(n, prefix, mine, ns, legacy=True)
                  for k, n in names.items()}
        assert judged == {"dead": True, "legacy": True, "foreign": False, "live": False}
        assert not owned_names.stale(names["legacy"], prefix, mine, ns)  # legacy off
        assert not owned_names.stale(names["dead"], prefix, lambda n: os.getuid() + 1, ns)
        assert not owned_names.stale(names["dead"], prefix, lambda n: None, ns)
        assert not owned_names.stale(f"{prefix}{gone}-0-0123abcd", prefix, mine, "0")  # unknown
        paths = [os.path.join(staging.SHM_DIR, n) for n in names.values()]
        for p in paths:
            open(p, "wb").close()
        try:
            removed = staging.remove_stale_areas()
            assert {names["dead"], names["legacy"]} <= set(removed)  # and any real leftover
            assert [os.path.exists(p) for p in paths] == [False, False, True, True]
            assert os.path.exists(area.path)
        finally:
            for p in paths:
                if os.path.exists(p):
                    os.unlink(p)
    finally:
        area.close()
