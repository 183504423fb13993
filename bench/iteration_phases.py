"""Where does a training iteration's time go? Phase split at 1, 2 and 4 ranks.

    python bench/iteration_phases.py --ranks 1,2,4 --num-batches 200

Launches one `mpiexec -n N` job per world size (each job runs this file with --worker), times the
phases of every step after a warm-up (route, all-to-all, lookup, dense, allreduce, optimizer, data),
and prints a table of milliseconds per step (mean over ranks; max over ranks in the JSON). Writes
bench/results/iteration_phases.json. Same global batch at every world size (weak in model, strong in
data): samples/s is comparable across rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from mpickpt.mpiexec import mpiexec

HERE = Path(__file__).resolve().parent
PHASES = ("route", "alltoall", "lookup", "dense", "allreduce", "optimizer", "data")
MODEL_FLAGS = ["--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down", "100",
               "--arch-sparse-feature-size", "16", "--arch-mlp-bot", "13-128-64-16",
               "--arch-mlp-top", "128-64-1", "--test-num-batches", "0", "--print-freq", "0"]


def worker(args) -> None:
    """One rank of a timed job. Collective."""
    from mpi4py import MPI

    from mpickpt.topology import Topology
    from mpickpt.train_flags import TrainConfig
    from mpickpt.trainer import Trainer

    flags = MODEL_FLAGS + ["--mini-batch-size", str(args.batch), "--num-batches",
                           str(args.num_batches + args.warmup), "--phase-times"]
    config = TrainConfig.from_args(flags)
    topo = Topology.from_mpi(MPI.COMM_WORLD, backend=args.backend)
    trainer = Trainer(topo, config)
    model, timer = trainer.model, trainer.timer
    for _ in range(args.warmup):
        model.train_step(trainer.reader.next())
    timer.reset()
    topo.barrier()
    start = time.perf_counter()
    for _ in range(args.num_batches):
        with timer.phase("data"):
            batch = trainer.reader.next()
        model.train_step(batch)
    topo.barrier()
    elapsed = time.perf_counter() - start
    per_step = {p: timer.totals.get(p, 0.0) / args.num_batches * 1e3 for p in PHASES}
    rows = topo.control.gather(per_step, root=0)
    if topo.is_root:
        result = {"world_size": topo.world_size, "backend": topo.backend,
                  "global_batch": args.batch, "steps": args.num_batches,
                  "step_ms": elapsed / args.num_batches * 1e3,
                  "samples_per_s": args.batch * args.num_batches / elapsed,
                  "phase_ms_mean": {p: sum(r[p] for r in rows) / len(rows) for p in PHASES},
                  "phase_ms_max": {p: max(r[p] for r in rows) for p in PHASES},
                  "local_rows": model.plan.local_rows(0)}
        Path(args.out).write_text(json.dumps(result))
    trainer.close()
    topo.close()


def launch(n: int, args) -> dict:
    out = HERE / "results" / f".phases-{n}.tmp"
    cmd = [mpiexec(), "-n", str(n), sys.executable, __file__, "--worker", "--out", str(out),
           "--batch", str(args.batch), "--num-batches", str(args.num_batches),
           "--warmup", str(args.warmup), "--backend", args.backend]
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // n)))
    subprocess.run(cmd, check=True, env=env)
    result = json.loads(out.read_text())
    out.unlink()
    return result


def print_table(results) -> None:
    head = f"{'ranks':>5} {'step ms':>8} {'samples/s':>10} " + " ".join(f"{p:>9}" for p in PHASES)
    print(head)
    print("-" * len(head))
    for r in results:
        phases = " ".join(f"{r['phase_ms_mean'][p]:9.2f}" for p in PHASES)
        print(f"{r['world_size']:>5} {r['step_ms']:8.2f} {r['samples_per_s']:10.0f} {phases}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--batch", type=int, default=1024, help="global mini-batch")
    p.add_argument("--num-batches", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--backend", default="auto")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE / "results" / "iteration_phases.json"))
    args = p.parse_args()
    if args.worker:
        return worker(args)
    results = [launch(int(n), args) for n in args.ranks.split(",")]
    print_table(results)
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv), "results": results}
    Path(args.out).write_text(json.dumps(meta, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
