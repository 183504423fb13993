"""Real 2-rank training runs with incremental checkpoint kinds: SIGKILL and resume to the
uninterrupted digest, a SIGKILLed extractor in the middle of an extraction, exports across kinds."""
import json
import re

import pytest

from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.store.manifest import list_manifests
from mpickpt.checkpoint.verify import verify_checkpoint
from tests.launch import SMALL_MODEL, digest_of, resumed_step, run_ranks

STEPS = 40


@pytest.fixture(scope="module")
def straight():
    return digest_of(run_ranks(2, "mpickpt.train", *SMALL_MODEL, "--num-batches", str(STEPS),
                               "--digest"))


def _args(ckpt, kind, *more):
    return (*SMALL_MODEL, "--num-batches", str(STEPS), "--ckpt-dir", str(ckpt),
            "--ckpt-interval", "4", "--ckpt-kind", kind, *more)


def test_incrcp_sigkill_then_resume_is_identical(tmp_path, straight):
    ckpt = tmp_path / "ckpt"
    killed = run_ranks(2, "mpickpt.train", *_args(ckpt, "incrcp", "--ckpt-keep", "3",
                                                  "--inject-kill", "27:1"))
    assert killed.returncode != 0
    kinds = {m.step: m.kind for m in list_manifests(str(ckpt))}
    assert "incrcp" in kinds.values(), kinds
    report = tmp_path / "report.json"
    resumed = run_ranks(2, "mpickpt.train", *_args(ckpt, "incrcp", "--ckpt-keep", "3",
                                                   "--incrcp-reset", "never"),  # extractions
                        "--digest", "--run-report", str(report))
    assert resumed_step(resumed.stdout) in (20, 24), resumed.stdout
    assert digest_of(resumed) == straight
    # the background's CPU: its processes' whole lives >= their jobs' (writers, extractor) > 0
    doc = json.loads(report.read_text())
    jobs = sum(doc["write_cpu_seconds"]) + doc["companion_cpu_seconds"]
    assert len(doc["write_cpu_seconds"]) == doc["checkpoints"] > 0
    assert doc["companion_cpu_seconds"] > 0 and 0 < jobs <= doc["background_cpu_seconds"], doc
    bundles = sum(float(mb) for mb in re.findall(r"into ([\d.]+) MB of bundles", resumed.stdout))
    assert doc["companion_bytes"] > 0 and abs(doc["companion_bytes"] / 1e6 - bundles) < 0.1, doc


def test_killed_extractor_leaves_every_checkpoint_restorable(tmp_path, straight):
    full, ckpt = tmp_path / "full", tmp_path / "incrcp"
    reference = run_ranks(2, "mpickpt.train", *_args(full, "full", "--ckpt-keep", "100"))
    assert reference.returncode == 0, reference.stderr
    run = run_ranks(2, "mpickpt.train", *_args(ckpt, "incrcp", "--ckpt-keep", "100",
                                               "--inject-extract-crash", "2"), "--digest")
    assert digest_of(run) == straight  # training never noticed
    assert "extractor process died" in run.stdout, run.stdout
    manifests = {m.step: m for m in list_manifests(str(ckpt))}
    assert sorted(manifests) == list(range(4, STEPS + 1, 4))
    assert any(m.kind == "incrcp" for m in manifests.values())
    by_full = {m.step: m for m in list_manifests(str(full))}
    for step, m in manifests.items():
        assert verify_checkpoint(str(ckpt), m) == [], step
        a, b = tmp_path / f"a{step}.h5", tmp_path / f"b{step}.h5"
        export_checkpoint(str(ckpt), m, str(a), with_optimizer=True)
        export_checkpoint(str(full), by_full[step], str(b), with_optimizer=True)
        assert a.read_bytes() == b.read_bytes(), f"step {step} differs from the full checkpoint"
    # and a chosen middle step resumes and trains on to the uninterrupted result
    middle = sorted(s for s, m in manifests.items() if m.kind == "incrcp")[0]
    resumed = run_ranks(2, "mpickpt.train", *_args(ckpt, "incrcp", "--resume", str(middle)),
                        "--digest")
    assert resumed_step(resumed.stdout) == middle
    assert digest_of(resumed) == straight


@pytest.mark.parametrize("kind", [
    # CI time: intermittent's increments are differential checkpoints, restored the same way
    pytest.param("differential", marks=pytest.mark.slow), "consecutive", "intermittent"])
def test_check_n_run_kinds_resume_to_the_same_digest(tmp_path, straight, kind):
    ckpt = tmp_path / kind
    first = run_ranks(2, "mpickpt.train", *SMALL_MODEL, "--num-batches", "30", "--ckpt-dir",
                      str(ckpt), "--ckpt-interval", "4", "--ckpt-kind", kind, "--ckpt-keep", "2")
    assert first.returncode == 0, first.stderr
    kinds = [m.kind for m in list_manifests(str(ckpt))]
    assert kinds[-1] != "full" or kind == "intermittent", kinds
    resumed = run_ranks(2, "mpickpt.train", *_args(ckpt, kind), "--digest")
    assert resumed_step(resumed.stdout) == 28
    assert digest_of(resumed) == straight
