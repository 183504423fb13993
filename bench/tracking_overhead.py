"""Row-tracking overhead as a share of iteration time (target: <= 1%), and the upkeep of the
prioritized-save trackers (CPR-MFU, CPR-SSU: the simulator's priority upkeep; SCAR).

    python bench/tracking_overhead.py --steps 300

Single process (MPI singleton), 26 Criteo Kaggle tables / 100, D=16, global batch 2048. Alternates
blocks of steps with and without the bit-vector attached, so drift in machine load affects both
equally, and also times the marking calls alone. Then times the MFU, SSU and SCAR trackers'
updates at the owner's count hook alone (r = 0.125), with their memory (CPR Table 1). Writes
bench/results/tracking_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mpickpt.data.position import SyntheticPosition
from mpickpt.topology import Topology
from mpickpt.track.bitvector import RowBitVector
from mpickpt.train_flags import TrainConfig
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream

OUT = Path(__file__).resolve().parent / "results" / "tracking_overhead.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--block", type=int, default=25)
    p.add_argument("--backend", choices=("gloo", "nccl", "auto"), default="gloo",
                   help="nccl puts the model and the bit-vector on the GPU (CuPy kernels)")
    p.add_argument("--scale-down", type=int, default=100, help="Criteo Kaggle table sizes / this")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    cfg = TrainConfig.from_args(["--arch-embedding-size", "criteo-kaggle", "--embedding-scale-down",
                                 str(args.scale_down), "--mini-batch-size", "2048", "--arch-mlp-bot", "13-64-16"])
    topo = Topology.from_mpi(backend=args.backend)
    cuda = topo.device.type == "cuda"
    model = HybridDLRM(topo, cfg.arch, cfg.table_sizes, cfg.optim, 0, cfg.plan_options)
    stream = SyntheticStream(SyntheticConfig(table_sizes=cfg.table_sizes))
    batches = [stream.read_slice(SyntheticPosition(sample_index=i * 2048), 2048, 0, 1)[0]
               for i in range(args.block)]
    tracker = RowBitVector(model.plan.local_rows(0), device=topo.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mark_time = [0.0]

    kernel_events = []

    def timed_mark(rows):
        # the training thread pays the call (on CUDA: the launch; the kernel runs on a side stream
        # overlapping the all-to-all, timed separately with CUDA events)
        t = time.perf_counter()
        if cuda:
            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
            side = tracker._kernels.stream
            side.wait_stream(torch.cuda.current_stream())  # so the events time the kernel alone
            start_ev.record(side)
        tracker.mark(rows, sorted_unique=True)
        if cuda:
            end_ev.record(side)
            kernel_events.append((start_ev, end_ev))
        mark_time[0] += time.perf_counter() - t

    for warm in (False, True):  # warm-up: first-use costs (allocator, kernels) in neither mode
        remove = model.embeddings.add_index_hook(timed_mark) if warm else None
        for batch in batches[:5]:
            model.train_step(batch)
        if remove:
            remove()
    sync()
    mark_time[0], kernel_events[:] = 0.0, []

    totals = {"off": 0.0, "on": 0.0}
    for b in range(2 * (args.steps // args.block)):
        mode = "on" if b % 2 else "off"
        remove = model.embeddings.add_index_hook(timed_mark) if mode == "on" else None
        sync()
        start = time.perf_counter()
        for batch in batches:
            model.train_step(batch)
        sync()
        totals[mode] += time.perf_counter() - start
        if remove:
            remove()
    steps = args.steps // args.block * args.block
    result = {"steps_each": steps, "step_ms_off": totals["off"] / steps * 1e3,
              "step_ms_on": totals["on"] / steps * 1e3, "mark_ms": mark_time[0] / steps * 1e3,
              "rows": model.plan.local_rows(0), "bitvector_bytes": tracker.nbytes,
              "device": torch.cuda.get_device_name() if cuda else "cpu", "backend": topo.backend}
    if cuda:
        result["kernel_ms"] = sum(a.elapsed_time(b) for a, b in kernel_events) / steps
    result["overhead_pct_wall"] = (result["step_ms_on"] / result["step_ms_off"] - 1) * 100
    result["overhead_pct_mark"] = result["mark_ms"] / result["step_ms_off"] * 100
    result["priority"] = priority_upkeep(model, batches, steps, sync, result["step_ms_off"])
    print(f"step {result['step_ms_off']:.2f} ms untracked, {result['step_ms_on']:.2f} ms tracked; "
          f"marking {result['mark_ms']:.3f} ms/step = {result['overhead_pct_mark']:.2f}% "
          f"(target <= 1%); wall difference {result['overhead_pct_wall']:+.2f}%; "
          f"{result['bitvector_bytes']} bytes of bits for {result['rows']} rows"
          + (f"; kernel {result['kernel_ms'] * 1e3:.1f} us/step on the side stream" if cuda else ""))
    for rule, r in result["priority"].items():
        print(f"{rule}: {r['observe_ms']:.3f} ms/step = {r['upkeep_pct']:.2f}% of a step, "
              f"{r['bytes']} bytes ({r['bytes'] / result['rows']:.3f} per row)")
    Path(args.out).write_text(json.dumps(result, indent=2))
    topo.close()


def priority_upkeep(model, batches, steps: int, sync, step_ms: float) -> dict:
    """Per-step time of the CPR-MFU, CPR-SSU and SCAR trackers' updates at the owner's count hook
    (the training thread pays them), as a share of the untracked step, and their memory. Local."""
    from mpickpt.track.priority import make_tracker, shard_ranges

    emb = model.embeddings
    ranges = shard_ranges(model.plan, emb.topo.rank)
    out = {}
    for rule in ("mfu", "ssu", "scar"):
        tracker = make_tracker(rule, len(emb.local_gids), ranges, emb.device, 0.125,
                               weight=emb.weight, seed=0)
        spent = [0.0]

        def observe(rows, counts):
            t = time.perf_counter()
            tracker.observe(rows, counts)
            sync()
            spent[0] += time.perf_counter() - t
        remove = emb.add_count_hook(observe)
        for n in range(steps):
            if n == 5:
                spent[0] = 0.0  # warm-up
            model.train_step(batches[n % len(batches)])
        remove()
        ms = spent[0] / (steps - 5) * 1e3
        out[rule] = {"observe_ms": ms, "upkeep_pct": ms / step_ms * 100,
                     "bytes": tracker.nbytes}
    return out


if __name__ == "__main__":
    main()
