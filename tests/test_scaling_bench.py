"""bench/scaling.py --quick runs real 1- and 2-rank jobs and writes the sweep format; a rerun
replaces its own points and keeps others."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KEYS = {"mode", "ranks", "step_s", "phases_s", "stall_s", "commit_s", "ckpt_bytes", "write_s",
        "write_MBps_per_rank", "restore_s", "partial_s", "local_rows", "row_bytes", "machine"}


def test_quick_sweep_at_1_and_2_ranks_writes_valid_json(tmp_path):
    out = tmp_path / "scaling.json"
    out.write_text(json.dumps({"format": "mpickpt-scaling-1", "points": [
        {"host": "cluster-x", "mode": "weak", "ranks": 64, "quick": False}]}))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "bench/scaling.py", "--quick", "--ranks", "1,2",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    mine = [p for p in doc["points"] if p["host"] == "local"]
    assert sorted((p["mode"], p["ranks"]) for p in mine) == [
        ("strong", 1), ("strong", 2), ("weak", 1), ("weak", 2)]
    assert any(p["host"] == "cluster-x" for p in doc["points"])  # other hosts' points kept
    for p in mine:
        assert KEYS <= set(p) and p["quick"] is True
        assert p["step_s"] > 0 and p["stall_s"] > 0 and p["restore_s"] > 0
        assert p["ckpt_bytes"] >= sum(p["local_rows"]) * p["row_bytes"]
        if p["ranks"] == 2:
            assert p["rebuild_s"] > 0 and p["machine"]["alltoall_latency_s"] > 0
    assert "strong" in proc.stdout and "samples/s" in proc.stdout
