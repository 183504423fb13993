"""In-memory parity (ECRM) against no fault tolerance and against checkpoint restore + replay.

    python bench/parity.py

Real 4-rank jobs (mpiexec, gloo), the same model and data in each, k=3 r=1 by default:

- ``none``: no parity; ``parity``: parity kept up to date every step, --repeats runs of each,
  alternating. Step time: the median over a run of the intervals between rank 0's per-step
  progress lines, averaged over the repeats; their ratio is the upkeep overhead. The same cost is
  also measured inside each parity run (--phase-times): rank 0's time in the update hooks per step
  (the foreground part, immune to drift between runs; the exchanges' background threads are not in
  it, and on an oversubscribed machine they take CPU from training too).
- ``rebuild@B``: parity, and rank --fail-rank loses its shard, optimizer state and parity after
  step --fail-step; it is rebuilt while training continues, with --rebuild-budget B for each B of
  --budgets (and --transport), --rebuild-repeats runs of each, interleaved (medians reported).
  Rebuild time = failure to last rebuilt unit (the time ECRM calls full recovery); over the
  steps the rebuild touched (the failure to the end of the step in which it finished):
  throughput against before the failure, and time lost = their time minus as many steps at the
  pre-failure step time.
- ``restore``: no parity, checkpoints every --interval steps, the same failure: every rank rolls
  back to the latest checkpoint and replays. Recovery time = failure until the job is back at the
  failed step. With --fail-step = 1.5 x --interval, the replay is the mean case (half an interval).

Digests of all runs must agree (exact recovery). Prints a table, writes
bench/results/parity.json and a plot of throughput over time across the failure.
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
from pathlib import Path

import numpy as np

from mpickpt.mpiexec import mpiexec
from mpickpt.parity.rebuild import TRANSPORTS

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
# bottom MLP hidden layers (the input 13 and the output D are added), top MLP
MLPS = {"dlrm": ("512-256-64", "512-256-1"), "small": ("32", "32-1")}


def launch(ranks: int, args: list[str]) -> dict:
    """Run the trainer; returns {'lines': [(t, line)], 'digest': str}."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpickpt.train", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO)
    lines = [(time.perf_counter() - start, line.rstrip()) for line in proc.stdout]
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise SystemExit(f"run failed ({' '.join(args)}):\n{err[-3000:]}")
    digest = next(l.split()[1] for _, l in lines if l.startswith("digest "))
    return {"lines": lines, "digest": digest}


def step_times(lines) -> list[tuple[float, int]]:
    """(arrival time, step) of every progress line."""
    return [(t, int(l.split()[1].split("/")[0])) for t, l in lines if l.startswith("step ")]


def median_step(steps, lo: int, hi: int) -> float:
    """Median duration of the steps lo+1..hi (first pass only): robust to the scheduling hiccups
    of an oversubscribed machine."""
    seen = {}
    for t, s in steps:
        seen.setdefault(s, t)
    return float(np.median([seen[s] - seen[s - 1] for s in range(lo + 1, hi + 1)]))


def phase_ms(lines) -> dict[str, float]:
    """Rank 0's per-step phase times (ms) from the run's --phase-times line."""
    line = next(l for _, l in lines if l.startswith("phase times per step"))
    parts = line.split(": ", 1)[1].split()
    return {name: float(ms[:-2]) for name, ms in zip(parts[0::2], parts[1::2])}


def first_line(lines, prefix: str) -> float:
    return next(t for t, l in lines if prefix in l)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--r", type=int, default=1)
    p.add_argument("--tables", default="400000-200000-100000-50000")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--mlp", choices=sorted(MLPS), default="dlrm",
                   help="dense layers: DLRM's Criteo Kaggle MLPs (dlrm) or a tiny pair (small)")
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--steps", type=int, default=220)
    p.add_argument("--interval", type=int, default=100)
    p.add_argument("--fail-step", type=int, default=150)
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--budgets", default="0.3,0.1,1",
                   help="--rebuild-budget values to run; the first is the one held to the targets")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of none and of parity, alternating; the overhead compares the "
                        "medians of their per-run median step times")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto",
                   help="--rebuild-transport of the rebuild runs")
    p.add_argument("--sweeps", default="beside",
                   help="--rebuild-sweep values of the rebuild runs (comma-separated: each budget "
                        "runs with each, interleaved; a variant other than the first is labelled "
                        "'<budget> <sweep>')")
    p.add_argument("--rebuild-repeats", type=int, default=3,
                   help="runs of each budget (interleaved); the tables give the medians and "
                        "the spread")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default="parity", help="stem of the JSON and PNG files")
    return p.parse_args(argv)


def rebuild_figures(run, before: float, a) -> dict:
    """Rebuild time (failure to last rebuilt unit), and over the steps it touched (the failure
    to the end of the step in which it finished) the throughput against before the failure and
    the training time lost. Whole steps only: the rounds run early in a step, so a window that
    ended with the rebuild would count the rest of its last step as lost, and one shorter than
    a step would show more than 100 %. `throughput_to_rebuilt` keeps that older measure."""
    lines = run["lines"]
    logged = next(l for _, l in lines if l.startswith("parity: rebuilt"))
    t_fail = first_line(lines, "lost their shards after step")
    wall = float(re.search(r"([0-9.]+) s while training went on", logged).group(1))
    done_step = int(re.search(r"whole from step (\d+) on", logged).group(1))
    t_done = t_fail + wall  # the line itself comes a step later: its report is reduced meanwhile
    times = step_times(lines)
    # whole from a step that never ran (a settle at the run's end): up to the last step's end
    t_end = min((t for t, s in times if s == done_step), default=times[-1][0])
    steps = len([s for t, s in times if t_fail < t <= t_end])
    partial = max(1, len([s for t, s in times if t_fail <= t <= t_done]))
    return {"log": logged, "wall_s": wall, "steps": steps, "t_fail": t_fail,
            "throughput_ratio": before * steps / max(t_end - t_fail, 1e-9),
            "throughput_to_rebuilt": before * partial / max(wall, 1e-9),
            "lost_s": max(0.0, (t_end - t_fail) - steps * before),
            "rounds": int(logged.split(" in ")[-1].split(" rounds")[0]),
            "memory": "reading the group's memory" in logged}


def _medians(runs: list[dict]) -> dict:
    """One budget's figures: the median of each over its runs, the runs themselves, and the
    failure time of the first (for the timeline)."""
    out = {k: float(np.median([r[k] for r in runs]))
           for k in ("wall_s", "steps", "throughput_ratio", "throughput_to_rebuilt", "lost_s",
                     "rounds")}
    out.update(rounds=int(round(out["rounds"])), steps=int(round(out["steps"])),
               t_fail=runs[0]["t_fail"], log=runs[0]["log"], runs=runs,
               throughputs=[r["throughput_ratio"] for r in runs],
               memory=all(r["memory"] for r in runs))
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    variants = rebuild_variants(a)
    model = ["--arch-embedding-size", a.tables, "--arch-sparse-feature-size", str(a.dim),
             "--arch-mlp-bot", f"13-{MLPS[a.mlp][0]}-{a.dim}", "--arch-mlp-top", MLPS[a.mlp][1],
             "--mini-batch-size", str(a.batch), "--num-batches", str(a.steps), "--print-freq",
             "1", "--test-num-batches", "0", "--digest", "--phase-times"]
    parity = ["--parity-k", str(a.k), "--parity-r", str(a.r)]
    fail = ["--inject-failure", f"{a.fail_step}:{a.fail_rank}"]
    runs = {}
    with tempfile.TemporaryDirectory(dir=REPO / "bench") as tmp:
        plan = {**{f"{n}#{i}": args for i in range(a.repeats)
                   for n, args in (("none", model), ("parity", model + parity))},
                **{f"rebuild@{label}#{i}": model + parity + fail + [
                    "--rebuild-budget", f"{b:g}", "--rebuild-transport", a.transport,
                    "--rebuild-sweep", sweep]
                   for i in range(a.rebuild_repeats) for label, b, sweep in variants},
                "restore": model + fail + ["--ckpt-dir", os.path.join(tmp, "ck"),
                                           "--ckpt-interval", str(a.interval)]}
        for name, args in plan.items():
            print(f"running {name} ...", flush=True)
            runs[name] = launch(a.ranks, args)
    for n in ("none", "parity"):  # timeline and digest: the run with the median step time
        reps = [median_step(step_times(runs[f"{n}#{i}"]["lines"]), 20, a.steps)
                for i in range(a.repeats)]
        runs[n] = runs[f"{n}#{int(np.argsort(reps)[len(reps) // 2])}"]
        runs[n]["repeats_s"] = reps
    result = summarize(a, variants, runs)
    report(a, variants, result)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result["command"] = "python bench/parity.py " + " ".join(argv if argv is not None
                                                            else sys.argv[1:])
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    _plot(result, a, out / f"{a.name}.png")
    print(f"wrote {out / (a.name + '.json')} and {out / (a.name + '.png')}")
    return 0 if result["digests_agree"] else 1


def rebuild_variants(a) -> list[tuple[str, float, str]]:
    """(label, budget, sweep) of every rebuild variant, the first held to the targets: each
    budget with each sweep, labelled by the budget alone for the first sweep."""
    sweeps = a.sweeps.split(",")
    return [(f"{float(b):g}" + ("" if sweep == sweeps[0] else f" {sweep}"), float(b), sweep)
            for b in a.budgets.split(",") for sweep in sweeps]


def summarize(a, variants, runs) -> dict:
    digests = {n: r["digest"] for n, r in runs.items()}
    repeats = {n: runs[n]["repeats_s"] for n in ("none", "parity")}
    steps = {n: step_times(r["lines"]) for n, r in runs.items()}
    warm = 20
    # pooled over the alternating repeats: run-to-run drift on a shared VM is larger than the
    # effect, and alternating spreads it evenly over both sides
    base = float(np.mean(repeats["none"]))
    with_parity = float(np.mean(repeats["parity"]))
    rebuilds = {}
    for label, _, _ in variants:
        each = []
        for i in range(a.rebuild_repeats):
            name = f"rebuild@{label}#{i}"
            each.append(rebuild_figures(runs[name], median_step(steps[name], warm, a.fail_step),
                                        a))
        rebuilds[label] = _medians(each)
    rs_lines = runs["restore"]["lines"]
    t_fail_ck = first_line(rs_lines, "falling back to the latest checkpoint")
    t_back = [t for t, s in steps["restore"] if s == a.fail_step and t > t_fail_ck][0]
    restore_replay = t_back - t_fail_ck
    for rb in rebuilds.values():
        for one in rb["runs"]:
            one["speedup"] = restore_replay / max(one["wall_s"], 1e-9)
        rb["speedup"] = float(np.median([one["speedup"] for one in rb["runs"]]))
        rb["speedups"] = [one["speedup"] for one in rb["runs"]]
    encode_line = next(l for _, l in runs["parity"]["lines"] if l.startswith("parity: groups"))
    main_rb = rebuilds[variants[0][0]]
    overhead = with_parity / base - 1
    # the foreground part of the cost, measured inside each parity run: time in the update hooks
    # (rows_known, before/after_update, step_done) on rank 0, immune to drift between runs
    hooks_ms = float(np.mean([phase_ms(runs[f"parity#{i}"]["lines"]).get("update_hooks", 0.0)
                              for i in range(a.repeats)]))
    return {
        "config": vars(a), "digests": digests, "digests_agree": len(set(digests.values())) == 1,
        "step_s_none": base, "step_s_parity": with_parity, "overhead": overhead,
        "memory_overhead": float(encode_line.split("(")[1].split("%")[0]) / 100,
        "encode_log": encode_line, "rebuilds": rebuilds, "repeat_step_s": repeats,
        "upkeep_hooks_ms": hooks_ms, "upkeep_hooks_share": hooks_ms / (with_parity * 1e3),
        "overhead_by_pair": [p / n - 1 for n, p in zip(repeats["none"], repeats["parity"])],
        "restore_s": first_line(rs_lines, "resumed from checkpoint step") - t_fail_ck,
        "restore_replay_s": restore_replay,
        "replayed_steps": a.fail_step - (a.fail_step // a.interval) * a.interval,
        "timeline": {"none": steps["none"], "rebuild": steps[f"rebuild@{variants[0][0]}#0"],
                     "restore": steps["restore"]},
        "fail_times": {"rebuild": main_rb["t_fail"], "restore": t_fail_ck},
        "targets": {"overhead <= 5%": overhead <= 0.05,
                    "rebuild >= 10x faster than restore + replay": main_rb["speedup"] >= 10,
                    "throughput while rebuilding >= 85%": main_rb["throughput_ratio"] >= 0.85,
                    # issue 23: both at once, at the default budget
                    "rebuild >= 15x and throughput >= 90% at once":
                        main_rb["speedup"] >= 15 and main_rb["throughput_ratio"] >= 0.90},
    }


def report(a, variants, result) -> None:
    print(f"\n{'measure':46s} value")
    for label, value in [
            ("step time, no parity (ms)", f"{result['step_s_none'] * 1e3:.1f}"),
            (f"step time, parity k={a.k} r={a.r} (ms)", f"{result['step_s_parity'] * 1e3:.1f}"),
            ("parity upkeep overhead", f"{result['overhead']:+.1%}"),
            ("  overhead in each pair of runs",
             " ".join(f"{o:+.1%}" for o in result["overhead_by_pair"])),
            ("foreground upkeep (update hooks, rank 0, ms)",
             f"{result['upkeep_hooks_ms']:.2f} ({result['upkeep_hooks_share']:.1%} of a step)"),
            ("median step of each run, none (ms)",
             " ".join(f"{t * 1e3:.1f}" for t in result["repeat_step_s"]["none"])),
            ("median step of each run, parity (ms)",
             " ".join(f"{t * 1e3:.1f}" for t in result["repeat_step_s"]["parity"])),
            ("parity memory / shard memory", f"{result['memory_overhead']:.1%}"),
            ("checkpoint restore (s)", f"{result['restore_s']:.3f}"),
            (f"restore + replay of {result['replayed_steps']} steps (s)",
             f"{result['restore_replay_s']:.3f}"),
            ("digests of all runs agree", str(result["digests_agree"]))]:
        print(f"{label:46s} {value}")
    print(f"\n{'rebuild budget':>14s} {'rounds':>6s} {'steps':>5s} {'rebuild s':>9s} "
          f"{'throughput':>10s} {'(to rebuilt)':>12s} {'time lost s':>11s} "
          f"{'restore+replay / rebuild':>24s}")
    for b, rb in result["rebuilds"].items():
        print(f"{b:>14s} {rb['rounds']:6d} {rb['steps']:5d} {rb['wall_s']:9.3f} "
              f"{rb['throughput_ratio']:10.1%} {rb['throughput_to_rebuilt']:12.1%} "
              f"{rb['lost_s']:11.3f} {rb['speedup']:23.1f}x")
        if len(rb["runs"]) > 1:
            print(f"{'':>14s} each run: throughput "
                  + " ".join(f"{t:.1%}" for t in rb["throughputs"]) + ", speed-up "
                  + " ".join(f"{x:.1f}x" for x in rb["speedups"]))
    print("(medians over --rebuild-repeats runs of each budget)")
    print(f"(restore + replay loses {result['restore_replay_s']:.3f} s)")
    print(f"targets (budget {variants[0][0]}): " + ", ".join(
        f"{k}: {'met' if v else 'MISSED'}" for k, v in result["targets"].items()))


def _plot(result, a, path) -> None:
    """Left: samples/s (5-step rolling mean) around the failure; right: the step each run has
    reached, against seconds since its failure (the failure-free run: since it passed that
    step), which shows the replay that a checkpoint restore costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, label in [("none", "no failure"), ("rebuild", "parity: failure, rebuild"),
                        ("restore", "checkpoint: failure, restore + replay")]:
        pts = result["timeline"][name]
        t0 = result["fail_times"].get(name)
        if t0 is None:
            t0 = next(t for t, s in pts if s == a.fail_step)
        ts = np.array([t for t, _ in pts]) - t0
        rate = a.batch / np.maximum(np.diff(ts), 1e-9)
        smooth = np.convolve(rate, np.ones(5) / 5, mode="valid")
        ax.plot(ts[5:], smooth, label=label, lw=1.2)
        bx.plot(ts, [s for _, s in pts], label=label, lw=1.2)
    for x in (ax, bx):
        x.axvline(0, color="grey", ls="--", lw=0.8)
        x.set_xlabel("seconds since the failure")
        x.set_xlim(-10, None)
    bx.set_ylim(max(0, a.fail_step - a.interval - 10), None)
    ax.set_ylabel("samples/s (5-step rolling mean)")
    bx.set_ylabel("training step reached")
    ax.set_title(f"{a.ranks} ranks, k={a.k} r={a.r}, {a.mlp} MLPs: rank {a.fail_rank} lost "
                 f"after step {a.fail_step}", fontsize=10)
    bx.set_title(f"checkpoints every {a.interval} steps: replay of "
                 f"{result['replayed_steps']} steps", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
