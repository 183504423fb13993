"""Real 2-rank training runs with quantized checkpoints: 4-bit adaptive checkpoints survive SIGKILL
and resume, exports stay within the codec's bound of the float32 state, incrcp stores quantized
rows unchanged, and `--ckpt-bits auto` falls back to 8 bits once restores exceed the estimate."""
import h5py
import numpy as np

from mpickpt.quant.codecs import Codec
from mpickpt.checkpoint.export import export_checkpoint
from mpickpt.store.manifest import list_manifests
from mpickpt.checkpoint.verify import verify_checkpoint
from tests.launch import SMALL_MODEL, resumed_step, run_ranks

STEPS = 40


def _args(ckpt, *more, steps=STEPS):
    return (*SMALL_MODEL, "--num-batches", str(steps), "--ckpt-dir", str(ckpt),
            "--ckpt-interval", "4", "--ckpt-keep", "100", *more)


def _tables(path):
    with h5py.File(path, "r") as f:
        out = {}
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
        return out


def test_4bit_checkpoints_resume_after_sigkill_within_the_codec_bound(tmp_path):
    exact, quant = tmp_path / "fp32", tmp_path / "q4"
    reference = run_ranks(2, "mpickpt.train", *_args(exact))
    assert reference.returncode == 0, reference.stderr
    killed = run_ranks(2, "mpickpt.train", *_args(quant, "--ckpt-bits", "4", "--inject-kill",
                                                  "27:1"))
    assert killed.returncode != 0
    q = {m.step: m for m in list_manifests(str(quant))}
    e = {m.step: m for m in list_manifests(str(exact))}
    last = max(q)  # the newest committed before the kill (24, or 20 when 24 was still in flight)
    assert last in (20, 24) and q[last].codec.startswith("adaptive-4"), q
    assert q[last].stats["bytes"] < 0.7 * e[last].stats["bytes"]  # payload (dense included)
    a, b = tmp_path / "q.h5", tmp_path / "e.h5"
    export_checkpoint(str(quant), q[last], str(a), with_optimizer=True)
    export_checkpoint(str(exact), e[last], str(b), with_optimizer=True)
    got, want = _tables(a), _tables(b)
    assert sorted(got) == sorted(want)
    weights = [k for k in want if k.startswith("embeddings/")]
    assert len(weights) == 4
    codec = Codec("adaptive", 4)
    for k in weights:
        err = np.sqrt(((got[k].astype(np.float64) - want[k]) ** 2).sum(axis=1))
        assert (err <= codec.row_error_bound(want[k])).all(), k
        assert not np.array_equal(got[k], want[k])  # it really was quantized
    for k in want:
        if k.startswith("optimizer/table_"):  # optimizer state: float16, within half an ulp
            assert np.allclose(got[k], want[k], rtol=2 ** -11, atol=2 ** -24), k
        elif "dense" in k:  # dense state is never quantized
            assert np.array_equal(got[k], want[k]), k
    resumed = run_ranks(2, "mpickpt.train", *_args(quant, "--ckpt-bits", "4"), "--digest")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed_step(resumed.stdout) == last
    assert "adaptive-4" in resumed.stdout
    assert resumed.stdout.count("quantization: ") == 1, resumed.stdout  # a restore changes nothing
    after = {m.step: m for m in list_manifests(str(quant))}
    assert max(after) == STEPS and after[STEPS].stats["restores"] == 1
    for m in after.values():
        assert verify_checkpoint(str(quant), m) == [], m.step


def test_quantized_incrcp_exports_equal_quantized_full_exports(tmp_path):
    runs = {}
    for kind in ("full", "incrcp"):
        ckpt = tmp_path / kind
        proc = run_ranks(2, "mpickpt.train", *_args(ckpt, "--ckpt-bits", "4", "--ckpt-kind", kind,
                                                    steps=24))
        assert proc.returncode == 0, proc.stderr
        runs[kind] = {m.step: m for m in list_manifests(str(ckpt))}
    assert any(m.kind == "incrcp" for m in runs["incrcp"].values())
    for step, m in runs["incrcp"].items():
        assert verify_checkpoint(str(tmp_path / "incrcp"), m) == [], step
        a, b = tmp_path / f"i{step}.h5", tmp_path / f"f{step}.h5"
        export_checkpoint(str(tmp_path / "incrcp"), m, str(a), with_optimizer=True)
        export_checkpoint(str(tmp_path / "full"), runs["full"][step], str(b), with_optimizer=True)
        assert a.read_bytes() == b.read_bytes(), step


def test_auto_bits_fall_back_to_8_after_more_restores_than_expected(tmp_path):
    ckpt = tmp_path / "auto"
    auto = ("--ckpt-bits", "auto", "--node-failure-rate", "0.5", "--expected-train-hours", "1",
            "--nodes", "1")
    # a first run to step 12 (checkpoints 4, 8 and 12, all committed when it ends: a kill
    # mid-run, as before, could come before any background commit on 2 busy cores, twice in CI)
    first = run_ranks(2, "mpickpt.train", *_args(ckpt, *auto, steps=12))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "expected restores 0.50" in first.stdout and "adaptive-2" in first.stdout, first.stdout
    codecs = {m.codec.split(" ")[0] for m in list_manifests(str(ckpt))}
    assert codecs == {"adaptive-2"}, first.stdout + first.stderr[-3000:]
    resumed = run_ranks(2, "mpickpt.train", *_args(ckpt, *auto, steps=20))
    assert resumed.returncode == 0, resumed.stderr
    assert "1 restores exceed the expected 0.50: checkpoints fall back to 8 bits" in resumed.stdout
    assert "restores so far 1) -> weights adaptive-8" in resumed.stdout, resumed.stdout
    start = resumed_step(resumed.stdout)
    codecs = {m.step: m.codec.split(" ")[0] for m in list_manifests(str(ckpt))}
    assert start == 12 and codecs[start] == "adaptive-2", codecs
    assert sorted(codecs) == [4, 8, 12, 16, 20], codecs
    assert all(c == "adaptive-8" for step, c in codecs.items() if step > start), codecs
