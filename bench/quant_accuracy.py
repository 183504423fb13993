"""Accuracy after repeated restores from quantized checkpoints (Check-N-Run Fig. 10), with real runs.

For every width (2, 3, 4, 8 bits; 32 bits as the lossless control) and every k (restores), one
job trains the synthetic DLRM task for `--steps` batches on `--ranks` MPI ranks and is SIGKILLed
k times (`--inject-kill`), evenly spread over the run; each relaunch resumes from the newest
committed checkpoint, i.e. from quantized weights (float16 optimizer state). The final test AUC
of the job is compared with an uninterrupted run's. Every launch is a real `mpiexec` job.

    python bench/quant_accuracy.py                      # table, JSON and PNG in bench/results/
    python bench/quant_accuracy.py --restores 1 3 --bits 4 8 --steps 200   # smaller
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from mpickpt.mpiexec import mpiexec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ("--arch-embedding-size", "20000-10000-5000-2000", "--arch-sparse-feature-size", "16",
         "--arch-mlp-bot", "13-32-16", "--arch-mlp-top", "32-16-1", "--mini-batch-size", "256",
         "--print-freq", "0")
AUC = re.compile(r"test @ step (\d+): auc ([0-9.]+)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--interval", type=int, default=8, help="batches between checkpoints")
    p.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 8, 32])
    p.add_argument("--restores", type=int, nargs="+", default=[1, 3, 10, 20])
    p.add_argument("--test-batches", type=int, default=40)
    p.add_argument("--quant", default="adaptive")
    p.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    return p.parse_args(argv)


def launch(args, *flags) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "mpickpt.train", *MODEL,
           "--num-batches", str(args.steps), "--test-num-batches", str(args.test_batches), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def kill_steps(steps: int, interval: int, k: int) -> list[int]:
    """k kill points spread evenly, each half an interval past a checkpoint step. Local."""
    out = []
    for j in range(1, k + 1):
        s = (j * steps // (k + 1)) // interval * interval + interval // 2
        if out and s <= out[-1] + interval:
            raise SystemExit(f"--steps {steps} is too short for {k} restores every "
                             f"{interval} batches")
        out.append(s)
    return out


def final_auc(proc) -> float:
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    found = AUC.findall(proc.stdout)
    if not found:
        raise SystemExit(f"no test AUC in the output:\n{proc.stdout[-2000:]}")
    return float(found[-1][1])


def run_job(args, bits: int, k: int) -> dict:
    """One job with k SIGKILLs and resumes; its final AUC and restores. Local (launches MPI)."""
    with tempfile.TemporaryDirectory(prefix="mpickpt-acc-") as ckpt:
        ck = ("--ckpt-dir", ckpt, "--ckpt-interval", str(args.interval), "--ckpt-bits", str(bits),
              *(("--ckpt-quant", args.quant) if bits < 16 else ()))  # 32 bits: no quantizer
        resumed = []
        for step in kill_steps(args.steps, args.interval, k):
            proc = launch(args, *ck, "--inject-kill", f"{step}:0")
            if proc.returncode == 0:
                raise SystemExit(f"the run meant to be killed at step {step} finished")
            resumed.append(step)
        start = time.perf_counter()
        proc = launch(args, *ck)
        auc = final_auc(proc)
        restores = len(re.findall(r"resumed from checkpoint step", proc.stdout))
        return {"bits": bits, "restores": k, "kills": resumed, "auc": auc,
                "final_launch_resumed": restores, "seconds": time.perf_counter() - start}


def plot(rows: list[dict], baseline: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for bits in sorted({r["bits"] for r in rows}):
        pts = sorted((r["restores"], r["auc"] - baseline) for r in rows if r["bits"] == bits)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{bits} bits" if bits < 32 else "32 bits (lossless)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("restores from checkpoints")
    ax.set_ylabel("final test AUC - uninterrupted AUC")
    ax.set_title("Accuracy after restores from quantized checkpoints")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    baseline = final_auc(launch(args))
    print(f"uninterrupted: auc {baseline:.5f}", flush=True)
    rows = []
    print(f"{'bits':>5} {'restores':>8} {'auc':>8} {'delta':>9}", flush=True)
    for bits in args.bits:
        for k in args.restores:
            r = run_job(args, bits, k)
            r["delta"] = r["auc"] - baseline
            rows.append(r)
            print(f"{bits:>5} {k:>8} {r['auc']:>8.5f} {r['delta']:>+9.5f}", flush=True)
    result = {"baseline_auc": baseline, "runs": rows, "ranks": args.ranks, "steps": args.steps,
              "interval": args.interval, "quant": args.quant, "model": list(MODEL),
              "test_batches": args.test_batches}
    with open(os.path.join(args.out, "quant_accuracy.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, baseline, os.path.join(args.out, "quant_accuracy.png"))
    print(f"wrote {args.out}/quant_accuracy.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
