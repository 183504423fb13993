"""Scaling sweeps: what a step, a checkpoint and each recovery cost as the job grows.

    python bench/scaling.py                              # 1, 2, 4, 8 ranks here (~6 min)
    python bench/scaling.py --quick --ranks 1,2          # the CI smoke run
    sbatch -N 4 --ntasks-per-node 8 slurm/scaling.sbatch # on a cluster: srun at every size

Each size is one real job (`mpiexec -n N`, or `srun -n N` with --launcher srun; on a cluster
`slurm/scaling.sbatch` runs `--worker` under srun directly). A job measures, for weak scaling (rows
and batch per rank fixed: the Kaggle tables scaled down by --weak-scale-down / N, batch --batch
per rank) and strong scaling (model and global batch fixed: --strong-scale-down, --batch x
--strong-ranks), on one trainer per mode with a full checkpoint kind and parity (k = N - 1, r = 1,
from 2 ranks):

- step time and its phases (route, all-to-all, lookup, dense, allreduce, optimizer, update hooks =
  parity upkeep, data), mean and slowest rank, and samples/s;
- a checkpoint: stall (the snapshot), bytes and write throughput per rank, commit latency (save
  called to manifest committed); each checkpoint and recovery timing the fastest of --repeat 5
  (--aggregate min: on a shared machine interference only adds time; median on request);
- restore of the whole model, partial recovery of the last rank's shard, parity rebuild of it;
- machine parameters by microbenchmark: memcpy bandwidth with every rank copying, write+fsync
  throughput per rank with every rank writing, file-create latency, all-to-all and allreduce
  latency (8 bytes) and bandwidth (4 MB).

Every time is the slowest rank's. Points go into bench/results/scaling.json (--out), keyed by
(host class, mode, ranks); a rerun replaces its own points and keeps the others, so sweeps from
several allocations or a job array fill one file. Above the machine's cores the ranks are
oversubscribed and the table says so. Then `python -m mpickpt.costmodel` fits and checks the cost
model on the file. Writes a table, the JSON and bench/results/scaling.png.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PHASES = ("route", "alltoall", "lookup", "dense", "allreduce", "optimizer", "update_hooks",
          "data")
MLP = ["--arch-sparse-feature-size", "16", "--arch-mlp-bot", "13-128-64-16",
       "--arch-mlp-top", "128-64-1", "--test-num-batches", "0", "--print-freq", "0"]


# ---- one job (every rank) ----------------------------------------------------------------------
def slowest(topo, value: float) -> float:
    """The largest `value` over the ranks. Collective."""
    from mpi4py import MPI
    return float(topo.control.allreduce(float(value), op=MPI.MAX))


def timed(topo, fn) -> float:
    """Seconds `fn()` took on the slowest rank, started together. Collective."""
    topo.control.Barrier()
    start = time.perf_counter()
    fn()
    return slowest(topo, time.perf_counter() - start)


def aggregate(values: list[float], how: str) -> float:
    """The median of repeated measurements (one slow outlier does not make the point), or their
    minimum (on a shared machine interference only adds time). Local."""
    import statistics
    return min(values) if how == "min" else statistics.median(values)


def repeated_timed(topo, fn, args) -> float:
    """`timed(fn)` --repeat times, aggregated by --aggregate. Collective."""
    return aggregate([timed(topo, fn) for _ in range(args.repeat)], args.aggregate)


def mode_flags(mode: str, n: int, args) -> tuple[list[str], int]:
    """(model and data flags, global batch) of `mode` at `n` ranks. Local."""
    if mode == "weak":
        scale, batch = max(1, args.weak_scale_down // n), args.batch * n
    else:
        scale, batch = args.strong_scale_down, args.batch * args.strong_ranks
    return ["--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down", str(scale),
            "--mini-batch-size", str(batch), *MLP], batch


def measure_mode(topo, mode: str, args, root: str) -> dict:
    """Every swept quantity of `mode` on this job. Collective."""
    from mpickpt.faults.loss import Loss
    from mpickpt.recovery.partial import PartialRecovery
    from mpickpt.recovery.pls import PLSAccount
    from mpickpt.store.manifest import list_manifests
    from mpickpt.train_flags import TrainConfig
    from mpickpt.trainer import Trainer

    n = topo.world_size
    flags, batch = mode_flags(mode, n, args)
    ckpt_dir = os.path.join(root, mode)
    flags += ["--num-batches", str(10 ** 6), "--phase-times", "--ckpt-dir", ckpt_dir,
              "--ckpt-interval", str(10 ** 6), "--ckpt-keep", "2"]
    if n >= 2:
        flags += ["--parity-k", str(n - 1), "--parity-r", "1"]
    trainer = Trainer(topo, TrainConfig.from_args(flags))
    model, timer, ckpt = trainer.model, trainer.timer, trainer.ckpt
    for _ in range(args.warmup):
        model.train_step(trainer.reader.next())
    timer.reset()
    step = timed(topo, lambda: [model.train_step(trainer.reader.next())
                                for _ in range(args.steps)]) / args.steps
    phases = {p: timer.totals.get(p, 0.0) / args.steps for p in PHASES}
    slow = {p: slowest(topo, v) for p, v in phases.items()}
    state = trainer.reader.state().to_dict()
    at = args.warmup + args.steps
    stalls, commits, writes = [], [], []
    for i in range(args.repeat):
        stalls.append(timed(topo, lambda: ckpt.save(at + i, state, wait=True)))
        commits.append(stalls[-1] + timed(topo, ckpt.quiesce))
        manifest = list_manifests(ckpt_dir)[-1]
        writes.append(float(manifest.stats["write_seconds"]))
    stall, commit, write = (aggregate(v, args.aggregate) for v in (stalls, commits, writes))
    out = {"mode": mode, "ranks": n, "global_batch": batch, "step_s": step,
           "samples_per_s": batch / step, "phases_s": slow,
           "local_rows": [model.plan.local_rows(r) for r in range(n)],
           "row_bytes": sum(int(t[0].numel()) * t.element_size()
                            for t in model.row_state().values()),
           "dense_bytes": sum(int(t.numel()) * t.element_size()
                              for t in model.dense_state().values()),
           "pooled_bytes_per_sample": len(model.plan.table_sizes) * model.embeddings.dim * 4,
           "stall_s": stall, "commit_s": commit,
           "ckpt_bytes": int(manifest.stats["bytes"]),
           "write_s": write,
           "files": len(manifest.files)}
    out["write_MBps_per_rank"] = out["ckpt_bytes"] / n / 1e6 / max(out["write_s"], 1e-9)
    out["restore_s"] = repeated_timed(topo, lambda: trainer.restorer.restore(latest=True), args)
    lost = Loss.of_ranks([n - 1], at, model.plan)
    pls = PLSAccount(total_samples=batch * 10 ** 6)
    partial = PartialRecovery(ckpt, trainer.restorer, model, pls, batch, lambda line: None)
    out["partial_s"] = repeated_timed(topo, lambda: partial.recover(lost), args)
    out["lost_rows"] = model.plan.local_rows(n - 1)
    if trainer.parity is not None:
        guard = trainer.parity
        out["parity_upkeep_s"] = slow["update_hooks"]

        def rebuild():
            guard.fail([n - 1])
            guard.start_rebuild([n - 1], at)
            guard.settle()
        out["rebuild_s"] = repeated_timed(topo, rebuild, args)
    trainer.close()
    ckpt.close()
    return out


def measure_machine(topo, args, root: str) -> dict:
    """Machine parameters at this size, every rank at once. Collective."""
    import numpy as np
    import torch
    import torch.distributed as dist

    n, mb = topo.world_size, args.io_mb
    src = torch.ones(mb * 2 ** 18)  # mb MB of float32
    dst = torch.empty_like(src)
    copy = timed(topo, lambda: [dst.copy_(src) for _ in range(5)]) / 5
    path = os.path.join(root, f"io-{topo.rank}.bin")
    blob = np.ones(mb * 2 ** 20, dtype=np.uint8)

    def write():
        with open(path, "wb") as f:
            f.write(blob.tobytes())
            f.flush()
            os.fsync(f.fileno())
    io = timed(topo, write)

    def creates():
        for i in range(20):
            p = os.path.join(root, f"meta-{topo.rank}-{i}")
            open(p, "wb").close()
            os.unlink(p)
    meta = timed(topo, creates) / 20
    out = {"ranks": n, "memcpy_GBps_per_rank": mb / 1e3 * 1.048576 / copy,
           "write_MBps_per_rank": mb * 1.048576 / io, "create_s": meta}
    if n >= 2:
        small, big = torch.ones(n * 2), torch.ones(n * 2 ** 18 // n * n)
        outs = (torch.empty_like(small), torch.empty_like(big))
        for name, op in (("alltoall", lambda t, o: dist.all_to_all_single(o, t)),
                         ("allreduce", lambda t, o: dist.all_reduce(t))):
            op(small, outs[0])
            lat = timed(topo, lambda: [op(small, outs[0]) for _ in range(20)]) / 20
            bw = timed(topo, lambda: [op(big, outs[1]) for _ in range(5)]) / 5
            out[f"{name}_latency_s"] = lat
            out[f"{name}_4MB_s"] = bw
    return out


def worker(args) -> None:
    """One rank of a sweep job: every mode, then the machine; rank 0 appends the points."""
    from mpi4py import MPI

    from mpickpt.topology import Topology

    world = MPI.COMM_WORLD
    if args.expect_ranks and world.Get_size() != args.expect_ranks:
        if world.Get_rank() == 0:
            print(f"scaling: expected {args.expect_ranks} ranks in one job, this job has "
                  f"{world.Get_size()}: under srun, pass the MPI plugin your MPI speaks "
                  f"(--mpi=pmi2 for MPICH; without it srun starts independent 1-rank jobs)",
                  file=sys.stderr, flush=True)
        world.Abort(2)
    topo = Topology.from_mpi(world.Dup(), backend="gloo")
    root = topo.control.bcast(tempfile.mkdtemp(prefix="mpickpt-scaling-", dir=args.scratch)
                              if topo.is_root else None)
    try:
        points = [measure_mode(topo, m, args, root) for m in args.modes.split(",")]
        machine = measure_machine(topo, args, root)
    finally:
        topo.control.Barrier()
        if topo.is_root:
            shutil.rmtree(root, ignore_errors=True)
    if topo.is_root:
        cores = os.cpu_count() or 1
        for p in points:
            p.update(machine=machine, host=args.host, cores=cores,
                     oversubscribed=topo.world_size > cores * args.nodes, quick=args.quick,
                     launcher=args.launcher, nodes=args.nodes, date=time.strftime("%Y-%m-%d"),
                     repeat=args.repeat, aggregate=args.aggregate)
        append(Path(args.out), points)
    topo.close()


def append(path: Path, points: list[dict]) -> None:
    """Replace this host's points of the same (mode, ranks) and keep all others; under a lock,
    so that jobs of an array can share the file. Local."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = json.loads(path.read_text()) if path.exists() else {"format": "mpickpt-scaling-1",
                                                                     "points": []}
        keys = {(p["host"], p["mode"], p["ranks"], p["quick"]) for p in points}
        doc["points"] = [p for p in doc["points"]
                         if (p["host"], p["mode"], p["ranks"], p.get("quick")) not in keys]
        doc["points"] = sorted(doc["points"] + points,
                               key=lambda p: (p["host"], p["mode"], p["ranks"]))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)


# ---- the sweep (driver) ------------------------------------------------------------------------
def launch(n: int, args) -> None:
    """One job of `n` ranks running this file's worker."""
    if args.launcher == "srun":
        cmd = ["srun", f"--mpi={args.srun_mpi}", "-n", str(n)]
    else:
        cmd = [mpiexec_path(), "-n", str(n)]
    cmd += [sys.executable, __file__, "--worker", "--expect-ranks", str(n), *worker_flags(args)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        sys.exit(f"scaling: the {n}-rank job failed (exit {proc.returncode}):\n"
                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {n} ranks: {time.perf_counter() - started:.0f} s", flush=True)


def mpiexec_path() -> str:
    from mpickpt.mpiexec import mpiexec
    return mpiexec()


def worker_flags(args) -> list[str]:
    keep = ("modes", "batch", "weak_scale_down", "strong_scale_down", "strong_ranks", "steps",
            "warmup", "io_mb", "repeat", "aggregate", "out", "host", "launcher", "nodes")
    flags = [f for k in keep for f in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    return flags + (["--quick"] if args.quick else []) + \
        (["--scratch", args.scratch] if args.scratch else [])


def table(points: list[dict]) -> list[str]:
    """The sweep as text lines (milliseconds, MB, MB/s). Local."""
    head = (f"{'mode':<6} {'ranks':>5} {'step':>7} {'a2a':>6} {'allred':>6} {'samples/s':>9} "
            f"{'stall':>6} {'MB/rank':>7} {'MB/s/rk':>7} {'commit':>7} {'restore':>7} "
            f"{'partial':>7} {'upkeep':>6} {'rebuild':>7}")
    lines = [head, "-" * len(head)]
    for p in points:
        ms = lambda k: f"{p[k] * 1e3:.1f}" if k in p else "-"  # noqa: E731
        lines.append(
            f"{p['mode']:<6} {p['ranks']:>4}{'*' if p.get('oversubscribed') else ' '} "
            f"{p['step_s'] * 1e3:7.1f} {p['phases_s']['alltoall'] * 1e3:6.1f} "
            f"{p['phases_s']['allreduce'] * 1e3:6.1f} {p['samples_per_s']:9.0f} "
            f"{ms('stall_s'):>6} {p['ckpt_bytes'] / p['ranks'] / 1e6:7.1f} "
            f"{p['write_MBps_per_rank']:7.0f} {ms('commit_s'):>7} {ms('restore_s'):>7} "
            f"{ms('partial_s'):>7} {ms('parity_upkeep_s'):>6} {ms('rebuild_s'):>7}")
    lines.append("times in ms per step or per event, slowest rank; * = more ranks than cores "
                 "(oversubscribed)")
    return lines


def plot(points: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("step_s", "step"), ("stall_s", "checkpoint stall"), ("commit_s", "commit latency"),
            ("restore_s", "restore"), ("partial_s", "partial recovery"),
            ("rebuild_s", "parity rebuild")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, mode in zip(axes, ("weak", "strong")):
        ps = [p for p in points if p["mode"] == mode]
        for key, label in keys:
            xs = [p["ranks"] for p in ps if key in p]
            ax.plot(xs, [p[key] * 1e3 for p in ps if key in p], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="ranks", title=f"{mode} scaling")
        ax.set_xticks(sorted({p["ranks"] for p in ps}), labels=sorted({p["ranks"] for p in ps}))
    axes[0].set_ylabel("ms (slowest rank)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4,8", help="job sizes, comma-separated")
    p.add_argument("--modes", default="weak,strong")
    p.add_argument("--batch", type=int, default=256, help="mini-batch per rank (weak scaling)")
    p.add_argument("--weak-scale-down", type=int, default=800,
                   help="Kaggle tables / this at 1 rank; / (this / N) at N ranks")
    p.add_argument("--strong-scale-down", type=int, default=100)
    p.add_argument("--strong-ranks", type=int, default=4,
                   help="strong scaling's global batch is --batch x this")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeat", type=int, default=5,
                   help="checkpoints, restores and recoveries per point")
    p.add_argument("--aggregate", choices=("median", "min"), default="min",
                   help="how the repeats make the point (min: interference only adds time)")
    p.add_argument("--io-mb", type=int, default=64, help="MB per rank of the I/O microbenchmark")
    p.add_argument("--launcher", choices=("mpiexec", "srun"), default="mpiexec")
    p.add_argument("--srun-mpi", default="pmi2",
                   help="srun's MPI plugin (--launcher srun): pmi2 for MPICH, pmix for Open MPI")
    p.add_argument("--nodes", type=int, default=1, help="nodes the ranks run on")
    p.add_argument("--expect-ranks", type=int, default=0,
                   help="worker: stop unless the job has this many ranks")
    p.add_argument("--host", default=os.environ.get("MPICKPT_HOST_CLASS", "local"),
                   help="host class the points belong to (the cost model's preset name)")
    p.add_argument("--scratch", default=None, help="checkpoint directory's parent (shared FS)")
    p.add_argument("--out", default=str(RESULTS / "scaling.json"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--quick", action="store_true", help="a tiny model and few steps (CI)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.weak_scale_down, args.strong_scale_down = 20000, 10000
        args.steps, args.warmup, args.io_mb, args.batch = 5, 1, 4, 64
        args.repeat = 1
    return args


def main(argv=None) -> None:
    args = parse(argv)
    if args.worker:
        return worker(args)
    sizes = [int(n) for n in args.ranks.split(",")]
    print(f"scaling sweep at {sizes} ranks, modes {args.modes}, {os.cpu_count()} cores",
          flush=True)
    for n in sizes:
        launch(n, args)
    doc = json.loads(Path(args.out).read_text())
    mine = [p for p in doc["points"] if p["host"] == args.host and p["quick"] == args.quick
            and p["ranks"] in sizes]
    print("\n".join(table(mine)))
    if not args.quick:
        plot(mine, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} ({len(doc['points'])} points)")


if __name__ == "__main__":
    main()
