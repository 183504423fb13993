"""Randomized corruption: one random bit of one file of a committed checkpoint directory is flipped,
for every kind (full, differential, incrcp with bundles, 8-bit quantized). Each trial picks the
category of file first (shard, dense, manifest, and for incrcp chunk index and bundle), then a
random file of it, a random byte and a random bit, so that the small files are hit as often as the
large ones. Then `mpickpt verify` and a resumed run.

Pass: the resumed run ends with the digest of an undamaged resume from the checkpoint it resumed
from (the uninterrupted digest for lossless kinds; an earlier checkpoint when it fell back, which
it must say), or stops with an error naming the damaged file. Fail: a wrong digest (damage
accepted), a refusal that does not name the file, or a traceback from verify or the run. Jobs run
on one rank, as a singleton, to keep the many trials cheap; the multi-rank paths read the same
files through the same checks. CI runs one trial per category (`CI_TRIALS`); the slow suite cycles
every (kind, category) pair 8 times (112 trials). Each trial asserts that its bit was flipped."""
import fnmatch
import os
import random
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpickpt import cli
from mpickpt.store.manifest import list_manifests
from tests.damage import edit_reader_position
from tests.launch import REPO, SMALL_MODEL, digest_of, finish, resumed_step

STEPS, TOTAL = 16, 22
KINDS = {
    "full": ("--ckpt-kind", "full"),
    "differential": ("--ckpt-kind", "differential"),
    "incrcp": ("--ckpt-kind", "incrcp", "--incrcp-ratio", "0", "--incrcp-reset", "never"),
    "quantized": ("--ckpt-kind", "full", "--ckpt-bits", "8"),
}
LOSSLESS = {"full", "differential", "incrcp"}
CATEGORIES = {  # file name patterns of each category
    "shard": ("rank-*.h5", "col-*.h5"),
    "dense": ("dense.h5",),
    "manifest": ("manifest-*.json",),
    "index": ("index-*.json",),
    "bundle": ("bundle-*.h5",),
}
COMMON = ("shard", "dense", "manifest")
PAIRS = [(kind, c) for kind in sorted(KINDS)
         for c in (CATEGORIES if kind == "incrcp" else COMMON)]
"""Every (kind, category) with files to damage: 4 kinds x 3 categories, and incrcp's two more."""
CI_TRIALS = [("quantized", "shard"), ("differential", "dense"), ("full", "manifest"),
             ("incrcp", "index"), ("incrcp", "bundle")]
"""One trial per category in CI."""
SLOW_TRIALS = [(seed, *PAIRS[seed % len(PAIRS)]) for seed in range(8 * len(PAIRS))]


def train(*args: str) -> subprocess.CompletedProcess:
    return finish(start(*args))


def start(*args: str) -> subprocess.Popen:
    """A 1-rank training job, started."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-m", "mpickpt.train", *SMALL_MODEL, "--digest",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


@pytest.fixture(scope="module")
def straight():
    return digest_of(train("--num-batches", str(TOTAL)))


class References(dict):
    """step -> digest of an undamaged resume from that step, computed when first asked for
    (lossy kinds: each step its own; lossless: the uninterrupted digest)."""

    def __init__(self, root: str, flags, straight: str, lossless: bool):
        super().__init__()
        self.root, self.flags, self.straight, self.lossless = root, flags, straight, lossless
        self.steps = [m.step for m in list_manifests(root)]

    def __missing__(self, step: int) -> str:
        if self.lossless:
            return self.straight
        copy = f"{self.root}-ref{step}"
        shutil.copytree(self.root, copy)
        self[step] = digest_of(train("--num-batches", str(TOTAL), "--ckpt-dir", copy, "--resume",
                                     str(step), *self.flags))
        return self[step]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, straight):
    """kind -> (checkpoint directory, References, the kind's flags); the kinds' jobs run side
    by side."""
    out, roots = {}, {kind: tmp_path_factory.mktemp(kind) / "ckpt" for kind in KINDS}
    jobs = {kind: start("--num-batches", str(STEPS), "--ckpt-dir", str(roots[kind]),
                        "--ckpt-interval", "4", "--ckpt-keep", "3", *flags)
            for kind, flags in KINDS.items()}
    for kind, flags in KINDS.items():
        root, proc = roots[kind], finish(jobs[kind])
        assert proc.returncode == 0, proc.stderr[-2000:]
        for category in CATEGORIES if kind == "incrcp" else COMMON:
            assert files_of(str(root), category), f"{kind}: no {category} file in {root}"
        out[kind] = (str(root), References(str(root), flags, straight, kind in LOSSLESS), flags)
    return out


def files_of(root: str, category: str) -> list[str]:
    """Every file under `root` of `category`, sorted."""
    patterns = CATEGORIES[category]
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names
                  if any(fnmatch.fnmatch(n, p) for p in patterns))


def flip_one_bit(path: str, rng: random.Random) -> tuple[int, int]:
    size = os.path.getsize(path)
    offset, bit = rng.randrange(size), rng.randrange(8)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(1)[0] == byte ^ (1 << bit)  # the fault happened
    return offset, bit


def trial(pristine, straight, kind: str, category: str, seed: int, tmp_path, capsys) -> str:
    root, reference, flags = pristine[kind]
    rng = random.Random(seed)
    work = str(tmp_path / f"{kind}-{category}-{seed}")
    shutil.copytree(root, work)
    victim = rng.choice(files_of(work, category))
    offset, bit = flip_one_bit(victim, rng)
    what = f"{kind} seed {seed}: bit {bit} of byte {offset} of {os.path.relpath(victim, work)}"
    code = cli.main(["verify", work])
    report = capsys.readouterr().out
    assert code in (0, 1), f"{what}: verify exited {code}\n{report}"
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert "Traceback" not in proc.stderr, f"{what}\n{proc.stderr[-3000:]}"
    if proc.returncode != 0:  # refused: it must say why, naming the damaged file
        said = proc.stderr + proc.stdout
        assert "no usable checkpoint" in said, f"{what}\n{proc.stderr}"
        assert victim in said, f"{what}: the refusal does not name the file\n{said[-3000:]}"
        return f"{what}: refused"
    step = resumed_step(proc.stdout)
    want = straight if step is None else reference[step]
    got = digest_of(proc)
    assert got == want, (f"{what}: resumed from step {step} and ended with a wrong digest "
                         f"(verify said {'OK' if code == 0 else 'problems'})\n{report}\n"
                         f"{proc.stdout[-3000:]}")
    if step != max(reference.steps):
        assert re.search(r"unusable|ignoring", proc.stdout), f"{what}: fell back silently"
    return f"{what}: verify {'clean' if code == 0 else 'found it'}, resumed at {step}"


def test_the_trials_cover_every_category():
    assert {c for _, c in CI_TRIALS} == set(CATEGORIES)
    assert {(k, c) for _, k, c in SLOW_TRIALS} == set(PAIRS) and len(SLOW_TRIALS) >= 100
    assert len(PAIRS) == 3 * len(KINDS) + 2


@pytest.mark.parametrize("kind,category", CI_TRIALS)
def test_a_flipped_bit_is_caught_or_harmless(pristine, straight, kind, category, tmp_path, capsys):
    trial(pristine, straight, kind, category, 1000 + CI_TRIALS.index((kind, category)), tmp_path,
          capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed,kind,category", SLOW_TRIALS)
def test_a_flipped_bit_is_caught_or_harmless_many(pristine, straight, seed, kind, category,
                                                  tmp_path, capsys):
    trial(pristine, straight, kind, category, seed, tmp_path, capsys)


def test_an_edited_reader_position_is_refused_and_resume_falls_back(pristine, straight, tmp_path,
                                                                     capsys):
    root, _, flags = pristine["full"]
    work = str(tmp_path / "edited")
    shutil.copytree(root, work)
    newest = max(m.step for m in list_manifests(work))
    edit_reader_position(work, newest)
    assert cli.main(["verify", work]) == 1
    out = capsys.readouterr().out
    assert f"manifest-{newest:012d}.json" in out and "checksum" in out, out
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert f"checkpoint step {newest} unusable" in proc.stdout and "checksum" in proc.stdout
    assert resumed_step(proc.stdout) == newest - 4
    assert digest_of(proc) == straight


def working_copy(pristine, kind: str, tmp_path, name: str) -> tuple[str, list[int], tuple]:
    """A private copy of `kind`'s directory, its committed steps and the kind's flags."""
    root, _, flags = pristine[kind]
    work = str(tmp_path / name)
    shutil.copytree(root, work)
    return work, [m.step for m in list_manifests(work)], flags


def verify_report(work: str, capsys) -> str:
    assert cli.main(["verify", work]) == 1
    return capsys.readouterr().out


def test_a_damaged_chunk_index_is_named_and_passed_over(pristine, straight, tmp_path, capsys):
    work, steps, flags = working_copy(pristine, "incrcp", tmp_path, "index")
    path = files_of(work, "index")[-1]  # the newest generation: every increment reads it
    text = open(path).read()
    edited = re.sub(r'"stop":(\d+)', lambda m: f'"stop":{int(m.group(1)) - 1}', text, count=1)
    assert edited != text
    with open(path, "w") as f:
        f.write(edited)
    bad = [line for line in verify_report(work, capsys).splitlines()
           if path in line and "checksum" in line]
    increments = [m.step for m in list_manifests(work) if m.kind == "incrcp"]
    assert len(increments) >= 2 and {int(line.split()[1].rstrip(":")) for line in bad} == \
        set(increments), bad
    baseline = min(steps)
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert f"checkpoint step {max(steps)} unusable: " in proc.stdout and path in proc.stdout
    assert resumed_step(proc.stdout) == baseline  # every increment needs the index
    assert digest_of(proc) == straight
    chosen = str(tmp_path / "index-chosen")
    shutil.copytree(pristine["incrcp"][0], chosen)
    shutil.copyfile(path, path.replace(work, chosen))
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", chosen, "--resume",
                 str(increments[-1]), *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert path.replace(work, chosen) in proc.stderr and "checksum" in proc.stderr


def test_a_deleted_newest_chunk_index_is_named_by_the_generation_left(pristine, tmp_path,
                                                                        capsys):
    work, steps, _ = working_copy(pristine, "incrcp", tmp_path, "index-gone")
    *_, older, newest = files_of(work, "index")
    os.remove(newest)
    assert files_of(work, "bundle")  # the newest ingestion's bundles stay behind
    report = verify_report(work, capsys)
    damaged = [line for line in report.splitlines() if older in line]
    assert damaged and all("names missing files: " in line and "a newer generation of this "
                           "index, which collected these files, is missing" in line
                           for line in damaged), report
    assert f"step {max(steps)}: {older}" in report
    assert cli.main(["inspect", work]) == 0
    note = capsys.readouterr().err
    assert f"skipped checkpoint step {max(steps)}: {older}" in note, note


def edit_attribute(path: str, obj: str, name: str, change) -> None:
    """Rewrite one HDF5 attribute in place with h5py (r+, `modify`: same type, same place, so the
    file keeps its size and HDF5's own metadata checksums stay valid): only the digest in
    ``/_attrs`` can tell."""
    import h5py

    size = os.path.getsize(path)
    with h5py.File(path, "r+", locking=False) as f:
        before = f[obj].attrs[name]
        f[obj].attrs.modify(name, change(before))
    with h5py.File(path, "r", locking=False) as f:
        assert not np.array_equal(f[obj].attrs[name], before)  # the edit happened
    assert os.path.getsize(path) == size


def newest_shard(work: str, steps: list[int]) -> str:
    return [p for p in files_of(work, "shard") if f"step-{max(steps):012d}" in p][0]


def test_an_edited_gid_range_is_refused_and_resume_falls_back(pristine, straight, tmp_path,
                                                              capsys):
    work, steps, flags = working_copy(pristine, "full", tmp_path, "gid")
    victim = newest_shard(work, steps)
    edit_attribute(victim, "rows", "tables", lambda v: v + np.eye(*v.shape, 3, dtype=v.dtype))
    report = verify_report(work, capsys)
    assert f"step {max(steps)}: {victim}: HDF5 attributes do not match their digest" in report
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert f"checkpoint step {max(steps)} unusable: {victim}: HDF5 attributes" in proc.stdout
    assert resumed_step(proc.stdout) == sorted(steps)[-2]
    assert digest_of(proc) == straight


def test_an_edited_codec_is_refused_at_a_chosen_step(pristine, tmp_path, capsys):
    work, steps, flags = working_copy(pristine, "quantized", tmp_path, "codec")
    victim = newest_shard(work, steps)
    edit_attribute(victim, "rows/weight", "codec",
                   lambda v: v.replace('"bits": 8', '"bits": 4'))
    report = verify_report(work, capsys)
    assert f"{victim}: HDF5 attributes do not match their digest" in report, report
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, "--resume", str(max(steps)),
                 *flags)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{victim}: HDF5 attributes do not match their digest" in proc.stderr


def test_a_damaged_baseline_manifest_is_named_by_its_dependents(pristine, tmp_path, capsys):
    work, steps, flags = working_copy(pristine, "differential", tmp_path, "baseline")
    dependents = [m for m in list_manifests(work) if m.parents]
    assert dependents, "no differential checkpoint in the directory"
    baseline = dependents[-1].parents[0]
    path = os.path.join(work, f"manifest-{baseline:012d}.json")
    with open(path, "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0x04]))
    report = verify_report(work, capsys)
    assert f"step {dependents[-1].step}: " in report and \
        f"needs step {baseline}, whose manifest cannot be used: {path}" in report, report
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    # every retained checkpoint builds on that baseline: nothing to fall back to
    assert proc.returncode != 0 and f"no usable checkpoint in {work}" in proc.stderr
    assert f"needs step {baseline}, whose manifest cannot be used: {path}" in proc.stderr


def test_a_checkpoint_of_other_mlp_widths_is_refused_naming_them(pristine, tmp_path):
    """Not damage but a model of another shape: each candidate is passed over, naming the
    parameters that differ, and the job ends with status 2 (no traceback, no relaunch)."""
    work, steps, flags = working_copy(pristine, "full", tmp_path, "widths")
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags,
                 "--arch-mlp-top", "32-1")  # SMALL_MODEL's top MLP: 16-1
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for step in steps:
        assert re.search(rf"checkpoint step {step} has a dense part of other shapes than the "
                         rf"model's .*: top.0.bias saved 16, the model's 32; top.0.weight saved "
                         rf"16x(\d+), the model's 32x\1", proc.stderr), proc.stderr[-2000:]
    assert f"no usable checkpoint in {work}" in proc.stderr
