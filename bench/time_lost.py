"""Training time lost per checkpoint: real `mpickpt-train` runs with and without checkpoints,
alternating, at 1 rank on 2 cores (a core free) and 2 ranks (none free), for each checkpoint kind
and background priority (issue 23).

    python bench/time_lost.py --ranks 1,2 --rounds 2 --steps 600 --interval 50

Each round runs, one after the other and in a rotating order, a run without checkpoints and one
run per (kind, --ckpt-background, --ckpt-snapshot, --ckpt-io, --ckpt-cores) case, all on the same
synthetic stream (26 Criteo Kaggle tables / --scale-down, D = 16, global batch --batch). From
each run's `--run-report`: the training loop's wall time (steps, reading and checkpoint calls),
the checkpoints taken, the stall of each save (`save_seconds`) and the background's CPU seconds
(rank 0's writers, extractor and copier). *lost per checkpoint* = (loop time −
the same round's loop time without checkpoints) / checkpoints; the spread is over rounds.

Targets (issue 23): with a free core, lost per checkpoint ≤ 2 × the stall + 10 % of the
background's CPU seconds per checkpoint. With no free core, the background's CPU seconds per GB
written ≤ 1.5 × the floor: the CPU seconds per GB of a memcpy, a CRC32 (the one mpickpt uses,
`mpickpt.store.crc`) and a write + fsync of the same bytes, measured here in this process on a buffer of one checkpoint's median size
(`floor_cpu_per_gb`). The background's CPU is rank 0's ended children at the run's end (its
writers and IncrCP extractor: `background_cpu_seconds` of the run report) over the bytes rank 0's
writers wrote (`write_bytes`): it includes the processes' start-up (interpreter, imports), which a
job pays once, not per checkpoint. The *jobs'* CPU per GB leaves that out: the CPU the writers and
the extractor spent on their jobs (`write_cpu_seconds`, `companion_cpu_seconds`) over the same
bytes, and then over every byte the background wrote: the writers' and the IncrCP extractor's
bundles (`companion_bytes`), which rewrite the rows of the older chunks it splits.

*Loaded floor* (where no core is free): the same floor's work on the same bytes measured
beside training, by an idle-priority process repeating it through a run without checkpoints
(`--loaded-floor-rounds` per kind): the writers share the cores, their caches and the memory
bandwidth with training, which the floor of an idle machine does not. The jobs' CPU per GB is
judged against both. Both floors include creating and deleting their file.

*Paired* (the second estimate of the time lost, immune to the drift between runs that sets the
spread of the first): from the steps' end times in each run's report, for every checkpoint at
step c (from the second interval on) the wall time of the half interval after it (its save call,
its background work) minus that of the next half interval (the background over, the next save
not yet due); the same differences of the run without checkpoints, at the same steps, take out
what the windows differ by anyway. Lost per checkpoint = the mean of a case's differences over
all its rounds minus the mean of the runs without, with a 95 % bootstrap interval; *within*: the
share of checkpoints whose background write committed inside their half interval (the IncrCP
extractor's work after the commit is not checked). The target is met where the interval lies
below the bound, missed where it lies above it, not separated where it straddles it. The
background's CPU in the bound is all of it: the writers' jobs, the IncrCP extractor's and the
copy-on-update copier's (`copy_cpu_seconds` of the run report), per checkpoint.

*Interference probe* (the machine's own floor, where the ranks leave a core free): runs without
checkpoints, alone and beside a process that does, over and over on 64 MB at the idle
priority, a copy (a memcpy and a CRC32) or a write (the same, then an O_DIRECT write and an
fsync: the floor's work); the loop time each adds per CPU second it used is what that work on
the free core costs training on this machine, whoever does it (the cores share the memory
bandwidth and the last-level cache, and the disk's DMA and the kernel's I/O work are in no
process's CPU). The *machine floor* is 2 × the stall + the copy's share × the copier's CPU +
the write's share × the writers' and the extractor's: the issue's bound with the machine's
shares in place of its 10 %.

Prints a table, writes bench/results/time_lost.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mpickpt.engine.free_cores import cores_available, free_cores
from mpickpt.mpiexec import mpiexec
from mpickpt.store.crc import crc32

HERE = Path(__file__).resolve().parent
KINDS = {"full": ("--ckpt-kind", "full"), "incrcp": ("--ckpt-kind", "incrcp"),
         "incrcp-4bit": ("--ckpt-kind", "incrcp", "--ckpt-bits", "4")}


def run(ranks: int, args, workdir: Path, name: str, extra: tuple) -> dict:
    """One training run; its run report. Local (launches mpiexec)."""
    report = workdir / f"{name}.json"
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpickpt.train",
           "--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down",
           str(args.scale_down), "--mini-batch-size", str(args.batch), "--num-batches",
           str(args.steps), "--test-num-batches", "0", "--print-freq", "0",
           "--run-report", str(report), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(report.read_text())


SNAPSHOTS = {"stop-the-world": "stw", "copy-on-update": "cou"}


def cases(args) -> list[tuple[str, str, str, str, str]]:
    """(kind, background, snapshot, io, cores) of every checkpointing run of a round."""
    return [(k, b, s, io, c) for k in args.kinds.split(",") for b in args.backgrounds.split(",")
            for s in args.snapshots.split(",") for io in args.ios.split(",")
            for c in args.cores.split(",")]


def case_name(case) -> str:
    return f"{case[0]}-{case[1]}-{SNAPSHOTS[case[2]]}-{case[3]}-{case[4]}"


def measure(args) -> list[dict]:
    rows = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        for rnd in range(args.rounds):
            order = [None] + cases(args)
            shift = rnd % len(order)
            order = order[shift:] + order[:shift]  # rotate: no case always runs first
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                work = Path(tmp)
                results = {}
                for case in order:
                    name = "none" if case is None else case_name(case)
                    extra = () if case is None else (
                        "--ckpt-dir", str(work / name), "--ckpt-interval", str(args.interval),
                        "--ckpt-background", case[1], "--ckpt-snapshot", case[2],
                        "--ckpt-io", case[3], "--ckpt-cores", case[4], *KINDS[case[0]])
                    results[name] = run(ranks, args, work, name, extra)
                    print(f"ranks {ranks} round {rnd}: {name} loop "
                          f"{results[name].get('loop_seconds', float('nan')):.2f} s", flush=True)
            base = results["none"]["loop_seconds"]
            base_windows = window_differences(results["none"], args.interval)
            for case in cases(args):
                r = results[case_name(case)]
                n = max(1, r.get("checkpoints", 0))
                windows = window_differences(r, args.interval)
                written = sum(r.get("write_bytes", [])) or float("nan")
                rows.append({"ranks": ranks, "round": rnd, "kind": case[0],
                             "background": case[1], "snapshot": case[2], "io": case[3],
                             "core_split": case[4],
                             "checkpoints": n,
                             "lost_s": (r["loop_seconds"] - base) / n,
                             "stall_s": statistics.median(r["save_seconds"]),
                             "cpu_s": statistics.mean(r["write_cpu_seconds"])
                             if r.get("write_cpu_seconds") else float("nan"),
                             "companion_cpu_s": r.get("companion_cpu_seconds", 0.0) / n,
                             "copy_cpu_s": r.get("copy_cpu_seconds", 0.0) / n,
                             "loop_s": r["loop_seconds"], "base_loop_s": base,
                             "window_diffs_s": windows, "base_window_diffs_s": base_windows,
                             "within": committed_within(r, args.interval),
                             "written_bytes": written,
                             "bytes_per_ckpt": statistics.median(r["write_bytes"])
                             if r.get("write_bytes") else float("nan"),
                             "background_cpu_per_gb": r.get("background_cpu_seconds",
                                                            float("nan")) / (written / 1e9),
                             "jobs_cpu_per_gb": jobs_cpu(r) / (written / 1e9),
                             "companion_bytes": r.get("companion_bytes", float("nan")),
                             "jobs_cpu_per_gb_all": jobs_cpu(r) / ((written + r.get(
                                 "companion_bytes", float("nan"))) / 1e9)})
    return rows


def jobs_cpu(report: dict) -> float:
    """The CPU rank 0's writers and extractor spent on their jobs (start-up left out). Local."""
    return sum(report.get("write_cpu_seconds", [])) + report.get("companion_cpu_seconds",
                                                                 float("nan"))


WARM_INTERVALS = 2
"""Checkpoints before step WARM_INTERVALS x interval are left out of the paired estimate (the
first save's staging and the processes' start-up)."""


def step_ends(report: dict) -> dict[int, float]:
    """Step -> when it ended (seconds since the run's report began). Local."""
    return {int(s[0]): float(s[3]) for s in report["steps"] if len(s) > 3}


def paired_steps(ends: dict[int, float], interval: int) -> list[int]:
    """The checkpoint steps c = k x interval (k >= WARM_INTERVALS) whose two half intervals
    after them the run completed (steps c, c + h and c + 2h ended; h = half the interval).
    Local."""
    half, last = interval // 2, max(ends, default=0)
    return [c for c in range(WARM_INTERVALS * interval, last - 2 * half + 1, interval)
            if c in ends and c + half in ends and c + 2 * half in ends]


def window_differences(report: dict, interval: int) -> list[float]:
    """For each of the `paired_steps` c: the wall time of steps c+1..c+h minus that of steps
    c+h+1..c+2h. The save call after step c lies in the first window. Local."""
    ends, half = step_ends(report), interval // 2
    return [(ends[c + half] - ends[c]) - (ends[c + 2 * half] - ends[c + half])
            for c in paired_steps(ends, interval)]


def committed_within(report: dict, interval: int) -> float:
    """Share of the `paired_steps` checkpoints whose background write (`write_seconds`, save to
    commit; the k-th is step (k + 1) x interval's) ended inside their first half interval.
    Local."""
    ends, half = step_ends(report), interval // 2
    writes = report.get("write_seconds") or []
    inside = [writes[k] <= ends[c + half] - ends[c] for c in paired_steps(ends, interval)
              if (k := c // interval - 1) < len(writes)]
    return sum(inside) / len(inside) if inside else float("nan")


def paired(mine: list[dict], seed: int = 0) -> tuple[float, float, float]:
    """Lost per checkpoint from the paired windows of a case's rounds: (mean, 2.5 %, 97.5 %)
    seconds, the interval by bootstrap over both sides' differences. Local."""
    ours = np.array([d for r in mine for d in r.get("window_diffs_s", [])])
    base = np.array([d for r in mine for d in r.get("base_window_diffs_s", [])])
    if len(ours) == 0 or len(base) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    boots = (rng.choice(ours, (2000, len(ours))).mean(axis=1)
             - rng.choice(base, (2000, len(base))).mean(axis=1))
    return (float(ours.mean() - base.mean()), float(np.percentile(boots, 2.5)),
            float(np.percentile(boots, 97.5)))


def verdict(low: float, high: float, bound: float) -> str:
    """The paired estimate against the bound: met, missed or not separated ('-' where either
    is unknown). Local."""
    if not (low == low and bound == bound):
        return "-"
    return "met" if high <= bound else "missed" if low > bound else "not separated"


def floor_cpu_per_gb(nbytes: int, directory: str, repeats: int = 7) -> float:
    """CPU seconds per GB of the physical floor of writing `nbytes`: a memcpy of them, a CRC32
    over them and a write + fsync of them to a file in `directory`; the best of `repeats`. Local."""
    src, dst = floor_buffers(nbytes)
    best = float("inf")
    for _ in range(repeats):
        cpu = time.process_time()
        floor_work(src, dst, directory)
        best = min(best, time.process_time() - cpu)
    return best / (dst.nbytes / 1e9)


def floor_buffers(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """The floor's source and destination buffers of `nbytes` (at least 1 MiB), their pages
    faulted in. Local."""
    src = np.random.default_rng(0).integers(0, 255, max(int(nbytes), 1 << 20), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return src, dst


def floor_work(src: np.ndarray, dst: np.ndarray, directory: str) -> None:
    """The floor's work on one checkpoint's bytes: a memcpy, a CRC32 and a write + fsync to a
    new file in `directory`, deleted after. Local."""
    with tempfile.NamedTemporaryFile(dir=directory, prefix="floor-") as f:
        np.copyto(dst, src)
        crc32(dst)
        f.write(memoryview(dst))
        f.flush()
        os.fsync(f.fileno())


def background_cpu(row: dict) -> float:
    """CPU seconds of a checkpoint's background work in one run: the writers' jobs, the IncrCP
    extractor's and the copy-on-update copier's, per checkpoint (rows from before the latter
    two were recorded count the writers alone). Local."""
    return row["cpu_s"] + row.get("companion_cpu_s", 0.0) + row.get("copy_cpu_s", 0.0)


HOG_BYTES = 64 << 20
"""The interference probe's buffer: larger than the last-level cache, as a checkpoint is."""


HOGS = ("copy", "write")
"""The probe's kinds of background work: a copy (a memcpy and a CRC32, the copier's and a
writer's passes over memory) and a write (the same, then an O_DIRECT write and an fsync)."""


def hog(kind: str, directory: str) -> None:
    """The interference probe's background process: `kind`'s work (HOGS) on HOG_BYTES over and
    over, at the idle priority as the writers run, until SIGTERM; a write goes to a file in
    `directory` (buffered where the filesystem refuses O_DIRECT). Once set up it prints its
    CPU seconds so far: the probe counts only what follows. Local."""
    import mmap
    import signal

    from mpickpt import background_priority
    from mpickpt.store.direct_io import DirectFile

    background_priority.apply(os.getpid(), "idle")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    src = np.random.default_rng(0).integers(0, 255, HOG_BYTES, dtype=np.uint8)
    dst = np.frombuffer(mmap.mmap(-1, HOG_BYTES), dtype=np.uint8)  # page-aligned
    np.copyto(dst, src)  # its pages faulted in
    path = os.path.join(directory, f"hog-{os.getpid()}.bin")
    open(path, "wb").close()
    try:
        print(time.process_time(), flush=True)
        while True:
            np.copyto(dst, src)
            crc32(dst)
            if kind == "write":
                _write_synced(DirectFile(path), dst)
    finally:
        os.unlink(path)


def floor_hog(directory: str, nbytes: int) -> None:
    """The loaded floor's background process: the floor's work (`floor_work`) on `nbytes`,
    over and over at the idle priority as the writers run, until SIGTERM. Once set up it prints
    its CPU seconds so far; at its end, the bytes of its completed passes and its CPU seconds
    at the end of the last one. Local."""
    import signal

    from mpickpt import background_priority

    background_priority.apply(os.getpid(), "idle")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    src, dst = floor_buffers(nbytes)
    done, cpu = 0, time.process_time()
    print(cpu, flush=True)
    try:
        while True:
            floor_work(src, dst, directory)
            done, cpu = done + dst.nbytes, time.process_time()
    finally:
        print(done, cpu, flush=True)


def loaded_floor(ranks: int, nbytes: float, args, workdir: Path) -> dict:
    """The floor measured beside training: a run without checkpoints at `ranks` while
    `floor_hog` does the floor's work on `nbytes` at a time; its CPU seconds per GB there (the
    cores, their caches and the memory bandwidth shared with training as the writers share
    them). RuntimeError where the hog did not complete a pass. Local (launches mpiexec)."""
    loop, set_up, tail, returncode, _, _ = _beside(["floor", str(workdir), str(int(nbytes))],
                                                   ranks, args, workdir, "floor-beside")
    tail = tail.split()
    done, cpu = (float(tail[0]), float(tail[1])) if len(tail) == 2 else (0.0, float("nan"))
    if not done > 0:
        raise RuntimeError(f"the loaded floor's hog completed no pass (exit code "
                           f"{returncode}, printed {tail})")
    return {"ranks": ranks, "bytes": nbytes, "loop_s": loop, "hog_bytes": done,
            "hog_cpu_s": cpu - set_up, "cpu_s_per_gb": (cpu - set_up) / (done / 1e9)}


def loaded_floors(rows: list[dict], args) -> list[dict]:
    """`loaded_floor` per kind and round, at each --ranks value that leaves no core free, on
    that kind's median checkpoint size there. Local (launches mpiexec)."""
    out = []
    for ranks in sorted({r["ranks"] for r in rows if not free_core(r["ranks"])}):
        for kind in sorted({r["kind"] for r in rows if r["ranks"] == ranks}):
            sizes = [r["bytes_per_ckpt"] for r in rows if (r["ranks"], r["kind"]) == (
                ranks, kind) and r["bytes_per_ckpt"] == r["bytes_per_ckpt"]]
            size = statistics.median(sizes) if sizes else 1 << 26
            for rnd in range(args.loaded_floor_rounds):
                with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                    out.append({"kind": kind, "round": rnd,
                                **loaded_floor(ranks, size, args, Path(tmp))})
                f = out[-1]
                print(f"ranks {ranks} {kind}: the floor beside training {f['cpu_s_per_gb']:.3f}"
                      f" CPU s/GB ({f['hog_bytes'] / 1e9:.2f} GB in {f['bytes'] / 1e6:.1f} MB "
                      f"passes)", flush=True)
    return out


def loaded_floor_of(loaded: list[dict]) -> dict[tuple[int, str], float]:
    """(ranks, kind) -> the median over rounds of the loaded floor's CPU s/GB. Local."""
    by: dict[tuple[int, str], list[float]] = {}
    for f in loaded:
        by.setdefault((f["ranks"], f["kind"]), []).append(f["cpu_s_per_gb"])
    return {k: statistics.median(v) for k, v in by.items()}


def _write_synced(sink, data: np.ndarray) -> None:
    try:
        sink.write_at(0, data)
    finally:
        sink.close()
    fd = os.open(sink.path, os.O_WRONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def beside_hog(kind: str, ranks: int, args, workdir: Path) -> tuple[float, float]:
    """A run without checkpoints beside a `kind` hog: (its loop seconds, the hog's CPU seconds
    during the loop: its CPU rate from the end of its set-up to its end times the loop's wall
    time). RuntimeError where the hog did not run. Local (launches mpiexec)."""
    loop, set_up, _, returncode, usage, elapsed = _beside([kind, str(workdir)], ranks, args,
                                                          workdir, f"probe-{kind}")
    cpu = usage.ru_utime + usage.ru_stime - set_up
    if returncode != 0 or not cpu > 0:
        raise RuntimeError(f"the interference probe's {kind} hog did not run (exit code "
                           f"{returncode}, {cpu} CPU s after its set-up)")
    return loop, cpu / elapsed * loop


def _beside(hog_args: list[str], ranks: int, args, workdir: Path, name: str):
    """A run without checkpoints (`name`) beside this bench's `--hog` process of `hog_args`,
    which prints its CPU seconds once set up, and stops at SIGTERM: (the run's loop seconds,
    the hog's set-up CPU seconds, what it printed after, its exit code, its resource usage, the
    wall seconds from its set-up to its end). Local (launches mpiexec)."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--hog", *hog_args],
                            stdout=subprocess.PIPE, text=True)
    try:
        set_up = float(proc.stdout.readline() or "nan")
        started = time.perf_counter()
        loop = run(ranks, args, workdir, name, ())["loop_seconds"]
    finally:
        proc.terminate()
        tail = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
    return loop, set_up, tail, proc.returncode, usage, time.perf_counter() - started


def probe_round(ranks: int, args, workdir: Path, rnd: int) -> dict:
    """One round of the interference probe: a run without checkpoints alone and one beside each
    kind of hog, in an order that rotates by round; per kind, the loop time it added per CPU
    second it used (`share_<kind>`). Local (launches mpiexec)."""
    out = {"ranks": ranks, "round": rnd}
    order = ("alone",) + HOGS
    for which in order[rnd % len(order):] + order[:rnd % len(order)]:
        if which == "alone":
            out["alone_s"] = run(ranks, args, workdir, "probe-alone", ())["loop_seconds"]
        else:
            out[f"{which}_s"], out[f"{which}_cpu_s"] = beside_hog(which, ranks, args, workdir)
    for kind in HOGS:
        out[f"share_{kind}"] = (out[f"{kind}_s"] - out["alone_s"]) / out[f"{kind}_cpu_s"]
    return out


def probe(args) -> list[dict]:
    """The interference probe's rounds for each --ranks value that leaves a core free. Local."""
    out = []
    for ranks in (int(r) for r in args.ranks.split(",")):
        if not free_core(ranks):
            continue
        for rnd in range(args.interference_rounds):
            with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
                out.append(probe_round(ranks, args, Path(tmp), rnd))
            p = out[-1]
            print(f"ranks {ranks} probe {rnd}: loop {p['alone_s']:.2f} s alone; "
                  + "; ".join(f"{p[f'{k}_s']:.2f} s beside {p[f'{k}_cpu_s']:.1f} CPU s of "
                              f"{k}: {p[f'share_{k}']:.3f} s lost per CPU s" for k in HOGS),
                  flush=True)
    return out


def interference_share(probes: list[dict]) -> dict[int, dict[str, float]]:
    """Ranks -> hog kind -> the median over rounds of the training loop time lost per CPU
    second of that hog: what that work on the free core costs training on this machine,
    whoever does it (shared memory bandwidth and cache; the disk's DMA and the kernel's I/O
    work, in no process's CPU). Local."""
    by_ranks: dict[int, dict[str, list[float]]] = {}
    for p in probes:
        for kind in HOGS:
            by_ranks.setdefault(p["ranks"], {}).setdefault(kind, []).append(p[f"share_{kind}"])
    return {r: {k: statistics.median(v) for k, v in kinds.items()}
            for r, kinds in by_ranks.items()}


def summarize(rows: list[dict], floors: dict[str, float],
              interference: dict | None = None, loaded: dict | None = None) -> list[dict]:
    """Per (ranks, kind, background, snapshot, io, core split): medians and spread over rounds,
    and the targets: against the stall where the ranks (of one thread each) leave a core free on
    this machine, against the floor of the kind's bytes where they do not. `interference`:
    ranks -> hog kind -> the machine's training time lost per CPU second of that work on the
    free core (`interference_share`), for the second, physical bound: the copier's CPU weighed
    by the copy's share, the writers' and the extractor's by the write's. Rows of results older
    than a field count as its old default. `loaded`: (ranks, kind) -> the floor measured beside
    training (`loaded_floor_of`), against which the jobs' CPU per GB of all bytes is judged a
    second time where no core is free. Local."""
    interference, loaded = interference or {}, loaded or {}
    keys = sorted({case_of(r) for r in rows})
    out = []
    for ranks, kind, background, snapshot, io, split in keys:
        mine = [r for r in rows if case_of(r) == (ranks, kind, background, snapshot, io, split)]
        lost = [r["lost_s"] for r in mine]
        stall = statistics.median(r["stall_s"] for r in mine)
        cpu = statistics.median(r["cpu_s"] for r in mine)
        bg_cpu = statistics.median(background_cpu(r) for r in mine)
        bound = 2 * stall + 0.1 * bg_cpu
        share = interference.get(ranks, {})
        copied = statistics.median(r.get("copy_cpu_s", 0.0) for r in mine)
        machine = 2 * stall + share.get("copy", float("nan")) * copied + \
            share.get("write", float("nan")) * (bg_cpu - copied)
        per_gb = statistics.median(r["background_cpu_per_gb"] for r in mine)
        jobs_gb = statistics.median(r.get("jobs_cpu_per_gb", float("nan")) for r in mine)
        jobs_all = statistics.median(r.get("jobs_cpu_per_gb_all", float("nan")) for r in mine)
        floor = floors[kind]
        free = free_core(ranks)
        pair, pair_low, pair_high = paired(mine)
        within = [r["within"] for r in mine if r.get("within") == r.get("within")]
        out.append({"ranks": ranks, "cores": cores_available(), "free_core": free,
                    "kind": kind, "background": background,
                    "snapshot": snapshot, "io": io, "core_split": split,
                    "lost_ms": statistics.median(lost) * 1e3,
                    "lost_min_ms": min(lost) * 1e3, "lost_max_ms": max(lost) * 1e3,
                    "paired_ms": pair * 1e3, "paired_low_ms": pair_low * 1e3,
                    "paired_high_ms": pair_high * 1e3,
                    "paired_n": sum(len(r.get("window_diffs_s", [])) for r in mine),
                    "within": statistics.mean(within) if within else float("nan"),
                    "paired_verdict": verdict(pair_low, pair_high, bound) if free else "-",
                    "stall_ms": stall * 1e3, "cpu_ms": cpu * 1e3, "bound_ms": bound * 1e3,
                    "background_ms": bg_cpu * 1e3, "interference": share,
                    "machine_floor_ms": machine * 1e3,
                    "machine_verdict": verdict(pair_low, pair_high, machine) if free else "-",
                    "background_cpu_s_per_gb": per_gb, "floor_cpu_s_per_gb": floor,
                    "cpu_over_floor": per_gb / floor,
                    "jobs_cpu_s_per_gb": jobs_gb, "jobs_over_floor": jobs_gb / floor,
                    "met": statistics.median(lost) <= bound if free
                    else per_gb <= 1.5 * floor,
                    "jobs_met": None if free else jobs_gb <= 1.5 * floor,
                    "jobs_cpu_s_per_gb_all": jobs_all, "jobs_all_over_floor": jobs_all / floor,
                    "jobs_all_met": None if free or jobs_all != jobs_all
                    else jobs_all <= 1.5 * floor,
                    **_against_loaded(loaded.get((ranks, kind)), jobs_gb, jobs_all)})
    return out


def _against_loaded(floor: float | None, jobs_gb: float, jobs_all: float) -> dict:
    """The jobs' CPU per GB (over the writers' bytes, over all bytes) against the floor measured
    beside training; nothing where it was not measured. Local."""
    if floor is None:
        return {}
    return {"loaded_floor_cpu_s_per_gb": floor, "jobs_over_loaded": jobs_gb / floor,
            "jobs_all_over_loaded": jobs_all / floor,
            "jobs_all_met_loaded": None if jobs_all != jobs_all else jobs_all <= 1.5 * floor}


FIELD_DEFAULTS = {"io": "buffered", "core_split": "shared"}
"""What a run recorded before the field existed ran with."""


def case_of(row: dict) -> tuple:
    """(ranks, kind, background, snapshot, io, core split) of one run's row. Local."""
    return tuple(row.get(f, FIELD_DEFAULTS.get(f)) for f in
                 ("ranks", "kind", "background", "snapshot", "io", "core_split"))


def free_core(ranks: int) -> bool:
    """Whether `ranks` training processes of one thread each leave each a core free on this
    machine (issue 23's first case: 1 rank on 2 cores here; more on a bigger node): the
    trainer's own measure (`engine.free_cores`). Local."""
    return free_cores(ranks, "cpu", 1) >= 1


def floors_of(rows: list[dict], directory: str) -> dict[str, float]:
    """The floor (CPU s/GB) per kind, on a buffer of that kind's median checkpoint size. Local."""
    out = {}
    for kind in sorted({r["kind"] for r in rows}):
        sizes = [r["bytes_per_ckpt"] for r in rows if r["kind"] == kind
                 and r["bytes_per_ckpt"] == r["bytes_per_ckpt"]]
        out[kind] = floor_cpu_per_gb(statistics.median(sizes) if sizes else 1 << 26, directory)
    return out


def print_table(summary: list[dict]) -> None:
    print("\n| ranks | kind | background | snapshot | io | cores | lost ms / ckpt (min–max) | "
          "stall ms | writer CPU ms / ckpt | background CPU ms / ckpt | bound 2·stall + "
          "0.1·background CPU ms | background CPU s/GB | floor s/GB | ratio | met | "
          "jobs' CPU s/GB | ratio | met | jobs' CPU s/GB of all bytes | ratio | met |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['ranks']} | {s['kind']} | {s['background']} | {s['snapshot']} | {s['io']} | "
              f"{s['core_split']} | "
              f"{s['lost_ms']:.0f} "
              f"({s['lost_min_ms']:.0f}–{s['lost_max_ms']:.0f}) | {s['stall_ms']:.1f} | "
              f"{s['cpu_ms']:.0f} | {s.get('background_ms', s['cpu_ms']):.0f} | "
              f"{s['bound_ms']:.0f} | {s['background_cpu_s_per_gb']:.2f} | "
              f"{s['floor_cpu_s_per_gb']:.2f} | {s['cpu_over_floor']:.1f}× | "
              f"{'yes' if s['met'] else 'no'} | {s['jobs_cpu_s_per_gb']:.2f} | "
              f"{s['jobs_over_floor']:.1f}× | "
              f"{_yes(s['jobs_met'])} | "
              f"{s.get('jobs_cpu_s_per_gb_all', float('nan')):.2f} | "
              f"{s.get('jobs_all_over_floor', float('nan')):.1f}× | "
              f"{_yes(s.get('jobs_all_met'))} |")
    print("\n| ranks | kind | background | snapshot | io | cores | paired lost ms / ckpt (95 % "
          "interval) | checkpoints | committed within | bound ms | paired verdict | "
          "machine floor ms | against it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['ranks']} | {s['kind']} | {s['background']} | {s['snapshot']} | {s['io']} | "
              f"{s['core_split']} | "
              f"{s['paired_ms']:.1f} ({s['paired_low_ms']:.1f} – {s['paired_high_ms']:.1f}) | "
              f"{s['paired_n']} | {s['within']:.0%} | {s['bound_ms']:.1f} | "
              f"{s['paired_verdict']} | {s.get('machine_floor_ms', float('nan')):.1f} | "
              f"{s.get('machine_verdict', '-')} |")
    _print_loaded(summary)
    print(f"met ({cores_available()} cores): with a core free, lost against the stall bound; with "
          "none, the CPU per GB against 1.5 × the floor (the background's CPU with its start-up, "
          "then the jobs' alone, over the writers' bytes and then over all the background "
          "wrote: the writers' and the IncrCP extractor's bundles); machine floor: 2·stall + "
          "the probe's copy share × the copier's CPU + its write share × the writers' and the "
          "extractor's")


def _print_loaded(summary: list[dict]) -> None:
    """The cases with no core free against the floor measured beside training. Local."""
    mine = [s for s in summary if "loaded_floor_cpu_s_per_gb" in s]
    if not mine:
        return
    print("\n| ranks | kind | background | snapshot | io | cores | floor s/GB, idle machine | "
          "floor s/GB, beside training | jobs' CPU s/GB | ratio | jobs' CPU s/GB of all bytes "
          "| ratio | met (≤ 1.5×) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in mine:
        print(f"| {s['ranks']} | {s['kind']} | {s['background']} | {s['snapshot']} | {s['io']} | "
              f"{s['core_split']} | {s['floor_cpu_s_per_gb']:.2f} | "
              f"{s['loaded_floor_cpu_s_per_gb']:.2f} | {s['jobs_cpu_s_per_gb']:.2f} | "
              f"{s['jobs_over_loaded']:.1f}× | {s['jobs_cpu_s_per_gb_all']:.2f} | "
              f"{s['jobs_all_over_loaded']:.1f}× | {_yes(s['jobs_all_met_loaded'])} |")


def _yes(met) -> str:
    return "-" if met is None else "yes" if met else "no"


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({s["ranks"] for s in summary})
    loaded = [s for s in summary if "loaded_floor_cpu_s_per_gb" in s]
    fig, axes = plt.subplots(1, len(ranks) + bool(loaded), figsize=(
        8 * (len(ranks) + bool(loaded)), 4.2), squeeze=False)
    if loaded:
        _plot_loaded(axes[0][-1], loaded)
    for ax, n in zip(axes[0], ranks):
        mine = [s for s in summary if s["ranks"] == n]
        names = [f"{s['kind']}\n{s['background']}\n{SNAPSHOTS[s['snapshot']]}\n{s['io']}\n"
                 f"{s['core_split']}" for s in mine]
        ax.bar(names, [s["lost_ms"] for s in mine], label="lost / ckpt",
               yerr=[[s["lost_ms"] - s["lost_min_ms"] for s in mine],
                     [s["lost_max_ms"] - s["lost_ms"] for s in mine]], capsize=3)
        ax.errorbar(names, [s["paired_ms"] for s in mine], fmt="o", color="tab:red",
                    yerr=[[s["paired_ms"] - s["paired_low_ms"] for s in mine],
                          [s["paired_high_ms"] - s["paired_ms"] for s in mine]], capsize=4,
                    label="paired windows (95 %)")
        ax.plot(names, [s["bound_ms"] for s in mine], "k_", markersize=20,
                label="2·stall + 0.1·background CPU")
        if any(s.get("machine_floor_ms", float("nan")) == s.get("machine_floor_ms")
               for s in mine):
            ax.plot(names, [s.get("machine_floor_ms", float("nan")) for s in mine], "_",
                    color="tab:green", markersize=20,
                    label="2·stall + the probe's shares·background CPU")
        ax.set_title(f"{n} rank(s) on {cores_available()} cores")
        ax.set_ylabel("ms per checkpoint")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_loaded(ax, loaded: list[dict]) -> None:
    """The jobs' CPU per GB of all bytes where no core is free, against 1.5 × each floor (log
    scale). Local."""
    names = [f"{s['kind']}\n{s['ranks']} ranks\n{SNAPSHOTS[s['snapshot']]}" for s in loaded]
    ax.bar(names, [s["jobs_cpu_s_per_gb_all"] for s in loaded], label="jobs' CPU s/GB, all bytes")
    ax.plot(names, [1.5 * s["floor_cpu_s_per_gb"] for s in loaded], "k_", markersize=20,
            label="1.5 × floor, idle machine")
    ax.plot(names, [1.5 * s["loaded_floor_cpu_s_per_gb"] for s in loaded], "_",
            color="tab:green", markersize=20, label="1.5 × floor beside training")
    ax.set_yscale("log")
    ax.set_ylabel("CPU s per GB")
    ax.set_title("no core free: background CPU per GB")
    ax.legend(fontsize=8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--interval", type=int, default=50)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--scale-down", type=int, default=45, help="26 Kaggle tables / this")
    p.add_argument("--kinds", default="full,incrcp-4bit")
    p.add_argument("--backgrounds", default="idle,normal")
    p.add_argument("--snapshots", default="stop-the-world,copy-on-update")
    p.add_argument("--ios", default="direct,buffered",
                   help="--ckpt-io values: O_DIRECT writes against the page cache, same rounds")
    p.add_argument("--cores", default="shared",
                   help="--ckpt-cores values: training and background on shared or split cores")
    p.add_argument("--interference-rounds", type=int, default=2,
                   help="rounds of the interference probe (runs without checkpoints alone and "
                        "beside a memory-bound idle process) where the ranks leave a core free")
    p.add_argument("--loaded-floor-rounds", type=int, default=1,
                   help="runs without checkpoints beside the floor's work, per kind, where the "
                        "ranks leave no core free (the floor measured beside training)")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=str(HERE / "results" / "time_lost.json"))
    if sys.argv[1:2] == ["--replot"]:  # the table and plot of a results file, again
        doc = json.loads(Path(sys.argv[2]).read_text())
        print_table(doc["summary"])
        return plot(doc["summary"], Path(sys.argv[2]).with_suffix(".png"))
    if sys.argv[1:3] == ["--hog", "floor"]:
        return floor_hog(sys.argv[3], int(sys.argv[4]))
    if sys.argv[1:2] == ["--hog"]:
        return hog(sys.argv[2], sys.argv[3])
    args = p.parse_args()
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            p.error(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
    rows = measure(args)
    probes = probe(args)
    loaded = loaded_floors(rows, args)
    floors = floors_of(rows, args.dir)
    summary = summarize(rows, floors, interference_share(probes), loaded_floor_of(loaded))
    print_table(summary)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args), "runs": rows,
                               "floors_cpu_s_per_gb": floors, "interference": probes,
                               "loaded_floors": loaded,
                               "summary": summary}, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
