"""mpickpt against torch DCP on the same TorchRec model: stall, bytes written, time lost and
restore time per checkpoint (issue 22's benchmark).

    python bench/torchrec.py --ranks 2 --checkpoints 10 --dir /tmp/mpickpt-bench-torchrec

Launches one `mpiexec -n N` job (this file with --worker). Every rank builds the same
`--model torchrec` model the trainer builds (torchrec's DLRM under DistributedModelParallel,
fused row-wise Adagrad, table-wise; 26 Criteo Kaggle tables / --scale-down, D = --dim) and
trains it on the synthetic Zipf stream with a global batch of --batch. Each mode then runs
--checkpoints intervals of --interval steps on the same model, in one process, on one disk:

- none: no checkpoint (the step time every other mode is compared with; measured before and
  after the other modes, the mean is used);
- mpickpt full: CheckpointManager, every row in fp32, each interval;
- mpickpt incrcp 4-bit: CheckpointManager with `--ckpt-kind incrcp --ckpt-bits 4` (baselines
  when its cost model says so, else the rows touched since the last checkpoint);
- DCP: `torch.distributed.checkpoint.async_save` of what TorchRec users save
  ({"model": dmp.state_dict(), "fused_optimizer": dmp.fused_optimizer.state_dict()}) each
  interval, waiting for the previous save before the next one (as its docs ask).

Per mode: *stall* is the wall time the training loop spent in the checkpoint call (slowest rank,
median over checkpoints; DCP: the wait for the previous save plus `async_save` itself); *bytes* the
bytes the checkpoints wrote, per checkpoint (mpickpt: the manifests' payload; DCP: its files);
*lost* the loop's wall time minus that of as many steps without checkpoints, per checkpoint; *restore*
the time to load the newest checkpoint back into the model (mpickpt: `Restorer.restore()`; DCP:
`dcp.load` plus the fused optimizer's `load_state_dict`), slowest rank, the median of --restores
loads, each with the page cache dropped first where allowed.

Targets (issue 22): stall at most 1/3 of DCP's; bytes of incrcp 4-bit at most 1/10 of DCP's;
restore of the newest checkpoint no slower than DCP's. Prints a table with the ratios, writes
bench/results/torchrec.json and torchrec.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# run as a script, this file's directory comes first on sys.path and its name would shadow the
# torchrec package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

from mpickpt.engine.config import IO_MODES  # noqa: E402
from mpickpt.mpiexec import mpiexec  # noqa: E402
TARGET_STALL = 1 / 3
TARGET_BYTES = 1 / 10
MODES = {"full": ("--ckpt-kind", "full"),
         "incrcp-4bit": ("--ckpt-kind", "incrcp", "--ckpt-bits", "4")}


# ---- worker side --------------------------------------------------------------------------
class BenchReader:
    """The synthetic stream as the checkpoint manager sees a reader (`state`, `allow`)."""

    def __init__(self, stream, topo, batch: int):
        from mpickpt.data.position import SyntheticPosition

        self.stream, self.topo, self.batch = stream, topo, batch
        self.position = SyntheticPosition()

    def next(self):
        batch, self.position = self.stream.read_slice(self.position, self.batch, self.topo.rank,
                                                      self.topo.world_size)
        return batch

    def state(self):
        return self.position

    def allow(self, n: int) -> None:
        pass


def train_flags(args) -> list[str]:
    return ["--model", "torchrec", "--arch-embedding-size", "criteo-kaggle",
            "--embedding-scale-down", str(args.scale_down),
            "--arch-sparse-feature-size", str(args.dim), "--arch-mlp-bot", f"13-64-{args.dim}",
            "--arch-mlp-top", "64-1", "--mini-batch-size", str(args.batch)]


def drop_caches() -> bool:
    """Drop the page cache (root only); True if it was. Local."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def slowest(topo, seconds: float) -> float:
    return max(topo.control.allgather(seconds))


def run_steps(topo, model, reader, steps: int) -> float:
    """Wall time of `steps` training steps (collective)."""
    topo.control.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        model.train_step(reader.next())
    return slowest(topo, time.perf_counter() - start)


def measure_mpickpt(topo, model, reader, args, mode: str, root: str, log) -> dict:
    """K intervals with CheckpointManager of `mode`; then a restore of the newest. Collective."""
    from mpickpt.engine.manager import CheckpointManager
    from mpickpt.engine.restorer import Restorer
    from mpickpt.store.manifest import list_manifests
    from mpickpt.train_flags import TrainConfig

    cfg = TrainConfig.from_args(train_flags(args) + [
        "--ckpt-dir", root, "--ckpt-interval", str(args.interval), "--ckpt-keep", "1000",
        "--resume", "none", "--ckpt-io", args.ckpt_io, *MODES[mode]]).checkpoint
    mgr = CheckpointManager(topo, cfg, model, log)
    mgr.resumed_at(0)
    stalls, total = [], args.checkpoints * args.interval
    topo.control.Barrier()
    start = time.perf_counter()
    for step in range(1, total + 1):
        model.train_step(reader.next())
        t = time.perf_counter()
        mgr.after_step(step, reader, total)
        if step % args.interval == 0:
            stalls.append(time.perf_counter() - t)
    wall = slowest(topo, time.perf_counter() - start)
    t = time.perf_counter()
    mgr.close()
    drain = slowest(topo, time.perf_counter() - t)
    stalls = [max(x) for x in zip(*topo.control.allgather(stalls))]
    manifests = list_manifests(root) if topo.is_root else []
    written = [int(m.stats.get("bytes", 0)) for m in manifests]
    kinds = sorted({m.kind for m in manifests})
    restored = []
    restores, cold = timed_restores(topo, args.restores, lambda: restored.append(
        Restorer(topo, root, model, log, "latest").restore()))
    return {"stall_s": stalls, "wall_s": wall, "drain_s": drain, "bytes": written,
            "kinds": kinds, "restore_s": restores, "restored_step": restored[-1].step,
            "cold_restore": cold}


def timed_restores(topo, n: int, load) -> tuple[list[float], bool]:
    """Seconds of `load()` on the slowest rank, `n` times, each from a page cache dropped first
    where it can be; and whether it could. Collective."""
    seconds, cold = [], False
    for _ in range(n):
        cold = drop_caches() if topo.is_root else False
        topo.control.Barrier()
        t = time.perf_counter()
        load()
        seconds.append(slowest(topo, time.perf_counter() - t))
    return seconds, bool(topo.control.bcast(cold, root=0))


def dcp_stager():
    """DCP's fastest stager that takes ShardedTensors (torch 2.13's default stager calls
    data_ptr() on them and fails): the blocking one, its CPU copy cached across saves in pinned
    memory where CUDA is (the cache pins, which fails without an accelerator)."""
    import torch
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=torch.cuda.is_available())


def measure_dcp(topo, model, reader, args, root: str) -> dict:
    """K intervals with DCP async_save; then dcp.load of the newest. Collective."""
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    def state():
        return {"model": model.dmp.state_dict(),
                "fused_optimizer": model.dmp.fused_optimizer.state_dict()}

    def finish(response):
        if response is None:
            return
        if isinstance(response, Future):
            response.result()
        else:
            response.staging_completion.result()
            response.upload_completion.result()

    stalls, sizes, pending, total = [], [], None, args.checkpoints * args.interval
    stager = dcp_stager()
    group = topo.side_group("dcp")  # its background thread's collectives beside training's
    topo.control.Barrier()
    start = time.perf_counter()
    for step in range(1, total + 1):
        model.train_step(reader.next())
        if step % args.interval == 0:
            t = time.perf_counter()
            finish(pending)
            pending = dcp.async_save(state(), checkpoint_id=os.path.join(root, f"step-{step}"),
                                     process_group=group, async_stager=stager)
            stalls.append(time.perf_counter() - t)
    wall = slowest(topo, time.perf_counter() - start)
    t = time.perf_counter()
    finish(pending)
    stager.close()
    drain = slowest(topo, time.perf_counter() - t)
    topo.control.Barrier()
    stalls = [max(x) for x in zip(*topo.control.allgather(stalls))]
    if topo.is_root:
        for d in sorted(Path(root).iterdir()):
            sizes.append(sum(f.stat().st_size for f in d.rglob("*") if f.is_file()))

    def load():
        target = state()
        dcp.load(target, checkpoint_id=os.path.join(root, f"step-{total}"), process_group=group)
        model.dmp.fused_optimizer.load_state_dict(target["fused_optimizer"])
    restores, cold = timed_restores(topo, args.restores, load)
    return {"stall_s": stalls, "wall_s": wall, "drain_s": drain, "bytes": sizes,
            "restore_s": restores, "restored_step": total, "cold_restore": cold}


def worker(args) -> None:
    from mpi4py import MPI

    from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
    from mpickpt.model.torchrec_dlrm import build_torchrec_dlrm
    from mpickpt.topology import Topology
    from mpickpt.train_flags import TrainConfig

    topo = Topology.from_mpi(MPI.COMM_WORLD, backend="gloo")
    config = TrainConfig.from_args(train_flags(args))
    model = build_torchrec_dlrm(topo, config)
    stream = SyntheticStream(SyntheticConfig(table_sizes=config.table_sizes, seed=0))
    reader = BenchReader(stream, topo, args.batch)
    lines: list[str] = []
    run_steps(topo, model, reader, 5)  # warm-up
    steps = args.checkpoints * args.interval
    out = {"ranks": topo.world_size, "rows": sum(config.table_sizes), "dim": args.dim,
           "state_MB_per_rank": sum(t.numel() * 4 for t in model.row_state().values()) / 1e6,
           "baseline_s": [run_steps(topo, model, reader, steps)], "modes": {}}
    root = os.path.join(args.dir, "run")
    for mode in ("full", "incrcp-4bit", "dcp"):
        path = os.path.join(root, mode)
        if topo.is_root:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        topo.control.Barrier()
        out["modes"][mode] = measure_dcp(topo, model, reader, args, path) if mode == "dcp" \
            else measure_mpickpt(topo, model, reader, args, mode, path, lines.append)
        if topo.is_root:
            shutil.rmtree(path, ignore_errors=True)
            print(f"bench: {mode} done", flush=True)
    out["baseline_s"].append(run_steps(topo, model, reader, steps))
    if topo.is_root:
        out["log"] = lines[-20:]
        Path(args.out).write_text(json.dumps(out, indent=1))
    topo.close()


# ---- launcher side ------------------------------------------------------------------------
def med(values) -> float:
    values = list(values)
    return float(statistics.median(values)) if values else float("nan")


def summarize(raw: dict, checkpoints: int) -> list[dict]:
    base = statistics.mean(raw["baseline_s"])
    rows = []
    for mode, r in raw["modes"].items():
        rows.append({"mode": mode, "stall_ms": med(r["stall_s"]) * 1e3,
                     "MB_per_ckpt": statistics.mean(r["bytes"]) / 1e6 if r["bytes"] else 0.0,
                     "lost_ms_per_ckpt": (r["wall_s"] - base) / checkpoints * 1e3,
                     "drain_s": r["drain_s"], "restore_s": med(r["restore_s"]),
                     "restores_s": r["restore_s"],
                     "kinds": r.get("kinds", [])})
    dcp = next(x for x in rows if x["mode"] == "dcp")
    for x in rows:
        x["stall_vs_dcp"] = x["stall_ms"] / dcp["stall_ms"]
        x["bytes_vs_dcp"] = x["MB_per_ckpt"] / dcp["MB_per_ckpt"]
        x["restore_vs_dcp"] = x["restore_s"] / dcp["restore_s"]
    return rows


def print_table(raw: dict, rows: list[dict]) -> None:
    print(f"\n{raw['ranks']} ranks, {raw['rows']:,} rows, D={raw['dim']}, "
          f"{raw['state_MB_per_rank']:.1f} MB of rows+optimizer state per rank; "
          f"baseline {statistics.mean(raw['baseline_s']):.2f} s per run of steps\n")
    print("| mode | stall ms | vs DCP (≤ 0.33) | MB / ckpt | vs DCP (incrcp-4bit ≤ 0.10) | "
          "lost ms / ckpt | restore s: median (range) | vs DCP (≤ 1) |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        print(f"| {x['mode']} | {x['stall_ms']:.1f} | {x['stall_vs_dcp']:.2f} | "
              f"{x['MB_per_ckpt']:.2f} | {x['bytes_vs_dcp']:.3f} | {x['lost_ms_per_ckpt']:.1f} | "
              f"{x['restore_s']:.3f} ({min(x['restores_s']):.3f}–{max(x['restores_s']):.3f}) | "
              f"{x['restore_vs_dcp']:.2f} |")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [x["mode"] for x in rows]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.4))
    for ax, key, label in zip(axes, ("stall_ms", "MB_per_ckpt", "lost_ms_per_ckpt", "restore_s"),
                              ("stall ms", "MB per checkpoint", "time lost ms / ckpt",
                               "restore s")):
        ax.bar(names, [x[key] for x in rows],
               color=["tab:blue", "tab:green", "tab:red"][:len(rows)])
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("TorchRec DMP: mpickpt vs DCP async_save")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--checkpoints", type=int, default=10)
    p.add_argument("--interval", type=int, default=2, help="steps between checkpoints")
    p.add_argument("--batch", type=int, default=2048, help="global batch")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--scale-down", type=int, default=100)
    p.add_argument("--restores", type=int, default=3,
                   help="restores of the newest checkpoint per mode, each from a cold page "
                        "cache; the median is reported")
    p.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "mpickpt-bench-torchrec"))
    p.add_argument("--ckpt-io", default="buffered", choices=IO_MODES,
                   help="mpickpt's --ckpt-io: buffered (default here) leaves its files in the "
                        "page cache for the restores, as DCP's are; direct makes its restores "
                        "read the disk while DCP's read memory")
    p.add_argument("--out", default=str(HERE / "results" / "torchrec.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    raw_path = Path(args.dir) / "raw.json"
    os.makedirs(args.dir, exist_ok=True)
    cmd = [mpiexec(), "-n", str(args.ranks), sys.executable, __file__, "--worker",
           "--out", str(raw_path), "--checkpoints", str(args.checkpoints), "--interval",
           str(args.interval), "--batch", str(args.batch), "--dim", str(args.dim),
           "--scale-down", str(args.scale_down), "--restores", str(args.restores),
           "--dir", args.dir]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    subprocess.run(cmd, check=True, env=env)
    raw = json.loads(raw_path.read_text())
    rows = summarize(raw, args.checkpoints)
    print_table(raw, rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args), "raw": raw,
                               "summary": rows}, indent=1))
    plot(rows, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
