"""Real failures: a rank SIGKILLed from outside the job, detected, dumped, relaunched, restored.

    python bench/real_failures.py                # ~12 min on 2 cores
    python bench/real_failures.py --quick        # a smoke run

Real jobs under `mpickpt-run -n 4` (MPICH's mpiexec, gloo): the 26 Criteo Kaggle tables / 100
(338k rows, D = 16), batch 1024, a checkpoint every --interval steps. In each trial one random rank
is SIGKILLed at a random step between 1.1 and 1.9 intervals (so a checkpoint exists and the
expected replay of a rollback is half an interval). Six strategies at the same checkpoint
interval, three that relaunch the job (`--in-place off`) and three that replace the dead rank
inside the running job (`--in-place on`: its node agent respawns it, the survivors keep their
processes):

- parity: --parity-k 3 and survivor dumps; the relaunch restores the survivors from their dumps
  and rebuilds the dead rank's shard from parity while training goes on;
- partial: survivor dumps, no parity; the dead rank's shard comes from its last checkpoint (CPR);
- full: no dumps; every rank rolls back to the last checkpoint (what a plain restart does);
- parity-inplace, partial-inplace, full-inplace: the same recoveries without the relaunch;
- parity-spare: parity in place, but a hot spare launched with the job (`--spares 1`, waiting
  warm) takes the dead rank instead of its respawn;
- parity-warm: parity in place, the respawn from the dead rank's own agent, which keeps a warm
  standby process (`--warm-respawn`).

Every line of the job's output is time-stamped as it arrives. Per trial: detect + dump (kill to
the first survivor's line, which it prints once its dump is written, and the dump time it
reports), exit (kill to the end of the first run), relaunch (end of the first run to the restore:
process start, MPI and torch init, the model), restore (the restore time the job reports), steps
replayed, and the training time lost: when the step after the last one completed before the kill
is done again, less when it would have been done without the failure (one step time later).

Emergency checkpoints: the same job without failures, SIGTERM to every rank at a random step;
signal-to-commit (as the job reports it) against the write time of its regular checkpoints.

For the in-place strategies: join (kill to the replacement in the next generation, the respawn's
start included) and agree, as the job logs them, steps replayed, time lost, and the survivors'
step rate while the shard is rebuilt from parity against their rate before the kill.

Targets (issue 14): time lost per failure with parity <= 1/10 of full rollback's; signal-to-commit
<= 2 x a regular checkpoint's write time. Issue 21: in-place parity (respawn) <= 1/8 of full
rollback's loss, with a hot spare (`--spares 1`, parity-spare) <= 1/20 of it and <= 3 x 0.37 s; the
survivors' rate during the rebuild >= 90 % of the rate before. Writes bench/results/real_failures.{json,png} (the
timeline of one failure per strategy).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.launch import descendants  # noqa: E402  (the process tree reader of the tests)

RESULTS = REPO / "bench" / "results"
MODEL = ["--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down", "100",
         "--mini-batch-size", "1024", "--print-freq", "1", "--test-num-batches", "0",
         "--ckpt-writers", "2"]
STRATEGIES = {
    "parity": ["--parity-k", "3", "--recovery", "parity", "--survivor-dumps", "shm",
               "--in-place", "off"],
    "partial": ["--recovery", "partial", "--survivor-dumps", "shm", "--in-place", "off"],
    "full": ["--recovery", "full", "--survivor-dumps", "off", "--in-place", "off"],
    "parity-inplace": ["--parity-k", "3", "--recovery", "parity", "--in-place", "on"],
    "partial-inplace": ["--recovery", "partial", "--in-place", "on"],
    "full-inplace": ["--recovery", "full", "--in-place", "on"],
    "parity-spare": ["--parity-k", "3", "--recovery", "parity", "--in-place", "on", "--spares",
                     "1"],
    "parity-warm": ["--parity-k", "3", "--recovery", "parity", "--in-place", "on",
                    "--warm-respawn"],
}
IN_PLACE = ("parity-inplace", "partial-inplace", "full-inplace", "parity-spare", "parity-warm")
_IN_PLACE = re.compile(r"in-place recovery: generation \d+ at step (\d+): .*?; ([\d.]+) s on the "
                       r"survivors \(join ([\d.]+) s, agree ([\d.]+) s\)")
_REBUILT = re.compile(r"parity: rebuilt ranks .* whole from step (\d+) on")
_STEP = re.compile(r"^step (\d+)/")
_DIED = re.compile(r"peer rank\(s\) \[(\d+)\] died after step (\d+)")
_DUMPED = re.compile(r"\(([\d.]+) MB in ([\d.]+) s\); exiting")
_PARTIAL = re.compile(r"partial recovery: .* in ([\d.]+) s;")
_NOTICED = re.compile(r"noticed (\S+Z)\)")
_RESTORE = re.compile(r"(?:restored from their survivor dumps at step (\d+)(?:.*?) in ([\d.]+) s"
                      r"|resumed from checkpoint step (\d+) .*? in ([\d.]+) s)")
_REGULAR = re.compile(r"checkpoint step \d+ committed \(\w+\): [\d.]+ MB in ([\d.]+) s")
_EMERGENCY = re.compile(r"checkpoint step (\d+) (?:\(the interval's\) )?committed ([\d.]+) s after "
                        r"the signal \(([\d.]+) s to write and commit")


class StampedJob:
    """A job whose output lines are kept with their arrival times (time.time())."""

    def __init__(self, cmd: list[str]):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.start = time.time()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=REPO, start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self.step = 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line))
            m = _STEP.match(line)
            if m:
                self.step = max(self.step, int(m.group(1)))

    def wait_for_step(self, step: int, timeout: float = 1200) -> None:
        deadline = time.monotonic() + timeout
        while self.step < step:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"step {step} not reached:\n{self.text()[-3000:]}")
            time.sleep(0.005)

    def ranks(self) -> list[int]:
        """The trainers (and waiting spares), not the agents' warm standbys."""
        return sorted(pid for pid, cmd in descendants(self.proc.pid)
                      if " -m mpickpt.train" in f" {cmd}" and "multiprocessing" not in cmd
                      and "rank_wrapper" not in cmd and not cmd.split()[0].endswith("mpiexec")
                      and b"MPICKPT_STANDBY=1" not in _environ(pid))

    def finish(self, timeout: float = 1800) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code

    def text(self) -> str:
        return "".join(line for _, line in self.lines)


def launch(work: Path, ranks: int, steps: int, interval: int, flags: list[str],
           restarts: int = 1) -> StampedJob:
    return StampedJob([sys.executable, "-m", "mpickpt.launch.relaunch", "-n", str(ranks),
                       "--max-restarts", str(restarts), "--", *MODEL, "--num-batches",
                       str(steps), "--ckpt-interval", str(interval), "--ckpt-dir",
                       str(work / "ckpt"), *flags])


def step_times(job: StampedJob, upto: float | None = None) -> list[tuple[float, int]]:
    return [(t, int(m.group(1))) for t, line in job.lines
            if (upto is None or t <= upto) and (m := _STEP.match(line))]


def median_step_seconds(points: list[tuple[float, int]]) -> float:
    gaps = [b[0] - a[0] for a, b in zip(points, points[1:]) if b[1] == a[1] + 1]
    return statistics.median(gaps) if gaps else float("nan")


def trial(strategy: str, seed: int, ranks: int, interval: int) -> dict:
    rng = random.Random(seed)
    target = rng.randint(int(1.1 * interval), int(1.9 * interval))
    steps = 2 * interval + interval // 4
    with tempfile.TemporaryDirectory(prefix="mpickpt-realfail-") as work:
        job = launch(Path(work), ranks, steps, interval, STRATEGIES[strategy])
        try:
            job.wait_for_step(target)
            time.sleep(rng.uniform(0.0, 0.05))
            pids = [p for p in job.ranks() if launch_rank(p) < ranks]  # not a waiting spare
            victim = rng.choice(pids)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            code = job.finish()
        finally:
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if code != 0:
        raise RuntimeError(f"{strategy} trial {seed} ended with {code}:\n{job.text()[-4000:]}")
    if strategy in IN_PLACE:
        return measure_in_place(job, strategy, killed)
    return measure(job, strategy, killed)


def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f.read()
    except OSError:
        return b""


def launch_rank(pid: int) -> int:
    """The launcher's rank of a process (PMI_RANK in its environment; spares are the last)."""
    env = dict(kv.split(b"=", 1) for kv in _environ(pid).split(b"\0") if b"=" in kv)
    return int(env.get(b"PMI_RANK", b"0"))


def measure_in_place(job: StampedJob, strategy: str, killed: float) -> dict:
    """The costs of one in-place recovery, from the time-stamped output."""
    found = [(t, m) for t, line in job.lines if (m := _IN_PLACE.search(line))]
    if "relaunching" in job.text():  # the generation did not form: measured as a relaunch
        return dict(measure(job, strategy, killed), fell_back=True)
    if len(found) != 1:
        said = [line for _, line in job.lines if not _STEP.match(line)]
        raise RuntimeError(f"{strategy}: not one in-place recovery:\n{''.join(said)[-6000:]}")
    logged, m = found[0]
    agreed, recovery_s, join_s, agree_s = int(m.group(1)), *map(float, m.group(2, 3, 4))
    before = step_times(job, killed)
    reached = max(s for t, s in step_times(job, logged))
    after = [(t, s) for t, s in step_times(job) if t > logged]
    resumed = after[0][1] - 1  # a full rollback goes back to its checkpoint after agreeing
    again = next(t for t, s in after if s == reached + 1)
    step_s = median_step_seconds(before)
    whole = next((int(m.group(1)) for t, line in job.lines
                  if t > logged and (m := _REBUILT.search(line))), None)
    # the steps up to the one from which the rows were whole (the line itself comes a step
    # later: the rebuild's report is reduced beside training)
    during = [(t, s) for t, s in after if whole is not None and s <= whole]
    rate_ratio = step_s / median_step_seconds(during) if len(during) > 2 else None
    return {
        "strategy": strategy, "killed_after_step": reached, "resumed_at_step": resumed,
        "agreed_step": agreed, "steps_replayed": reached - resumed, "step_seconds": step_s,
        "detect_s": None,
        "dump_s": None, "first_survivor_line_s": None, "exit_s": 0.0, "relaunch_s": join_s,
        "restore_s": agree_s, "join_s": join_s, "agree_s": agree_s, "recovery_s": recovery_s,
        "lost_s": again - killed - step_s, "rebuild_rate_ratio": rate_ratio,
        "rebuild_steps": len(during), "fell_back": False,
        "timeline": {"killed": killed, "run1_end": killed, "restored": logged, "again": again,
                     "steps": step_times(job)},
    }


def measure(job: StampedJob, strategy: str, killed: float) -> dict:
    died = [(t, _DIED.search(line), _NOTICED.search(line)) for t, line in job.lines
            if _DIED.search(line)]
    if strategy != "full" and not died:
        raise RuntimeError("no survivor reported the death:\n" + job.text()[-3000:])
    run1_end = next(t for t, line in job.lines if "run 1 failed" in line)
    before = step_times(job, killed)
    reached = max(int(m.group(2)) for _, m, _ in died) if died else before[-1][1]
    restore_at, restored_step, restore_s = next(
        (t, int(m.group(1) or m.group(3)), float(m.group(2) or m.group(4)))
        for t, line in job.lines if t > run1_end and (m := _RESTORE.search(line)))
    restore_s += sum(float(m.group(1)) for t, line in job.lines
                     if t > run1_end and (m := _PARTIAL.search(line)))
    again = next(t for t, s in step_times(job) if t > run1_end and s == reached + 1)
    step_s = median_step_seconds(before)
    noticed = [_iso_seconds(n.group(1)) for _, _, n in died if n]
    return {
        "strategy": strategy, "killed_after_step": reached, "resumed_at_step": restored_step,
        "steps_replayed": reached - restored_step, "step_seconds": step_s,
        "detect_s": (min(noticed) - killed) if noticed else None,
        "dump_s": max((float(d.group(2)) for t, line in job.lines
                       if (d := _DUMPED.search(line))), default=None),
        "first_survivor_line_s": (died[0][0] - killed) if died else None,
        "exit_s": run1_end - killed,
        "relaunch_s": restore_at - run1_end - restore_s,
        "restore_s": restore_s,
        "lost_s": again - killed - step_s,
        "timeline": {"killed": killed, "run1_end": run1_end, "restored": restore_at,
                     "again": again, "steps": step_times(job)},
    }


def _iso_seconds(text: str) -> float:
    from datetime import datetime

    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=__import__("datetime").timezone.utc).timestamp()


def emergency(seed: int, ranks: int, interval: int) -> dict:
    """SIGTERM to every rank at a random step of a job checkpointing every `interval` steps."""
    rng = random.Random(seed)
    steps = 4 * interval
    with tempfile.TemporaryDirectory(prefix="mpickpt-sigterm-") as work:
        job = launch(Path(work), ranks, steps, interval, [], restarts=0)
        job.wait_for_step(rng.randint(int(2.2 * interval), int(2.8 * interval)))
        for pid in job.ranks():
            os.kill(pid, signal.SIGTERM)
        code = job.finish()
    text = job.text()
    m = _EMERGENCY.search(text)
    regular = [float(x) for x in _REGULAR.findall(text)]
    if code != 75 or not m or not regular:
        raise RuntimeError(f"emergency trial {seed}: exit {code}\n{text[-3000:]}")
    return {"step": int(m.group(1)), "signal_to_commit_s": float(m.group(2)),
            "write_s": float(m.group(3)), "regular_write_s": regular,
            "ratio": float(m.group(2)) / statistics.median(regular)}


def summarize(trials: dict[str, list[dict]]) -> dict:
    keys = ("detect_s", "dump_s", "exit_s", "relaunch_s", "restore_s", "steps_replayed",
            "lost_s", "step_seconds", "join_s", "agree_s", "rebuild_rate_ratio")
    out = {}
    for name, rows in trials.items():
        out[name] = {k: statistics.mean(r[k] for r in rows if r.get(k) is not None)
                     for k in keys if any(r.get(k) is not None for r in rows)}
        out[name]["lost_without_relaunch_s"] = statistics.mean(
            r["lost_s"] - r["exit_s"] - r["relaunch_s"] for r in rows)
        out[name]["fell_back"] = sum(bool(r.get("fell_back")) for r in rows)
    return out


def interval_meeting_target(summary: dict, target: float = 0.1) -> float:
    """The checkpoint interval from which parity's time lost is at most `target` of full
    rollback's, extrapolated from the measured costs: full rollback loses a fixed part (exit,
    relaunch, restore) plus the replay of half an interval on average, parity loses what it
    lost. Solves parity = target (fixed + I/2 step). Local."""
    full, step = summary["full"], summary["full"]["step_seconds"]
    fixed = full["lost_s"] - full["steps_replayed"] * step
    return max(1.0, 2.0 * (summary["parity"]["lost_s"] / target - fixed)
               / step)


def plot(trials: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = {"parity": "tab:green", "partial": "tab:blue", "full": "tab:red",
              "parity-inplace": "lime", "partial-inplace": "deepskyblue",
              "full-inplace": "orange", "parity-spare": "magenta", "parity-warm": "purple"}
    for name, rows in trials.items():
        tl = rows[0]["timeline"]
        t0 = tl["killed"]
        xs = [t - t0 for t, _ in tl["steps"]]
        ys = [s for _, s in tl["steps"]]
        ax.plot(xs, ys, ".", ms=2, color=colors[name], label=f"{name}: lost "
                f"{rows[0]['lost_s']:.1f} s, replayed {rows[0]['steps_replayed']} steps")
        for key, mark in (("run1_end", "|"), ("restored", "x"), ("again", "o")):
            y = rows[0]["killed_after_step"]
            ax.plot([tl[key] - t0], [y], mark, color=colors[name], ms=9)
    ax.axvline(0, color="k", lw=0.8)
    ax.text(0.2, ax.get_ylim()[0], "SIGKILL", va="bottom")
    ax.set_xlim(-10, max(r[0]["lost_s"] for r in trials.values()) + 15)
    ax.set_xlabel("seconds since the kill (| first run ends, x restored / in-place generation "
                  "formed, o past the lost step)")
    ax.set_ylabel("training step")
    ax.set_title("One real failure per strategy (4 ranks, same checkpoint interval; *-inplace: "
                 "no relaunch)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--interval", type=int, default=600, help="steps between checkpoints")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES)} (full is needed for "
                        f"the ratios)")
    p.add_argument("--quick", action="store_true", help="interval 60, one trial")
    p.add_argument("--out", default=str(RESULTS / "real_failures.json"))
    args = p.parse_args()
    if args.quick:
        args.interval, args.trials = 60, 1
    names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or "full" not in names:
        p.error(f"--strategies {args.strategies!r}: expected names among "
                f"{', '.join(STRATEGIES)}, full included")
    trials: dict[str, list[dict]] = {name: [] for name in names}
    for seed in range(args.trials):
        for name in names:
            row = trial(name, 1000 + seed, args.ranks, args.interval)
            trials[name].append(row)
            print(f"{name:8s} trial {seed}: killed after step {row['killed_after_step']}, "
                  f"resumed at {row['resumed_at_step']} (replayed {row['steps_replayed']}); "
                  f"detect {_f(row['detect_s'])} dump {_f(row['dump_s'])} exit "
                  f"{row['exit_s']:.2f} relaunch {row['relaunch_s']:.2f} restore "
                  f"{row['restore_s']:.2f} s; training time lost {row['lost_s']:.2f} s",
                  flush=True)
    stops = [emergency(2000 + seed, args.ranks, max(20, args.interval // 6))
             for seed in range(args.trials)]
    for s in stops:
        print(f"SIGTERM: checkpoint of step {s['step']} committed {s['signal_to_commit_s']:.2f} s "
              f"after the signal; regular writes {statistics.median(s['regular_write_s']):.2f} s "
              f"(median); ratio {s['ratio']:.2f}", flush=True)
    summary = summarize(trials)
    full = summary["full"]
    ratios = {name: s["lost_s"] / full["lost_s"] for name, s in summary.items()}
    ratio_core = summary["parity"]["lost_without_relaunch_s"] / full["lost_without_relaunch_s"] \
        if "parity" in summary else None
    stop_ratio = max(s["ratio"] for s in stops)
    met_from = interval_meeting_target(summary) if "parity" in summary else None
    print("\nstrategy         detect  dump   exit  relaunch/join restore/agree replayed  lost(s)  "
          "lost/full  rebuild rate")
    for name, s in summary.items():
        print(f"{name:16s} {_f(s.get('detect_s')):>6} {_f(s.get('dump_s')):>5} "
              f"{s['exit_s']:6.2f} {s['relaunch_s']:13.2f} {s['restore_s']:13.2f} "
              f"{s['steps_replayed']:8.1f} {s['lost_s']:8.2f} {ratios[name]:10.3f} "
              f"{_f(s.get('rebuild_rate_ratio')):>12}"
              + (f"  ({s['fell_back']} of {len(trials[name])} fell back to a relaunch)"
                 if s.get("fell_back") else ""))
    if "parity" in summary:
        print(f"\nparity / full time lost per failure: {ratios['parity']:.3f} (target <= 0.1: "
              f"{'met' if ratios['parity'] <= 0.1 else 'MISSED'}); without the relaunch both "
              f"pay: {ratio_core:.3f} ({'met' if ratio_core <= 0.1 else 'MISSED'})")
        print(f"at these measured costs the ratio reaches 0.1 from an interval of {met_from:.0f} "
              f"steps ({met_from * full['step_seconds'] / 60:.1f} min of training)")
    if "parity-inplace" in summary:
        inplace = summary["parity-inplace"]
        rate = inplace.get("rebuild_rate_ratio")
        print(f"in-place parity (respawn) / full rollback: {ratios['parity-inplace']:.3f} (target "
              f"<= 1/8 = 0.125: {'met' if ratios['parity-inplace'] <= 0.125 else 'MISSED'}); "
              f"survivors' rate during the rebuild: "
              + (f"{rate:.2f} of before (target >= 0.9: {'met' if rate >= 0.9 else 'MISSED'})"
                 if rate is not None else "- (the rebuild ended within two steps)"))
    if "parity-warm" in summary:
        print(f"in-place parity (warm standby respawn) / full rollback: "
              f"{ratios['parity-warm']:.3f} (target <= 1/8 = 0.125: "
              f"{'met' if ratios['parity-warm'] <= 0.125 else 'MISSED'})")
    if "parity-spare" in summary:
        spare = summary["parity-spare"]
        print(f"in-place parity (hot spare) / full rollback: {ratios['parity-spare']:.3f} (target "
              f"<= 1/20 = 0.05: {'met' if ratios['parity-spare'] <= 0.05 else 'MISSED'}); lost "
              f"{spare['lost_s']:.2f} s (target <= 3 x 0.37 = 1.11 s: "
              f"{'met' if spare['lost_s'] <= 1.11 else 'MISSED'})")
    print(f"signal-to-commit / regular write: {stop_ratio:.2f} (worst of {len(stops)}; target "
          f"<= 2: {'met' if stop_ratio <= 2 else 'MISSED'})")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join(sys.argv), "ranks": args.ranks, "interval": args.interval,
              "summary": summary, "lost_over_full": ratios,
              "parity_over_full_without_relaunch": ratio_core,
              "stop_over_regular_write": stop_ratio, "emergency": stops,
              "interval_meeting_target": met_from,
              "trials": {k: [{kk: vv for kk, vv in r.items() if kk != "timeline"} for r in v]
                         for k, v in trials.items()}}
    out.write_text(json.dumps(result, indent=1))
    plot(trials, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    sys.exit(main())
