"""Row codecs against FBGEMM: mean per-row L2 loss, encode rows/s and bytes per row.

    python bench/quant_codecs.py

Two matrices, every codec measured on the same rows in one run:

- ``random``: standard-normal rows, --rows x --dim (seeded);
- ``trained``: the embedding tables of a small synthetic DLRM trained in a subprocess
  (`python -m mpickpt.train` on 1 rank under mpiexec, one full checkpoint at the end, exported with
  `python -m mpickpt.cli export --with-optimizer`). Every row of the export is used as it is; rows
  that training never looked up keep their initial values. Those the optimizer touched (rowwise
  Adagrad sum > 0) are counted, and the L2 loss over them alone is reported too.

Codecs: asym, sym, adaptive (refined search, the default), adaptive with search="greedy" (Check-N-Run's
walk) and kmeans at 2, 3, 4 and 8 bits, plus fp16; FBGEMM through torch.ops.quantized:
``embedding_bag_{2,4}bit_prepack(w, optimized_qparams=False)`` (naive: [min, max]) and ``(w, True)``
(greedy: FBGEMM's own range search, 200 bins, ratio 0.16), and ``embedding_bag_byte_prepack`` at 8 bits,
decoded with the matching ``*_unpack``. FBGEMM's bytes per row is the prepacked row width.

Encode speed is the best of --repeats timed calls. Adaptive runs at 1 and 2 threads (search threads
and torch intra-op threads alike) and FBGEMM is timed at both torch thread counts, so each speed
ratio compares runs with the same thread count; the other codecs run at their defaults (search
threads 1, torch's default intra-op threads). The issue's targets, checked at 2 and 4 bits on both
matrices: adaptive L2 <= FBGEMM greedy L2 with bytes per row <= FBGEMM's, and encode rows/s >= 20x
FBGEMM greedy. Writes bench/results/quant_codecs.json and .png.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mpickpt.mpiexec import mpiexec
from mpickpt.quant.codecs import Codec
from mpickpt.quant.search import c_kernel

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
BITS = (2, 3, 4, 8)
UNIFORM = ("asym", "sym", "kmeans")
SEARCHES = ("refined", "greedy")
THREADS = (1, 2)
FBGEMM_BITS = (2, 4, 8)
TARGET_BITS = (2, 4)
TARGET_SPEEDUP = 20.0
TRAIN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Variant:
    """One way to store rows: an encoder, its decoder and its stored bytes per row. Local."""

    key: str
    family: str
    bits: int
    bytes_per_row: int
    encode: Callable[[np.ndarray], object]
    decode: Callable[[object], np.ndarray]
    threads: int | None = None
    """search threads; None where the variant has none (fp16, FBGEMM)."""
    torch_threads: int | None = None
    """torch intra-op threads while it runs; None: torch's default."""


# ----------------------------------------------------------------------------------- matrices

def random_matrix(rows: int, dim: int, seed: int) -> np.ndarray:
    """Standard-normal rows (rows, dim) float32. Local."""
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def run_checked(cmd: list[str], env: dict) -> str:
    """Run a command; its stdout, or RuntimeError with the tail of its output. Local."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TRAIN_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


def train_and_export(workdir: Path, args) -> tuple[Path, list[str]]:
    """Train a synthetic DLRM on 1 rank, checkpoint it at the end, export it to HDF5. Local.

    Returns the export's path and the two commands run."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ckpt, out = workdir / "ckpt", workdir / "model.h5"
    train = [mpiexec(), "-n", "1", sys.executable, "-m", "mpickpt.train",
             "--data-generation", "synthetic", "--arch-embedding-size", args.trained_tables,
             "--arch-sparse-feature-size", str(args.dim), "--arch-mlp-bot", f"13-64-{args.dim}",
             "--num-batches", str(args.trained_batches), "--mini-batch-size", "256",
             "--seed", str(args.seed), "--print-freq", "0", "--test-num-batches", "0",
             "--backend", "gloo", "--ckpt-dir", str(ckpt),
             "--ckpt-interval", str(args.trained_batches)]
    export = [sys.executable, "-m", "mpickpt.cli", "export", str(ckpt), "-o", str(out),
              "--with-optimizer"]
    run_checked(train, env)
    run_checked(export, env)
    return out, [" ".join(["mpiexec -n 1 python", *train[4:]]), " ".join(["python", *export[1:]])]


def read_export(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Every table's rows stacked (n, D), a mask of the rows training touched, and a summary. Local.

    A row counts as touched when its rowwise Adagrad sum is positive."""
    import h5py

    with h5py.File(path, "r") as f:
        names = sorted(f["embeddings"], key=lambda n: int(n.rsplit("_", 1)[1]))
        tables = [f["embeddings"][n][:] for n in names]
        touched = [f["optimizer"][n]["adagrad_sum"][:] > 0 for n in names]
        step = int(f.attrs["step"])
    per_table = {n: {"rows": int(len(w)), "touched": int(t.sum())}
                 for n, w, t in zip(names, tables, touched)}
    x, mask = np.concatenate(tables).astype(np.float32), np.concatenate(touched)
    info = {"step": step, "tables": per_table, "rows": int(len(x)), "touched": int(mask.sum()),
            "touched_fraction": float(mask.mean())}
    return x, mask, info


def trained_matrix(args) -> tuple[np.ndarray, np.ndarray, dict]:
    """The embedding rows of a freshly trained synthetic model (see the module docstring). Local."""
    with tempfile.TemporaryDirectory(prefix="mpickpt-quant-bench-") as tmp:
        start = time.perf_counter()
        path, commands = train_and_export(Path(tmp), args)
        x, mask, info = read_export(path)
    info.update(commands=commands, train_and_export_s=time.perf_counter() - start)
    return x, mask, info


# ----------------------------------------------------------------------------------- variants

def codec_variant(key: str, codec: Codec, dim: int, torch_threads: int | None = None) -> Variant:
    return Variant(key, codec.name if codec.name != "adaptive" else f"adaptive-{codec.search}",
                   codec.bits, codec.bytes_per_row(dim), codec.encode,
                   lambda arrays: codec.decode(arrays, dim),
                   threads=None if codec.name == "fp16" else codec.threads,
                   torch_threads=torch_threads)


def codec_variants(dim: int) -> list[Variant]:
    """fp16, asym/sym/kmeans at every width, adaptive (both searches) at 1 and 2 threads. Local."""
    out = [codec_variant("fp16", Codec("fp16", 16), dim)]
    for bits in BITS:
        out += [codec_variant(f"{name}-{bits}", Codec(name, bits), dim) for name in UNIFORM]
        out += [codec_variant(f"adaptive-{search}-{bits}-t{t}",
                              Codec("adaptive", bits, search=search, threads=t), dim,
                              torch_threads=t)
                for search in SEARCHES for t in THREADS]
    return out


def fbgemm_variant(bits: int, optimized: bool, dim: int, torch_threads: int) -> Variant:
    """FBGEMM's rowwise prepack at `bits` (naive or greedy qparams) and its unpack. Local."""
    q = torch.ops.quantized
    if bits == 8:
        family = "fbgemm-byte"
        encode = q.embedding_bag_byte_prepack
        decode = q.embedding_bag_byte_unpack
    else:
        family = f"fbgemm-{'greedy' if optimized else 'naive'}"
        prepack = getattr(q, f"embedding_bag_{bits}bit_prepack")
        encode = lambda w: prepack(w, optimized)  # noqa: E731
        decode = getattr(q, f"embedding_bag_{bits}bit_unpack")
    width = int(encode(torch.zeros(1, dim)).shape[1])
    return Variant(f"{family}-{bits}-t{torch_threads}", family, bits, width,
                   lambda x: encode(torch.from_numpy(x)),
                   lambda packed: decode(packed)[:, :dim].numpy(), torch_threads=torch_threads)


def fbgemm_variants(dim: int) -> list[Variant]:
    """FBGEMM naive and greedy at 2 and 4 bits, byte at 8, at every thread count. Local."""
    return [fbgemm_variant(bits, optimized, dim, t)
            for t in THREADS for bits in FBGEMM_BITS
            for optimized in ((False,) if bits == 8 else (False, True))]


# ----------------------------------------------------------------------------------- measuring

@contextlib.contextmanager
def torch_threads(n: int | None):
    """torch's intra-op thread count set to `n` within the block (None: leave it). Local."""
    saved = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def best_time(fn: Callable, x: np.ndarray, repeats: int) -> tuple[float, object]:
    """Best wall time of `repeats` calls fn(x), and the last call's result. Local."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn(x)
        best = min(best, time.perf_counter() - start)
    return best, out


def mean_l2(y: np.ndarray, x: np.ndarray, mask: np.ndarray | None = None) -> float:
    """Mean over rows of ||y - x||_2 (over the rows of `mask` only when given). Local."""
    norms = np.linalg.norm((y - x).astype(np.float64), axis=1)
    return float(norms[mask].mean() if mask is not None else norms.mean())


def measure(v: Variant, x: np.ndarray, mask: np.ndarray | None, repeats: int) -> dict:
    """L2 loss, encode time and rows/s of one variant on the rows `x`. Local."""
    with torch_threads(v.torch_threads):
        seconds, stored = best_time(v.encode, x, repeats)
        threads_used = torch.get_num_threads()
    y = v.decode(stored)
    r = {"family": v.family, "bits": v.bits, "bytes_per_row": v.bytes_per_row,
         "l2": mean_l2(y, x), "encode_s": seconds, "rows_per_s": len(x) / seconds,
         "threads": v.threads, "torch_threads": threads_used}
    if mask is not None:
        r["l2_touched"] = mean_l2(y, x, mask) if mask.any() else float("nan")
    return r


def measure_all(x: np.ndarray, mask: np.ndarray | None, repeats: int) -> dict[str, dict]:
    """Every codec and FBGEMM variant on the same rows, keyed by variant. Local."""
    results = {}
    for v in fbgemm_variants(x.shape[1]) + codec_variants(x.shape[1]):
        results[v.key] = measure(v, x, mask, repeats)
        r = results[v.key]
        print(f"  {v.key:<26} L2 {r['l2']:.5f}  {r['rows_per_s']:>12,.0f} rows/s", flush=True)
    return results


# ----------------------------------------------------------------------------------- targets

def ratios(results: dict[str, dict]) -> dict[str, dict]:
    """Adaptive (refined) against FBGEMM greedy at the same bits and thread count. Local."""
    out = {}
    for bits in TARGET_BITS:
        for t in THREADS:
            a, f = results[f"adaptive-refined-{bits}-t{t}"], results[f"fbgemm-greedy-{bits}-t{t}"]
            out[f"{bits}bit-t{t}"] = {
                "bits": bits, "threads": t,
                "l2_ratio": a["l2"] / f["l2"], "speedup": a["rows_per_s"] / f["rows_per_s"],
                "bytes_per_row": a["bytes_per_row"], "fbgemm_bytes_per_row": f["bytes_per_row"],
                "l2_ok": a["l2"] <= f["l2"], "bytes_ok": a["bytes_per_row"] <= f["bytes_per_row"],
                "speed_ok": a["rows_per_s"] >= TARGET_SPEEDUP * f["rows_per_s"]}
    return out


def targets_hold(matrix_ratios: dict[str, dict]) -> dict[str, bool]:
    """Whether each target holds for every bits and thread count of one matrix. Local."""
    rs = matrix_ratios.values()
    return {"l2": all(r["l2_ok"] for r in rs), "bytes": all(r["bytes_ok"] for r in rs),
            "speed": all(r["speed_ok"] for r in rs)}


# ----------------------------------------------------------------------------------- output

def print_table(name: str, m: dict) -> None:
    """One matrix's results, by bits, then its ratios against FBGEMM greedy. Local."""
    info, results = m["info"], m["results"]
    touched = "l2_touched" in next(iter(results.values()))
    print(f"\n== {name}: {info['rows']:,} rows x D={info['dim']}"
          + (f", {info['touched']:,} touched by training ({info['touched_fraction']:.1%})"
             if touched else ""))
    print(f"{'variant':<26}{'bits':>5}{'B/row':>7}{'mean L2':>11}"
          + (f"{'L2 touched':>12}" if touched else "") + f"{'rows/s':>14}{'threads':>9}")
    for key, r in sorted(results.items(), key=lambda kv: (kv[1]["bits"], kv[0])):
        th = f"{r['threads'] if r['threads'] is not None else '-'}/{r['torch_threads']}"
        print(f"{key:<26}{r['bits']:>5}{r['bytes_per_row']:>7}{r['l2']:>11.5f}"
              + (f"{r['l2_touched']:>12.5f}" if touched else "")
              + f"{r['rows_per_s']:>14,.0f}{th:>9}")
    print("threads = search threads / torch intra-op threads")
    for key, r in m["ratios"].items():
        print(f"adaptive refined vs FBGEMM greedy, {r['bits']} bits, {r['threads']} thread(s): "
              f"L2 ratio {r['l2_ratio']:.4f} ({'ok' if r['l2_ok'] else 'MISSED'}), "
              f"bytes/row {r['bytes_per_row']} vs {r['fbgemm_bytes_per_row']} "
              f"({'ok' if r['bytes_ok'] else 'MISSED'}), speed {r['speedup']:.1f}x "
              f"({'ok' if r['speed_ok'] else 'MISSED'}; target >= {TARGET_SPEEDUP:g}x)")


SERIES = {"asym": ("o", "tab:blue"), "sym": ("v", "tab:cyan"),
          "adaptive-refined": ("s", "tab:green"), "adaptive-greedy": ("D", "tab:olive"),
          "kmeans": ("^", "tab:purple"), "fp16": ("*", "tab:gray"),
          "fbgemm-naive": ("X", "tab:orange"), "fbgemm-greedy": ("P", "tab:red"),
          "fbgemm-byte": ("X", "tab:red")}


def plot_loss(ax, name: str, results: dict) -> None:
    """Mean L2 against bytes per row, one series per codec family (1-thread runs). Local."""
    for family, (marker, color) in SERIES.items():
        pts = sorted((r["bytes_per_row"], r["l2"]) for k, r in results.items()
                     if r["family"] == family and not k.endswith("-t2"))
        if not pts:
            continue
        fb = family.startswith("fbgemm")
        ax.plot(*zip(*pts), marker=marker, color=color, label=family, linestyle="--" if fb else "-",
                markersize=11 if fb else 6, markeredgecolor="black" if fb else color, alpha=0.85)
    ax.set(xlabel="bytes per row", ylabel="mean per-row L2 loss", xscale="log", yscale="log",
           title=f"{name}: loss vs size")
    ticks = sorted({r["bytes_per_row"] for r in results.values()})
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=7, rotation=90)
    ax.minorticks_off()


def one_thread_key(results: dict, family: str, bits: int) -> str | None:
    """The key of `family` at `bits` run at its default or at 1 thread, if measured. Local."""
    for k, r in results.items():
        if r["family"] == family and r["bits"] == bits and not k.endswith("-t2"):
            return k
    return None


def plot_relative(ax, name: str, results: dict) -> None:
    """Mean L2 relative to asym at the same width, bars grouped by width (1-thread runs). Local."""
    families = [f for f in SERIES if f not in ("asym", "fp16", "fbgemm-byte")]
    width = 0.8 / len(families)
    for i, family in enumerate(families):
        xs, ys = [], []
        for j, bits in enumerate(BITS):
            key = one_thread_key(results, "fbgemm-byte" if family == "fbgemm-greedy" and bits == 8
                                 else family, bits)
            if key is not None:
                xs.append(j + i * width)
                ys.append(results[key]["l2"] / results[f"asym-{bits}"]["l2"])
        color = SERIES[family][1]
        ax.bar(xs, ys, width, color=color, label=family,
               edgecolor="black" if family.startswith("fbgemm") else color)
    ax.axhline(1.0, color="tab:blue", linewidth=1, label="asym")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)  # room for the legend above the bars
    ax.set_xticks(np.arange(len(BITS)) + 0.4 - width / 2, [f"{b} bits" for b in BITS])
    ax.set(ylabel="mean L2 / asym's mean L2", title=f"{name}: loss relative to asym "
           "(fbgemm-greedy at 8 bits: byte)")


def plot_speed(ax, name: str, results: dict) -> None:
    """Encode rows/s at 2 and 4 bits: adaptive and asym against FBGEMM. Local."""
    keys = ["asym-{b}", "adaptive-refined-{b}-t1", "adaptive-refined-{b}-t2",
            "adaptive-greedy-{b}-t1", "adaptive-greedy-{b}-t2", "fbgemm-naive-{b}-t1",
            "fbgemm-greedy-{b}-t1", "fbgemm-greedy-{b}-t2"]
    width = 0.8 / len(TARGET_BITS)
    for i, bits in enumerate(TARGET_BITS):
        vals = [results[k.format(b=bits)]["rows_per_s"] for k in keys]
        colors = [SERIES[results[k.format(b=bits)]["family"]][1] for k in keys]
        ax.bar(np.arange(len(keys)) + i * width, vals, width, color=colors,
               edgecolor="black", hatch="//" if i else None, label=f"{bits} bits")
    ax.set_xticks(np.arange(len(keys)) + width / 2,
                  [k.replace("-{b}", "") for k in keys], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="encode rows/s (best of repeats)", yscale="log", title=f"{name}: encode speed")


def plot(matrices: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, len(matrices), figsize=(7 * len(matrices), 15), squeeze=False)
    for j, (name, m) in enumerate(matrices.items()):
        plot_loss(ax[0, j], name, m["results"])
        plot_relative(ax[1, j], name, m["results"])
        plot_speed(ax[2, j], name, m["results"])
    for a in ax.ravel():
        a.legend(fontsize=8, ncol=4 if a in ax[1] else 1,
                 loc="upper center" if a in ax[1] else "best")
        a.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    return {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_default_threads": torch.get_num_threads(), "numpy": np.__version__,
            "python": platform.python_version(),
            "search_backend": "c" if c_kernel() is not None else "torch"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=50_000, help="rows of the random matrix")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="timed encodes per variant (best kept)")
    p.add_argument("--skip-trained", action="store_true", help="random matrix only")
    p.add_argument("--trained-tables", default="50000-20000",
                   help="--arch-embedding-size of the trained model")
    p.add_argument("--trained-batches", type=int, default=300, help="its training batches (of 256)")
    p.add_argument("--out", default=str(RESULTS), help="results directory")
    args = p.parse_args()
    start = time.perf_counter()
    inputs = {"random": (random_matrix(args.rows, args.dim, args.seed), None,
                         {"rows": args.rows, "seed": args.seed})}
    if not args.skip_trained:
        print("training the synthetic model for the trained matrix ...", flush=True)
        inputs["trained"] = trained_matrix(args)
    matrices = {}
    for name, (x, mask, info) in inputs.items():
        print(f"measuring {name} ({len(x):,} x {x.shape[1]})", flush=True)
        results = measure_all(x, mask, args.repeats)
        matrices[name] = {"info": dict(info, dim=int(x.shape[1])), "results": results,
                          "ratios": ratios(results)}
        matrices[name]["targets"] = targets_hold(matrices[name]["ratios"])
    for name, m in matrices.items():
        print_table(name, m)
    held = {k: all(m["targets"][k] for m in matrices.values()) for k in ("l2", "bytes", "speed")}
    print(f"\ntargets over {', '.join(matrices)}: L2 <= FBGEMM greedy: {held['l2']}; bytes/row <= "
          f"FBGEMM: {held['bytes']}; rows/s >= {TARGET_SPEEDUP:g}x FBGEMM greedy: {held['speed']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine_info(), "args": vars(args), "matrices": matrices,
           "targets_hold": held, "target_speedup": TARGET_SPEEDUP,
           "seconds": time.perf_counter() - start}
    (out / "quant_codecs.json").write_text(json.dumps(doc, indent=1))
    plot(matrices, out / "quant_codecs.png")
    print(f"wrote {out / 'quant_codecs.json'} and {out / 'quant_codecs.png'} "
          f"in {doc['seconds']:.0f} s")


if __name__ == "__main__":
    main()
