"""Real 1- and 2-rank `mpickpt-train --model torchrec` jobs (torchrec's DLRM under
DistributedModelParallel, fused row-wise Adagrad, gloo) with mpickpt's features switched on by
the same flags as for the built-in model: a job SIGKILLed at a random step resumes from a full
or an incremental (incrcp) checkpoint to the uninterrupted digest; 4-bit checkpoints stay within the
codec's bound of the float32 ones; parity rebuilds a lost shard while training goes on, to the
failure-free digest, its sweep beside the step joined from the lookup's gradient hook;
partial recovery reloads the lost shard without a rollback; a real death
under mpickpt-run is recovered in place (survivors keep their processes); copy-on-update
checkpoints equal stop-the-world ones byte for byte; a table-wise
checkpoint restores on 1 rank and under a row-wise plan with the same digest. Skipped where
torchrec is not installed."""
from __future__ import annotations

import functools
import random
import re
import subprocess

import numpy as np
import pytest

from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.model.torchrec_support import installed_version
from mpickpt.quant.codecs import Codec
from mpickpt.store.manifest import list_manifests
from tests.fault_jobs import digest_in, mpickpt_run
from tests.launch import (REPO, SMALL_MODEL, digest_of, h5_datasets, resumed_step,
                          run_ranks)

pytestmark = pytest.mark.skipif(installed_version("torchrec") is None,
                                reason="torchrec is not installed (.ci/run installs it)")
STEPS = 24
TORCHREC = ("--model", "torchrec", *SMALL_MODEL, "--num-batches", str(STEPS), "--digest")
CKPT = ("--ckpt-interval", "4", "--ckpt-keep", "100")


def _train(n: int, sharding: str, *more: str) -> subprocess.CompletedProcess:
    return run_ranks(n, "mpickpt.train", *TORCHREC, "--torchrec-sharding", sharding, *more)


@functools.lru_cache(maxsize=None)
def _clean(sharding: str, root: str) -> tuple[str, str]:
    """(digest, checkpoint directory) of the uninterrupted 2-rank run (checkpoints every 4)."""
    ckpt = f"{root}/clean-{sharding}"
    return digest_of(_train(2, sharding, "--ckpt-dir", ckpt, *CKPT)), ckpt


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("torchrec"))


@pytest.mark.parametrize("kind", [pytest.param("full", marks=pytest.mark.slow), "incrcp"])
def test_a_killed_job_resumes_to_the_uninterrupted_digest(root, tmp_path, kind):
    kill_at = random.Random().randint(14, 21)  # after step 8 (incrcp: an increment) committed
    ckpt = str(tmp_path / "ckpt")
    args = ("--ckpt-dir", ckpt, *CKPT, "--ckpt-kind", kind)
    killed = _train(2, "row_wise", *args, "--inject-kill", f"{kill_at}:1")
    assert killed.returncode != 0 and "digest" not in killed.stdout, killed.stdout
    kinds = {m.step: m.kind for m in list_manifests(ckpt)}
    assert kind in kinds.values() and 8 <= max(kinds) <= kill_at, kinds
    resumed = _train(2, "row_wise", *args)
    assert resumed_step(resumed.stdout) == max(kinds), resumed.stdout
    assert digest_of(resumed) == _clean("row_wise", root)[0]


def test_4bit_checkpoints_stay_within_the_codec_bound_and_resume(root, tmp_path):
    ckpt = str(tmp_path / "q4")
    args = ("--ckpt-dir", ckpt, *CKPT, "--ckpt-bits", "4")
    killed = _train(2, "table_wise", *args, "--inject-kill", "14:0")
    assert killed.returncode != 0
    quant = {m.step: m for m in list_manifests(ckpt)}
    exact = {m.step: m for m in list_manifests(_clean("table_wise", root)[1])}
    last = max(quant)  # the kill at 14 follows saves at 4, 8 and 12; a busy 2-core machine can
    # delay the later ones' background commits past it, so any of them may be the newest
    assert last in (4, 8, 12) and quant[last].codec.startswith("adaptive-4"), quant
    export_checkpoint(ckpt, quant[last], str(tmp_path / "q.h5"), with_optimizer=True)
    export_checkpoint(_clean("table_wise", root)[1], exact[last], str(tmp_path / "e.h5"),
                      with_optimizer=True)
    got, want = h5_datasets(tmp_path / "q.h5"), h5_datasets(tmp_path / "e.h5")
    weights = [k for k in want if k.startswith("embeddings/")]
    assert sorted(got) == sorted(want) and len(weights) == 4
    codec = Codec("adaptive", 4)
    for k in weights:
        err = np.sqrt(((got[k].astype(np.float64) - want[k]) ** 2).sum(axis=1))
        assert (err <= codec.row_error_bound(want[k])).all(), k
        assert not np.array_equal(got[k], want[k])  # it really was quantized
    resumed = _train(2, "table_wise", *args)
    assert resumed_step(resumed.stdout) == last and "digest" in resumed.stdout


@pytest.mark.parametrize("sweep", ["beside", "lookup"])
def test_parity_rebuilds_a_lost_shard_while_training_goes_on(root, sweep):
    """The sweep in the lookup's round, or beside the step (the round reads the step's rows, a
    thread sweeps the rest through the forward and backward, and the lookup output's gradient
    hook joins it before the fused update)."""
    at = random.Random().randint(3, 20)
    proc = _train(2, "table_wise", "--parity-k", "1", "--inject-failure", f"{at}:1",
                  "--rebuild-sweep", sweep)
    assert f"parity: ranks [1] lost their shards after step {at}" in proc.stdout, proc.stdout
    rebuilt = re.search(r"parity: rebuilt ranks \[1\] .* reading the group's memory"
                        r"(, (\d+) swept beside the steps)?", proc.stdout)
    assert rebuilt, proc.stdout
    assert (int(rebuilt[2] or 0) >= 1) == (sweep == "beside"), rebuilt[0]
    assert digest_of(proc) == _clean("table_wise", root)[0]


def test_copy_on_update_checkpoints_equal_stop_the_world_ones(root, tmp_path):
    """The copier slowed so that a checkpoint's rows stay pending across the next steps, whose
    fused backward updates rows the lookup's hook copied first."""
    ckpt = str(tmp_path / "cou")
    proc = _train(2, "table_wise", "--ckpt-dir", ckpt, *CKPT, "--ckpt-snapshot", "copy-on-update",
                  "--inject-slow-copy", "0.02")
    clean_digest, clean = _clean("table_wise", root)
    assert digest_of(proc) == clean_digest
    assert "waited" in proc.stdout, proc.stdout  # a copy still ran when the next save came
    got = {m.step: m for m in list_manifests(ckpt)}
    want = {m.step: m for m in list_manifests(clean)}
    assert sorted(got) == sorted(want) == [4, 8, 12, 16, 20, 24]
    for step in got:
        a, b = tmp_path / f"cou{step}.h5", tmp_path / f"stw{step}.h5"
        export_checkpoint(ckpt, got[step], str(a), with_optimizer=True)
        export_checkpoint(clean, want[step], str(b), with_optimizer=True)
        assert a.read_bytes() == b.read_bytes(), step


def test_partial_recovery_reloads_the_lost_shard_without_a_rollback(tmp_path):
    proc = _train(2, "table_wise", "--ckpt-dir", str(tmp_path / "ckpt"), *CKPT,
                  "--recovery", "partial", "--inject-failure", "6:1")
    assert proc.returncode == 0, proc.stderr
    assert "ranks [1] lost their shards after step 6" in proc.stdout, proc.stdout
    assert "reloaded from checkpoint step 4" in proc.stdout and resumed_step(proc.stdout) is None


@pytest.mark.slow  # CI time: CI recovers real deaths in place on the native model
# (test_in_place.py), and rebuilds a DMP shard from parity while training goes on (above)
def test_a_real_death_is_recovered_in_place(root, tmp_path):
    """mpickpt-run's agent respawns the killed rank; the survivor re-points its DMP at the next
    generation's process group, parity rebuilds the shard, the digest is the failure-free one."""
    rng = random.Random()
    at, rank = rng.randint(5, 20), rng.randint(0, 1)
    cmd = mpickpt_run("-n", "2", "--max-restarts", "1", "--", *TORCHREC, "--torchrec-sharding",
                      "row_wise", "--parity-k", "1", "--inject-kill", f"{at}:{rank}",
                      "--ckpt-dir", str(tmp_path / "ckpt"), *CKPT)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"in-place recovery: generation 1 at step {at}: rank(s) [{rank}] replaced" \
        in proc.stdout, proc.stdout
    assert "mpickpt-run: run 1 finished" in proc.stderr, proc.stderr  # no relaunch
    assert digest_in(proc.stdout) == _clean("row_wise", root)[0]


@pytest.mark.slow  # CI time: tests/mpi/test_torchrec.py restores table-wise into row-wise in process
def test_a_table_wise_checkpoint_restores_on_1_rank_and_row_wise(root):
    """Checkpoints are keyed by global row id: the last one of the 2-rank table-wise run,
    restored on 1 rank and under a row-wise plan, has the same digest (nothing left to train)."""
    digest, ckpt = _clean("table_wise", root)
    for n, sharding in ((1, "table_wise"), (2, "row_wise")):
        proc = _train(n, sharding, "--ckpt-dir", ckpt, *CKPT)
        assert resumed_step(proc.stdout) == STEPS, proc.stdout
        assert digest_of(proc) == digest, (n, sharding)


def test_a_dcp_export_imports_as_a_baseline_and_continues_like_the_original(root, tmp_path):
    """Half the run exported to DCP (--export-dcp), the other half started from it
    (--import-dcp, its first checkpoint the imported state at step 12): it ends with the
    uninterrupted run's digest. A model whose tables differ is refused with exit 2 and one
    line naming the mismatch."""
    dcp_dir, ckpt = str(tmp_path / "dcp"), str(tmp_path / "ckpt")
    half = run_ranks(2, "mpickpt.train", *TORCHREC, "--num-batches", "12",
                     "--export-dcp", dcp_dir)
    assert "exported step 12 as DCP checkpoint" in half.stdout, half.stdout + half.stderr
    digest = _clean("table_wise", root)[0]
    rest = _train(2, "table_wise", "--import-dcp", dcp_dir, "--ckpt-dir", ckpt, *CKPT)
    assert f"imported DCP checkpoint {dcp_dir} at step 12" in rest.stdout, rest.stdout
    assert min(m.step for m in list_manifests(ckpt)) == 12  # the baseline
    assert digest_of(rest) == digest  # (an export loaded under another plan: tests/mpi)
    again = _train(2, "table_wise", "--import-dcp", dcp_dir, "--ckpt-dir", ckpt, *CKPT)
    assert f"--import-dcp {dcp_dir}: not imported: {ckpt} holds checkpoints, and the job " \
        f"resumed from step {STEPS}" in again.stdout, again.stdout  # said, not silently ignored
    other = run_ranks(2, "mpickpt.train", *TORCHREC, "--arch-embedding-size", "300-200-100-60",
                      "--import-dcp", dcp_dir)  # the last table has 10 more rows
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr
    assert re.search(rf"^mpickpt-train: error: --import-dcp {dcp_dir}: cannot be loaded into "
                     r"this model: ValueError: Size mismatch between saved torch.Size\(\[50",
                     other.stderr, re.M), other.stderr
