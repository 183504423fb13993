"""Range-search throughput on a GPU (kernels/quant_rows.cu) against the CPU kernel and FBGEMM.

    python bench/quant_gpu.py --rows 2000000 --out bench/results/quant_gpu_h100.json

Same random-normal rows for all; GPU time includes the copy of the rows to the device and of the
parameters back (rows already on the GPU, as in a GPU-resident snapshot, are also timed alone).
Prints a table and writes JSON. Needs CuPy and a GPU.
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
from mpickpt.quant import cuda_kernels, search as rs  # noqa: E402


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not cuda_kernels.available():
        raise SystemExit("needs CuPy and a CUDA GPU")
    import cupy

    x = np.random.default_rng(0).standard_normal((args.rows, args.dim)).astype(np.float32)
    on_gpu = cupy.asarray(x)
    threads = os.cpu_count() or 1
    small = x[:100_000]
    rows = []
    for bits in (2, 4):
        cuda_kernels.search_rows_cuda(on_gpu[:1000], bits)  # compile and warm up
        host = best_of(lambda: cuda_kernels.search_rows_cuda(x, bits), args.repeats)
        resident = best_of(lambda: cuda_kernels.search_rows_cuda(on_gpu, bits), args.repeats)
        cpu = best_of(lambda: rs.search(x, bits, threads=threads, backend="c"), 1)
        prepack = {2: torch.ops.quantized.embedding_bag_2bit_prepack,
                   4: torch.ops.quantized.embedding_bag_4bit_prepack}[bits]
        fbgemm = best_of(lambda: prepack(torch.from_numpy(small), True), 1)
        s, o = cuda_kernels.search_rows_cuda(on_gpu[:100_000], bits)
        loss = float(np.sqrt(rs.row_loss(small, s, o, bits)).mean())
        row = {"bits": bits, "gpu_rows_per_s_from_host": args.rows / host,
               "gpu_rows_per_s_resident": args.rows / resident,
               "cpu_kernel_rows_per_s": args.rows / cpu, "cpu_threads": threads,
               "fbgemm_greedy_rows_per_s": len(small) / fbgemm, "mean_l2_loss": loss}
        rows.append(row)
        print(f"{bits} bits: GPU {row['gpu_rows_per_s_resident'] / 1e6:.1f} M rows/s resident, "
              f"{row['gpu_rows_per_s_from_host'] / 1e6:.1f} M rows/s with copies; CPU kernel "
              f"({threads} threads) {row['cpu_kernel_rows_per_s'] / 1e6:.2f} M rows/s; FBGEMM "
              f"greedy {row['fbgemm_greedy_rows_per_s'] / 1e3:.0f} k rows/s; loss {loss:.4f}",
              flush=True)
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    result = {"device": name.decode() if isinstance(name, bytes) else str(name),
              "rows": args.rows, "dim": args.dim, "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
