"""Training time a parity rebuild costs, per failure: several failures in each run, variants
interleaved.

    python bench/rebuild_loss.py --variant 0.07= --variant 0.15=--rebuild-budget,0.15

`bench/parity.py` measures one failure per run, so each run gives one sample of a figure that this
VM's hiccups move by +-10 points. Here every run of bench/parity.py's 4-rank job (k = 3, r = 1,
gloo) loses rank --fail-rank's shard at each of --fail-steps (default every 25 steps from 40), so
a run gives one sample per failure; the variants (extra trainer flags, or another checkout of
the code: --tree NAME=PATH) run in turn, --runs times. For each failure: the steps from the
failure to the one in which the rebuild finished ("whole from step S"), the throughput over
them against the median step of the 14 before the failure, and the training time lost (their
time minus as many steps at that median). Prints a table of medians, means and spreads, and
writes bench/results/<name>.json. All runs of a variant must end with the same digest.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mpickpt.mpiexec import mpiexec

REPO = Path(__file__).resolve().parents[1]
JOB = ["--arch-embedding-size", "400000-200000-100000-50000", "--arch-sparse-feature-size", "16",
       "--arch-mlp-bot", "13-512-256-64-16", "--arch-mlp-top", "512-256-1",
       "--mini-batch-size", "4096", "--print-freq", "1", "--test-num-batches", "0", "--digest",
       "--parity-k", "3", "--parity-r", "1"]
BEFORE = 14
"""Steps before a failure whose median is the pre-failure step time."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True, metavar="NAME=FLAGS",
                   help="a variant: its name and its extra trainer flags, comma-separated "
                        "(e.g. 0.3=--rebuild-budget,0.3; NAME= for none)")
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                   help="run variant NAME from the checkout at PATH (its kernels built there)")
    p.add_argument("--runs", type=int, default=4)
    p.add_argument("--fail-steps", default="40,65,90,115,140,165,190")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=215)
    p.add_argument("--name", default="rebuild_loss")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = p.parse_args(argv)
    a.variants = {}
    for v in a.variant:
        name, _, flags = v.partition("=")
        a.variants[name] = [f for f in flags.split(",") if f]
    a.trees = dict(t.split("=", 1) for t in a.tree)
    unknown = set(a.trees) - set(a.variants)
    if unknown:
        p.error(f"--tree names no variant: {', '.join(sorted(unknown))}")
    a.fails = [int(s) for s in a.fail_steps.split(",")]
    if min(a.fails) <= BEFORE or max(a.fails) >= a.steps - 3:
        p.error(f"--fail-steps must lie in ({BEFORE}, {a.steps - 3}), got {a.fail_steps}")
    return a


def run_job(a, flags: list[str], cwd: str) -> tuple[list[tuple[float, str]], str]:
    """One run: its output lines with arrival times, and its digest."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    fail = "/".join(f"{s}:{a.fail_rank}" for s in a.fails)
    cmd = [mpiexec(), "-n", "4", sys.executable, "-m", "mpickpt.train", *JOB, "--num-batches",
           str(a.steps), "--inject-failure", fail, *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd)
    lines = [(time.perf_counter() - start, line.rstrip()) for line in proc.stdout]
    if proc.wait() != 0:
        raise SystemExit(f"run failed ({' '.join(flags)} in {cwd}):\n"
                         + "\n".join(l for _, l in lines[-30:]))
    digest = next(l.split()[1] for _, l in lines if l.startswith("digest "))
    return lines, digest


def failures(a, lines) -> list[dict]:
    """Per failure: steps it touched, throughput over them, time lost (s), the rebuild's line."""
    ends = {}
    for t, line in lines:
        m = re.match(r"step (\d+)/", line)
        if m:
            ends.setdefault(int(m.group(1)), t)
    rebuilt = [l for _, l in lines if l.startswith("parity: rebuilt")]
    if len(rebuilt) != len(a.fails):
        raise SystemExit(f"{len(a.fails)} failures, {len(rebuilt)} rebuilds reported")
    out = []
    for f, line in zip(a.fails, rebuilt):
        done = int(re.search(r"whole from step (\d+) on", line).group(1))
        before = float(np.median([ends[s] - ends[s - 1] for s in range(f - BEFORE + 1, f + 1)]))
        span = ends[done] - ends[f]
        out.append({"fail_step": f, "steps": done - f, "step_s": before,
                    "throughput": (done - f) * before / span,
                    "lost_s": span - (done - f) * before,
                    "lost_by_step_s": [ends[s] - ends[s - 1] - before
                                       for s in range(f + 1, done + 1)], "log": line})
    return out


def summarize(samples: list[dict]) -> dict:
    tp = np.array([s["throughput"] for s in samples])
    lost = np.array([s["lost_s"] for s in samples])
    longest = max(len(s["lost_by_step_s"]) for s in samples)
    by_step = [float(np.median([s["lost_by_step_s"][i] for s in samples
                                if len(s["lost_by_step_s"]) > i])) for i in range(longest)]
    return {"n": len(samples), "throughput_median": float(np.median(tp)),
            "throughput_mean": float(tp.mean()),
            "throughput_quartiles": [float(x) for x in np.percentile(tp, [25, 75])],
            "lost_median_s": float(np.median(lost)), "lost_mean_s": float(lost.mean()),
            "steps_median": float(np.median([s["steps"] for s in samples])),
            "step_s_median": float(np.median([s["step_s"] for s in samples])),
            "lost_by_step_median_s": by_step}


def main(argv=None) -> int:
    a = parse_args(argv)
    samples = {n: [] for n in a.variants}
    digests = {n: set() for n in a.variants}
    for run in range(a.runs):
        for name, flags in a.variants.items():
            print(f"run {run + 1}/{a.runs}: {name} ...", flush=True)
            lines, digest = run_job(a, flags, a.trees.get(name, str(REPO)))
            samples[name] += failures(a, lines)
            digests[name].add(digest)
    result = {"command": "python bench/rebuild_loss.py " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "fail_steps": a.fails, "runs": a.runs,
              "variants": {n: {"flags": a.variants[n], "tree": a.trees.get(n),
                               **summarize(samples[n]), "samples": samples[n]}
                           for n in a.variants},
              "digests_agree": all(len(d) == 1 for d in digests.values())}
    print(f"\n{'variant':>12s} {'failures':>8s} {'steps':>5s} {'throughput median':>17s} "
          f"{'(quartiles)':>13s} {'mean':>6s} {'lost median ms':>14s} {'mean':>6s}")
    for n, v in result["variants"].items():
        q = v["throughput_quartiles"]
        print(f"{n:>12s} {v['n']:8d} {v['steps_median']:5.0f} {v['throughput_median']:17.1%} "
              f"{q[0]:6.1%}-{q[1]:5.1%} {v['throughput_mean']:6.1%} "
              f"{v['lost_median_s'] * 1e3:14.1f} {v['lost_mean_s'] * 1e3:6.1f}")
    for n, v in result["variants"].items():
        print(f"{n}: time lost in the 1st, 2nd, ... step after the failure (medians, ms): "
              + ", ".join(f"{x * 1e3:.1f}" for x in v["lost_by_step_median_s"]))
    print(f"digests agree within each variant: {result['digests_agree']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out / (a.name + '.json')}")
    return 0 if result["digests_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
