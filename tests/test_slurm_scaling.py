"""slurm/scaling.sbatch as shipped, on a real single-node Slurm cluster (tests/slurm_cluster.py): a
job array of two sizes appends 1- and 2-rank points launched by srun to one JSON; without an MPI
plugin (srun starts independent 1-rank jobs) the sweep stops with a message instead of recording
1-rank points as 2-rank ones. Skipped with the reason where Slurm is not installed or this is not
root."""
import json
import sys
import time
from pathlib import Path

from tests.launch import REPO
from tests.slurm_cluster import FINAL_STATES, parse_scontrol, slurm_cluster_fixture

slurm = slurm_cluster_fixture(scope="module")
SCRIPT = REPO / "slurm" / "scaling.sbatch"


def submit(slurm, tmp_path, *options: str, **env) -> tuple[int, Path]:
    out = tmp_path / "scaling.json"
    job_env = dict(VENV=str(Path(sys.executable).parents[1]), PYTHONPATH=str(REPO),
                   SCALING_OUT=str(out), SCRATCH_DIR=str(tmp_path), EXTRA="--quick",
                   MPICKPT_HOST_CLASS="slurm-test", **env)
    job = slurm.sbatch(SCRIPT, "-N", "1", "--ntasks=2", "--cpus-per-task=1", f"--chdir={REPO}",
                       f"--output={tmp_path}/job-%A_%a.out", "--time=10", *options, env=job_env)
    return job, out


def wait_all(slurm, job: int, timeout: float = 300) -> list[dict]:
    """Every element of (array) job `job` once all are in a final state."""
    deadline = time.monotonic() + timeout
    while True:
        lines = slurm.run(["scontrol", "-o", "show", "job", str(job)]).stdout.splitlines()
        infos = [parse_scontrol(line) for line in lines if line.strip()]
        if infos and all(i.get("JobState") in FINAL_STATES for i in infos):
            return infos
        assert time.monotonic() < deadline, f"job {job} not done after {timeout} s: {infos}"
        time.sleep(0.5)


def outputs(tmp_path) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("job-*.out")))


def test_a_job_array_appends_srun_points_of_both_sizes_to_one_file(slurm, tmp_path):
    job, out = submit(slurm, tmp_path, "--array=0-1", SIZES="1 2")
    infos = wait_all(slurm, job)
    assert len(infos) == 2, infos
    assert all(i["JobState"] == "COMPLETED" for i in infos), outputs(tmp_path)[-4000:]
    points = json.loads(out.read_text())["points"]
    assert sorted((p["mode"], p["ranks"]) for p in points) == [
        ("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    for p in points:
        assert p["launcher"] == "srun" and p["host"] == "slurm-test" and p["quick"] is True
        assert p["step_s"] > 0 and p["restore_s"] > 0
        if p["ranks"] == 2:  # one 2-rank job: collectives measured, the parity rebuild ran
            assert p["machine"]["ranks"] == 2 and p["machine"]["alltoall_latency_s"] > 0
            assert p["rebuild_s"] > 0 and len(p["local_rows"]) == 2


def test_without_an_mpi_plugin_the_sweep_stops_instead_of_recording_1_rank_jobs(slurm,
                                                                                 tmp_path):
    job, out = submit(slurm, tmp_path, SIZES="2", SRUN_MPI="none")
    info = wait_all(slurm, job)[0]
    text = outputs(tmp_path)
    assert info["JobState"] == "FAILED", text[-3000:]
    assert "expected 2 ranks in one job, this job has 1" in text and "--mpi=pmi2" in text
    assert not out.exists() or not json.loads(out.read_text())["points"]
