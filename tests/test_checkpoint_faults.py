"""Corruption, full disks and resharding, with real files, a real tmpfs and real MPI jobs."""
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from mpickpt.store.manifest import list_manifests
from tests.launch import SMALL_MODEL, digest_of, resumed_step, run_ranks


def train(ranks, ckpt, steps, *extra, timeout=180):
    return run_ranks(ranks, "mpickpt.train", *SMALL_MODEL, "--num-batches", str(steps),
                     "--ckpt-dir", str(ckpt), "--ckpt-interval", "10", "--ckpt-keep", "3",
                     "--digest", *extra, timeout=timeout)


def shard_of(ckpt, step, rank=1):
    [d] = [p for p in ckpt.iterdir() if p.name.startswith(f"step-{step:012d}-")]
    return d / f"rank-{rank:05d}-part-0.h5"


def flip_weight_byte(path):
    with h5py.File(path, "r") as f:
        ds = f["rows/weight"]
        offset = ds.id.get_offset() + ds.id.get_storage_size() // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A 2-rank run to step 20 with checkpoints at 10 and 20, and its digest."""
    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    proc = train(2, ckpt, 20)
    return ckpt, digest_of(proc)


@pytest.mark.parametrize("damage", [flip_weight_byte, truncate, os.remove],
                         ids=["flipped-byte", "truncated", "deleted"])
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, reference, damage):
    src, digest = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    damaged = shard_of(ckpt, 20)
    damage(damaged)
    verify = subprocess.run([sys.executable, "-m", "mpickpt.cli", "verify", str(ckpt)],
                            capture_output=True, text=True)
    assert verify.returncode == 1 and str(damaged) in verify.stdout
    resumed = train(2, ckpt, 20)
    assert f"checkpoint step 20 unusable: {damaged}" in resumed.stdout, resumed.stdout
    assert resumed_step(resumed.stdout) == 10
    assert digest_of(resumed) == digest  # retrained 10 -> 20 to the same state
    # the unusable step 20 was set aside whole (nothing deleted) before the new one committed
    aside = ckpt / "unusable" / damaged.parent.name
    assert "set unusable checkpoint step 20 aside" in resumed.stdout, resumed.stdout
    assert (aside / damaged.name).exists() == (damage is not os.remove)
    assert [m.step for m in list_manifests(str(ckpt))] == [10, 20]


def test_checkpoints_written_after_a_fallback_are_kept_not_the_unusable_newer_one(
        tmp_path, reference):
    """A run that falls back past the unusable step 20 to 10 and stops at 18, keeping one
    checkpoint: the one it keeps is its own step 15 (step 20, still the newest before, had
    been kept and 10 and 15 deleted), and `ls` names step 20 as set aside."""
    src, _ = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    truncate(shard_of(ckpt, 20))
    run = train(2, ckpt, 18, "--ckpt-interval", "5", "--ckpt-keep", "1")
    assert run.returncode == 0 and resumed_step(run.stdout) == 10, run.stdout + run.stderr
    assert [m.step for m in list_manifests(str(ckpt))] == [15], run.stdout
    ls = subprocess.run([sys.executable, "-m", "mpickpt.cli", "ls", str(ckpt)],
                        capture_output=True, text=True)
    assert "1 checkpoint(s) a restore could not use are set aside in " \
           f"{ckpt / 'unusable'} (step-000000000020-" in ls.stdout, ls.stdout


def test_chosen_damaged_checkpoint_is_an_error_naming_the_dataset(tmp_path, reference):
    src, _ = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    flip_weight_byte(shard_of(ckpt, 20))
    proc = train(2, ckpt, 30, "--resume", "20")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "weight fails its checksum" in proc.stderr and str(shard_of(ckpt, 20)) in proc.stderr
    missing = train(2, ckpt, 30, "--resume", "15")
    assert missing.returncode == 2 and "no committed checkpoint at step 15" in missing.stderr


def test_torn_checkpoint_without_manifest_is_ignored(tmp_path, reference):
    src, digest = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    manifest = ckpt / "manifest-000000000020.json"
    manifest.unlink()  # as if the job died between the shard writes and the commit
    resumed = train(2, ckpt, 20)
    assert "no manifest (torn or abandoned checkpoint)" in resumed.stdout
    assert resumed_step(resumed.stdout) == 10
    assert digest_of(resumed) == digest


def dense_of(ckpt, step):
    [d] = [p for p in ckpt.iterdir() if p.name.startswith(f"step-{step:012d}-")]
    return d / "dense.h5"


@pytest.mark.parametrize("swap", [shard_of, dense_of], ids=["shard", "dense"])
def test_a_file_of_another_checkpoint_is_refused_though_sound_and_of_the_same_size(
        tmp_path, reference, swap):
    """Step 10's file copied over step 20's passes its block checksums, its attribute digest
    and the manifest's size check; its step attribute still names step 10: the restore falls
    back to step 10, saying why, and an export of step 20 refuses it."""
    src, digest = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    theirs, ours = swap(ckpt, 10), swap(ckpt, 20)
    assert theirs.stat().st_size == ours.stat().st_size
    shutil.copyfile(theirs, ours)
    export = subprocess.run([sys.executable, "-m", "mpickpt.cli", "export", str(ckpt), "--step",
                             "20", "-o", str(tmp_path / "out.h5")], capture_output=True,
                            text=True)
    said = f"{ours}: attribute step=10, the manifest of step 20 says 20"
    assert export.returncode != 0 and said in export.stderr, export.stderr
    assert not (tmp_path / "out.h5").exists()
    resumed = train(2, ckpt, 20)
    assert f"checkpoint step 20 unusable: {said}" in resumed.stdout, resumed.stdout
    assert resumed_step(resumed.stdout) == 10
    assert digest_of(resumed) == digest


def test_a_directory_whose_every_manifest_is_unreadable_is_no_fresh_start(tmp_path, reference,
                                                                           monkeypatch):
    """Training from scratch there would commit over the damaged manifests' names and then
    delete their data as torn: a job's first launch stops with status 2, naming them, and
    leaves every file as it was. A relaunch starts over, as before: its first launch may have
    chosen to (`--resume none`) and died before its first commit."""
    src, _ = reference
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    for step in (10, 20):
        path = ckpt / f"manifest-{step:012d}.json"
        data = bytearray(path.read_bytes())
        data[100] ^= 1
        path.write_bytes(bytes(data))
    before = sorted((str(p.relative_to(ckpt)), p.stat().st_mtime_ns) for p in ckpt.rglob("*"))
    proc = train(2, ckpt, 30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"no usable checkpoint in {ckpt}: every manifest there is unreadable (step 10: " \
        in proc.stderr and "--resume none" in proc.stderr, proc.stderr
    assert "step 10/30" not in proc.stdout
    assert sorted((str(p.relative_to(ckpt)), p.stat().st_mtime_ns)
                  for p in ckpt.rglob("*")) == before
    monkeypatch.setenv("MPICKPT_RESTART", "1")
    again = train(2, ckpt, 30)
    assert again.returncode == 0 and resumed_step(again.stdout) is None, again.stderr


def test_full_disk_abandons_checkpoint_and_training_goes_on(small_tmpfs):
    """One checkpoint of the default model (1.1 MB) fits the 1.7 MB tmpfs; the next cannot while
    the first is kept (retention deletes only after a newer commit)."""
    flags = ("--num-batches", "20", "--mini-batch-size", "32", "--print-freq", "0",
             "--test-num-batches", "0", "--digest")
    digest = digest_of(run_ranks(2, "mpickpt.train", *flags))
    ckpt = small_tmpfs / "ckpt"
    with_ckpt = (*flags, "--ckpt-dir", str(ckpt), "--ckpt-interval", "10", "--ckpt-keep", "1")
    proc = run_ranks(2, "mpickpt.train", *with_ckpt)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint step 10 committed" in proc.stdout
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("checkpoint step 20 abandoned")]
    assert "No space left on device" in line and str(ckpt) in line, proc.stdout + proc.stderr
    assert "checkpoint step 10 stays valid" in proc.stdout
    assert digest_of(proc) == digest  # training was not disturbed
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("manifest")) == \
        ["manifest-000000000010.json"]
    verify = subprocess.run([sys.executable, "-m", "mpickpt.cli", "verify", str(ckpt)],
                            capture_output=True, text=True)
    assert verify.returncode == 0, verify.stdout
    resumed = run_ranks(2, "mpickpt.train", *with_ckpt)
    assert resumed_step(resumed.stdout) == 10 and digest_of(resumed) == digest


def export(ckpt, step, out):
    proc = subprocess.run([sys.executable, "-m", "mpickpt.cli", "export", str(ckpt), "--step",
                           str(step), "-o", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        return {k: f[k][()] for k in _datasets(f)}


def _datasets(f):
    names = []
    f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return names


class _Sources(dict):
    """Checkpoints at steps 12 and 24 written by n ranks, with the digest at step 12, made the
    first time a test asks for n (the slow cases' world sizes cost nothing otherwise)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.factory = tmp_path_factory

    def __missing__(self, n: int):
        ckpt = self.factory.mktemp(f"src{n}") / "ckpt"
        run = lambda steps: run_ranks(n, "mpickpt.train", *SMALL_MODEL, "--num-batches",
                                      str(steps), "--ckpt-dir", str(ckpt), "--ckpt-interval",
                                      "12", "--digest", timeout=240)
        d12 = digest_of(run(12))
        run(24)
        self[n] = (ckpt, d12)
        return self[n]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return _Sources(tmp_path_factory)


@pytest.mark.slow  # CI time: test_checkpoint_kinds reshards the kinds in process (2 -> 1, 3)
@pytest.mark.parametrize("src, dst", [(2, 1), (1, 2), (2, 4), (4, 2)])
def test_resharding_restores_the_same_model(tmp_path, sources, src, dst):
    ckpt, digest12 = sources[src]
    work = tmp_path / "ckpt"
    shutil.copytree(ckpt, work)
    restored = run_ranks(dst, "mpickpt.train", *SMALL_MODEL, "--num-batches", "12", "--ckpt-dir",
                         str(work), "--ckpt-interval", "12", "--resume", "12", "--digest",
                         timeout=240)
    assert f"written by {src} ranks" in restored.stdout and f"onto {dst} ranks" in restored.stdout
    assert digest_of(restored) == digest12  # bit-identical state after N -> M
    trained = run_ranks(dst, "mpickpt.train", *SMALL_MODEL, "--num-batches", "24", "--ckpt-dir",
                        str(work), "--ckpt-interval", "12", "--resume", "12", timeout=240)
    assert trained.returncode == 0, trained.stderr
    a = export(ckpt, 24, tmp_path / "src.h5")
    b = export(work, 24, tmp_path / "dst.h5")
    assert sorted(a) == sorted(b) and any(k.startswith("embeddings/") for k in a)
    for key in a:  # trained on after resharding: equal up to float summation order
        np.testing.assert_allclose(a[key], b[key], atol=1e-5, err_msg=key)
