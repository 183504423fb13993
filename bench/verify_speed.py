"""`mpickpt verify DIR` against the raw read + CRC rate of the same bytes (issue 15).

    python bench/verify_speed.py            # ~3 min on 2 cores
    python bench/verify_speed.py --quick

A 2-rank job (26 Criteo Kaggle tables / 1000, D = 16) keeps --keep `consecutive` checkpoints, one
per step, so every checkpoint lists its baseline and every earlier increment as layers (the case
that took 13 minutes when each checkpoint re-verified its parents). Measured, with the files in
the page cache (they were just written; a cold cache adds the disk's read time to every row):

- raw: read every distinct file once and CRC32 it (mpickpt.store.crc, the CRC mpickpt uses), the rate the disk and CRC allow;
- verify: `mpickpt verify DIR` (each file checked once: its bytes against the whole-file CRC32
  the manifest records, its HDF5 metadata for structure and coverage), with --jobs 1 and 2;
- per checkpoint: checkpoints verified on their own (a fresh session each), as before this
  issue: the newest alone, and every 10th checkpoint, scaled by 10 for the whole directory.

Writes bench/results/verify_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from mpickpt.checkpoint.verify import verify_checkpoint  # noqa: E402
from mpickpt.mpiexec import mpiexec  # noqa: E402
from mpickpt.store.crc import crc32  # noqa: E402
from mpickpt.store.manifest import list_manifests  # noqa: E402

RESULTS = REPO / "bench" / "results"


def build(root: Path, keep: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "mpickpt.train", "--arch-embedding-size",
           "criteo-kaggle", "--embedding-scale-down", "1000", "--mini-batch-size", "256",
           "--num-batches", str(keep), "--print-freq", "0", "--test-num-batches", "0",
           "--ckpt-dir", str(root), "--ckpt-interval", "1", "--ckpt-keep", str(keep),
           "--ckpt-kind", "consecutive"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])


def raw_rate(files: list[str]) -> tuple[int, float]:
    start, total = time.perf_counter(), 0
    for path in files:
        with open(path, "rb") as f:
            while block := f.read(1 << 22):
                crc32(block)
                total += len(block)
    return total, time.perf_counter() - start


def cli_verify(root: Path, jobs: int) -> float:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mpickpt.cli", "verify", str(root), "--jobs",
                           str(jobs)], env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0 or "0 with problems" not in proc.stdout:
        raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
    print("   ", proc.stdout.strip().splitlines()[-1])
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--keep", type=int, default=150)
    p.add_argument("--quick", action="store_true", help="30 checkpoints")
    p.add_argument("--out", default=str(RESULTS / "verify_speed.json"))
    args = p.parse_args()
    keep = 30 if args.quick else args.keep
    with tempfile.TemporaryDirectory(prefix="mpickpt-verify-") as work:
        root = Path(work) / "ckpt"
        build(root, keep)
        manifests = list_manifests(str(root))
        files = sorted({str(root / rel) for m in manifests for rel in m.files})
        uses = sum(len(m.files) for m in manifests) + sum(
            len(by.files) for m in manifests for by in manifests if by.step in m.parents)
        nbytes, raw_s = raw_rate(files)
        print(f"{len(manifests)} checkpoints, {len(files)} files, {nbytes / 1e6:.1f} MB "
              f"({uses} file uses by the checkpoints' layers)")
        one = cli_verify(root, 1)
        two = cli_verify(root, 2)
        by_step = {m.step: m for m in manifests}
        start = time.perf_counter()
        assert verify_checkpoint(str(root), manifests[-1], by_step=by_step) == []
        newest = time.perf_counter() - start
        start = time.perf_counter()
        for m in manifests[::10]:
            assert verify_checkpoint(str(root), m, by_step=by_step) == []
        separate = (time.perf_counter() - start) * len(manifests) / len(manifests[::10])
    mb = nbytes / 1e6
    rows = [("raw read + CRC32 of every file once", raw_s),
            ("mpickpt verify DIR (--jobs 1)", one), ("mpickpt verify DIR --jobs 2", two),
            ("the newest checkpoint alone, as before", newest),
            ("each checkpoint on its own (sampled 1/10, x10)", separate)]
    print(f"\n{'':46s} {'seconds':>8s} {'MB/s':>8s} {'x raw time':>10s}")
    for name, s in rows:
        print(f"{name:46s} {s:8.2f} {mb / s:8.0f} {s / raw_s:10.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "checkpoints": len(manifests),
                               "files": len(files), "bytes": nbytes, "file_uses": uses,
                               "seconds": {name: s for name, s in rows}}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
