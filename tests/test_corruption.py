"""Randomized corruption: one random bit of one random file of a committed checkpoint directory is
flipped (shard and dense files, manifests, chunk indexes, IncrCP bundles), for every kind (full,
differential, incrcp with bundles, 8-bit quantized). Then `mpickpt verify` and a resumed run.

Pass: the resumed run ends with the digest of an undamaged resume from the checkpoint it resumed
from (the uninterrupted digest for lossless kinds; an earlier checkpoint when it fell back, which
it must say), or stops with a clear error. Fail: a wrong digest (damage accepted), or a traceback
from verify or the run. Jobs run on one rank, as a singleton, to keep the many trials cheap; the
multi-rank paths read the same files through the same checks. A few trials run in CI, 100 in the
slow suite; each asserts that its bit was flipped."""
import os
import random
import re
import shutil
import subprocess
import sys

import pytest

from mpickpt import cli
from mpickpt.store.manifest import list_manifests
from tests.launch import REPO, SMALL_MODEL, digest_of, resumed_step

STEPS, TOTAL = 16, 22
KINDS = {
    "full": ("--ckpt-kind", "full"),
    "differential": ("--ckpt-kind", "differential"),
    "incrcp": ("--ckpt-kind", "incrcp", "--incrcp-ratio", "0"),
    "quantized": ("--ckpt-kind", "full", "--ckpt-bits", "8"),
}
LOSSLESS = {"full", "differential", "incrcp"}


def train(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mpickpt.train", *SMALL_MODEL, "--digest",
                           *args], capture_output=True, text=True, timeout=180, env=env)


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
    """kind -> (checkpoint directory, References, the kind's flags)."""
    out = {}
    for kind, flags in KINDS.items():
        root = tmp_path_factory.mktemp(kind) / "ckpt"
        proc = train("--num-batches", str(STEPS), "--ckpt-dir", str(root), "--ckpt-interval",
                     "4", "--ckpt-keep", "3", *flags)
        assert proc.returncode == 0, proc.stderr[-2000:]
        out[kind] = (str(root), References(str(root), flags, straight, kind in LOSSLESS), flags)
    return out


def files_of(root: str) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(root) for n in names)


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


def trial(pristine, straight, kind: str, seed: int, tmp_path, capsys) -> str:
    root, reference, flags = pristine[kind]
    rng = random.Random(seed)
    work = str(tmp_path / f"{kind}-{seed}")
    shutil.copytree(root, work)
    victim = rng.choice(files_of(work))
    offset, bit = flip_one_bit(victim, rng)
    what = f"{kind} seed {seed}: bit {bit} of byte {offset} of {os.path.relpath(victim, work)}"
    code = cli.main(["verify", work])
    report = capsys.readouterr().out
    assert code in (0, 1), f"{what}: verify exited {code}\n{report}"
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert "Traceback" not in proc.stderr, f"{what}\n{proc.stderr[-3000:]}"
    if proc.returncode != 0:  # refused: it must say why, naming a file
        assert "no usable checkpoint" in proc.stderr + proc.stdout, f"{what}\n{proc.stderr}"
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


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_flipped_bit_is_caught_or_harmless(pristine, straight, kind, tmp_path, capsys):
    trial(pristine, straight, kind, 1000 + sorted(KINDS).index(kind), tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(100))
def test_a_flipped_bit_is_caught_or_harmless_many(pristine, straight, seed, tmp_path, capsys):
    trial(pristine, straight, sorted(KINDS)[seed % len(KINDS)], seed, tmp_path, capsys)


def test_an_edited_reader_position_is_refused_and_resume_falls_back(pristine, straight, tmp_path,
                                                                     capsys):
    root, _, flags = pristine["full"]
    work = str(tmp_path / "edited")
    shutil.copytree(root, work)
    newest = max(m.step for m in list_manifests(work))
    path = os.path.join(work, f"manifest-{newest:012d}.json")
    text = open(path).read()
    edited = re.sub(r'"sample_index": (\d+)', lambda m: f'"sample_index": {int(m.group(1)) + 1}',
                    text, count=1)
    assert edited != text
    with open(path, "w") as f:
        f.write(edited)
    assert cli.main(["verify", work]) == 1
    out = capsys.readouterr().out
    assert f"manifest-{newest:012d}.json" in out and "checksum" in out, out
    proc = train("--num-batches", str(TOTAL), "--ckpt-dir", work, *flags)
    assert f"checkpoint step {newest} unusable" in proc.stdout and "checksum" in proc.stdout
    assert resumed_step(proc.stdout) == newest - 4
    assert digest_of(proc) == straight
