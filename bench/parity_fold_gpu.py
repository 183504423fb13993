"""Parity fold throughput on a GPU (kernels/parity_fold.cu) against torch's own CUDA indexing and
the CPU kernel (kernels/parity_fold_cpu.c), through `StripeCode.fold`, the call training makes.

    python bench/parity_fold_gpu.py --out bench/results/parity_fold_h100.json

One fold is one step's upkeep on a rank: `rows` updated rows of `dim` float32 words folded into
a parity shard with repeated parity rows (several group members land on one stripe). Times are
best of `--repeats`, each ended by a device synchronize. Prints a table and writes JSON. Needs
CuPy and a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpickpt.parity import cuda_kernels, stripe_code  # noqa: E402
from mpickpt.parity.stripe_code import StripeCode  # noqa: E402


def best_of(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def case(rows: int, dim: int, parity_rows: int, repeats: int) -> dict:
    """One (rows, dim) point: the CuPy kernel, torch's CUDA indexing, the CPU kernel."""
    rng = np.random.default_rng(rows + dim)
    code = StripeCode(4, 1, "cpu")
    host = {"parity": torch.from_numpy(rng.integers(-2**31, 2**31, (parity_rows, dim), dtype=np.int64)
                                       .astype(np.int32)),
            "prow": torch.from_numpy(rng.integers(0, parity_rows, rows)),
            "coef": torch.from_numpy(code.matrix.reshape(-1)[rng.integers(0, code.matrix.size, rows)]),
            "delta": torch.from_numpy(rng.integers(-2**31, 2**31, (rows, dim), dtype=np.int64)
                                      .astype(np.int32))}
    dev = {k: v.cuda() for k, v in host.items()}
    gpu_code = StripeCode(4, 1, "cuda")
    sync = torch.cuda.synchronize

    def fold(c, t):
        return lambda: c.fold(t["parity"], t["prow"], t["coef"], t["delta"])

    fold(gpu_code, dev)()  # compile and warm up
    kernel = best_of(fold(gpu_code, dev), repeats, sync)
    saved, stripe_code._FOLD = stripe_code._FOLD, None  # torch's own CUDA indexing
    try:
        fold(gpu_code, dev)()
        torch_cuda = best_of(fold(gpu_code, dev), repeats, sync)
    finally:
        stripe_code._FOLD = saved
    cpu = best_of(fold(code, host), repeats, lambda: None)
    # the kernel's result against the CPU fold of the same deltas (one fold each from equal parity)
    check = host["parity"].clone()
    fold(code, {**host, "parity": check})()
    again = host["parity"].cuda()
    fold(gpu_code, {**dev, "parity": again})()
    nbytes = rows * dim * 4
    return {"rows": rows, "dim": dim, "delta_mb": nbytes / 1e6,
            "kernel_ms": kernel * 1e3, "torch_cuda_ms": torch_cuda * 1e3, "cpu_ms": cpu * 1e3,
            "kernel_gb_s": nbytes / kernel / 1e9, "torch_cuda_gb_s": nbytes / torch_cuda / 1e9,
            "cpu_gb_s": nbytes / cpu / 1e9, "kernel_vs_torch": torch_cuda / kernel,
            "kernel_vs_cpu": cpu / kernel,
            "equal_to_cpu": bool(torch.equal(again.cpu(), check))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="20000,200000,1000000", help="updated rows per fold")
    p.add_argument("--dims", default="16,64")
    p.add_argument("--parity-rows", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not (cuda_kernels.available() and torch.cuda.is_available()):
        raise SystemExit("needs CuPy and a CUDA GPU")
    results = []
    if stripe_code._cpu_fold() is None:
        print("the C fold (mpickpt._parity_cpu) is not built: the cpu column times torch's fold")
    print(f"{'rows':>8} {'D':>3} {'MB':>7} {'kernel ms':>10} {'torch ms':>9} {'cpu ms':>8} "
          f"{'kernel GB/s':>11} {'x torch':>8} {'x cpu':>7} {'equal':>6}")
    for dim in (int(d) for d in args.dims.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            r = case(rows, dim, args.parity_rows, args.repeats)
            results.append(r)
            print(f"{rows:>8} {dim:>3} {r['delta_mb']:>7.1f} {r['kernel_ms']:>10.3f} "
                  f"{r['torch_cuda_ms']:>9.3f} {r['cpu_ms']:>8.2f} {r['kernel_gb_s']:>11.1f} "
                  f"{r['kernel_vs_torch']:>8.1f} {r['kernel_vs_cpu']:>7.1f} {r['equal_to_cpu']!s:>6}",
                  flush=True)
    out = {"device": torch.cuda.get_device_name(), "cpu_threads": torch.get_num_threads(),
           "cpu_path": "C kernel" if stripe_code._cpu_fold() is not None else "torch (not built)",
           "parity_rows": args.parity_rows, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if all(r["equal_to_cpu"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
