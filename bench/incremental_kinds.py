"""Incremental checkpoint kinds on the synthetic Zipf stream: bytes per interval, storage, restore
time of every checkpoint id (naive incremental vs differential vs IncrCP).

    python bench/incremental_kinds.py --checkpoints 100

One process writes the checkpoints of every kind through the production writer, planner, extraction
and restore code (`tests/local_chain.py`, LocalChain) for the same update stream: the rows that
the Zipf batches of each interval touch get an Adagrad-like update. Every checkpoint is retained, so
every id can be restored afterwards. Restores read cold files (POSIX_FADV_DONTNEED on every file
first) and are timed twice: the whole checkpoint, and its increments only (IncrCP's metric, which
leaves out the baseline). "naive" is the consecutive kind: baseline plus every increment, newer rows
overwriting older. Writes bench/results/incremental_kinds.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests/

from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream, criteo_kaggle_sizes  # noqa: E402
from mpickpt.kinds.registry import checkpoint_segments  # noqa: E402
from mpickpt.model.shard_plan import ShardPlan  # noqa: E402
from mpickpt.store.manifest import list_manifests, parent_manifests  # noqa: E402
from mpickpt.store.segments import load_rows  # noqa: E402
from tests.local_chain import LocalChain  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KINDS = ("full", "differential", "consecutive", "intermittent", "incrcp", "incrcp-chain")
RESTORED = ("consecutive", "differential", "incrcp", "incrcp-chain")
"""incrcp: IncrCP's cost model resets the baseline; incrcp-chain: --incrcp-reset never."""


def touched_rows(stream, plan, start: int, batches: int, batch: int) -> np.ndarray:
    """Sorted unique global ids the next `batches` batches look up. Local."""
    offsets = np.asarray(plan.table_offsets[:plan.num_tables], dtype=np.int64)
    ids = []
    for b in range(batches):
        sparse = stream.batch(start + b * batch, batch).sparse.numpy()  # (n, T, L)
        ids.append((sparse + offsets[None, :, None]).ravel())
    return np.unique(np.concatenate(ids))


def drop_cache(root: str) -> None:
    """Evict every file under `root` from the page cache, so restores read the disk. Local."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def du(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(root) for n in ns)


def write_all(root: str, plan, args, stream) -> dict:
    """Write `args.checkpoints` checkpoints of every kind for one update stream. Local."""
    chains = {k: LocalChain(os.path.join(root, k), plan, args.dim, k.split("-")[0],
                            ratio=args.ratio, seed=1,
                            incrcp_reset="never" if k == "incrcp-chain" else "cost")
              for k in KINDS}
    out = {k: {"bytes": [], "rows": [], "storage": [], "kinds": [], "write_s": [], "ingest_s": []}
           for k in KINDS}
    touched_per_interval = []
    rng = np.random.default_rng(0)
    for i in range(args.checkpoints):
        gids = touched_rows(stream, plan, i * args.batches * args.batch, args.batches, args.batch)
        touched_per_interval.append(int(len(gids)))
        state = rng.integers(0, 2**31)
        for kind, chain in chains.items():
            chain.touch(0, gids, np.random.default_rng(state))  # same update for every kind
            rec = chain.save(i + 1)
            o = out[kind]
            o["bytes"].append(rec["bytes"])
            o["rows"].append(rec["rows"])
            o["kinds"].append(rec["kind"])
            o["write_s"].append(rec["write_seconds"])
            o["ingest_s"].append(rec["ingest_seconds"])
            o["storage"].append(du(chain.root))
        if (i + 1) % 10 == 0:
            print(f"  wrote checkpoint {i + 1}/{args.checkpoints}: {len(gids)} rows touched "
                  f"({len(gids) / plan.total_rows:.1%}); storage " +
                  ", ".join(f"{k} {out[k]['storage'][-1] / 1e6:.0f} MB" for k in KINDS), flush=True)
    return {"per_kind": out, "touched": touched_per_interval}


def time_restore(root: str, plan, dim: int, step: int, increments_only: bool) -> float:
    """Cold restore of checkpoint `step` (optionally without its baseline), in seconds. Local."""
    manifests = {m.step: m for m in list_manifests(root)}
    m = manifests[step]
    segments = checkpoint_segments(root, m, manifests)
    if increments_only and m.kind != "full":
        base = parent_manifests(m, manifests)[0]
        segments = segments[len(base.shard_files()):]
    elif increments_only:
        return 0.0
    templates = {"weight": ((dim,), np.dtype(np.float32)), "state/sum": ((), np.dtype(np.float32))}
    drop_cache(root)
    start = time.perf_counter()
    load_rows(root, segments, plan, 0, templates, step, complete=not increments_only)
    return time.perf_counter() - start


def restore_all(root: str, plan, args) -> dict:
    out = {}
    for kind in RESTORED:
        whole, incr = [], []
        for step in range(1, args.checkpoints + 1):
            whole.append(time_restore(os.path.join(root, kind), plan, args.dim, step, False))
            incr.append(time_restore(os.path.join(root, kind), plan, args.dim, step, True))
        out[kind] = {"whole_s": whole, "increments_s": incr}
        print(f"  restored every id of {kind}: mean {np.mean(whole) * 1e3:.1f} ms whole, "
              f"{np.mean(incr) * 1e3:.1f} ms increments only", flush=True)
    return out


def summarize(written: dict, restores: dict, plan, args) -> dict:
    pk = written["per_kind"]
    s = {"rows_total": int(plan.total_rows), "dim": args.dim, "checkpoints": args.checkpoints,
         "batches_per_interval": args.batches, "batch": args.batch, "ratio_R": args.ratio,
         "mean_touched_fraction": float(np.mean(written["touched"]) / plan.total_rows)}
    for k in KINDS:
        s[f"{k}_storage_MB"] = pk[k]["storage"][-1] / 1e6
        s[f"{k}_mean_interval_MB"] = float(np.mean(pk[k]["bytes"][1:])) / 1e6
        s[f"{k}_baselines"] = pk[k]["kinds"].count("full")
    for k in RESTORED:
        s[f"{k}_mean_restore_ms"] = float(np.mean(restores[k]["whole_s"])) * 1e3
        s[f"{k}_mean_restore_incr_ms"] = float(np.mean(restores[k]["increments_s"])) * 1e3
    for k in ("incrcp", "incrcp-chain"):
        s[f"{k}_speedup_vs_naive_incr"] = (s["consecutive_mean_restore_incr_ms"]
                                           / s[f"{k}_mean_restore_incr_ms"])
        s[f"{k}_over_differential_incr"] = (s[f"{k}_mean_restore_incr_ms"]
                                            / s["differential_mean_restore_incr_ms"])
        s[f"{k}_over_differential_whole"] = (s[f"{k}_mean_restore_ms"]
                                             / s["differential_mean_restore_ms"])
        s[f"{k}_storage_over_differential"] = (s[f"{k}_storage_MB"]
                                               / s["differential_storage_MB"])
    s["speedup_vs_naive_incr"] = s["consecutive_mean_restore_incr_ms"] / s["incrcp_mean_restore_incr_ms"]
    s["speedup_vs_naive_whole"] = s["consecutive_mean_restore_ms"] / s["incrcp_mean_restore_ms"]
    s["incrcp_over_differential_incr"] = (s["incrcp_mean_restore_incr_ms"]
                                          / s["differential_mean_restore_incr_ms"])
    s["incrcp_over_differential_whole"] = s["incrcp_mean_restore_ms"] / s["differential_mean_restore_ms"]
    s["incrcp_storage_over_differential"] = s["incrcp_storage_MB"] / s["differential_storage_MB"]
    cons = np.array(pk["consecutive"]["bytes"][1:], dtype=float)
    rows = np.array(pk["consecutive"]["rows"][1:], dtype=float)
    per_row = cons / np.maximum(rows, 1)
    s["consecutive_bytes_per_touched_row_cv"] = float(per_row.std() / per_row.mean())
    s["consecutive_bytes_rows_corr"] = float(np.corrcoef(cons, rows)[0, 1]) if len(rows) > 2 else 1.0
    s["full_interval_over_consecutive"] = s["full_mean_interval_MB"] / s["consecutive_mean_interval_MB"]
    return s


def print_table(s: dict) -> None:
    print(f"\n{s['checkpoints']} checkpoints, {s['rows_total']:,} rows x D={s['dim']}, "
          f"{s['batches_per_interval']} batches of {s['batch']} per interval "
          f"({s['mean_touched_fraction']:.1%} of rows touched per interval), R={s['ratio_R']}")
    print(f"{'kind':<13}{'MB/interval':>12}{'storage MB':>12}{'baselines':>10}"
          f"{'restore ms':>12}{'incr-only ms':>14}")
    for k in KINDS:
        r = (f"{s[f'{k}_mean_restore_ms']:>12.1f}{s[f'{k}_mean_restore_incr_ms']:>14.1f}"
             if f"{k}_mean_restore_ms" in s else f"{'':>12}{'':>14}")
        print(f"{k:<13}{s[f'{k}_mean_interval_MB']:>12.2f}{s[f'{k}_storage_MB']:>12.1f}"
              f"{s[f'{k}_baselines']:>10}{r}")
    for k in ("incrcp", "incrcp-chain"):
        print(f"\n{k}: restore {s[f'{k}_speedup_vs_naive_incr']:.1f}x faster than naive "
              f"incremental on increments (target >= 6.6x); restore / differential "
              f"{s[f'{k}_over_differential_incr']:.2f} on increments, "
              f"{s[f'{k}_over_differential_whole']:.2f} whole (target <= 1.2); storage / "
              f"differential {s[f'{k}_storage_over_differential']:.2f} (target <= 0.40)")
    print(f"bytes per interval vs rows touched (consecutive): correlation "
          f"{s['consecutive_bytes_rows_corr']:.3f}, bytes/row CV {s['consecutive_bytes_per_touched_row_cv']:.3f}; "
          f"full writes {s['full_interval_over_consecutive']:.1f}x more per interval")


def plot(written: dict, restores: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.5))
    ids = np.arange(1, len(written["touched"]) + 1)
    for k in RESTORED:
        ax[0].plot(ids, np.array(restores[k]["increments_s"]) * 1e3,
                   label="naive incremental" if k == "consecutive" else k)
    ax[0].set(xlabel="checkpoint id", ylabel="restore of increments (ms, cold)", yscale="log",
              title="Restore time")
    for k in KINDS:
        ax[1].plot(ids, np.array(written["per_kind"][k]["storage"]) / 1e6, label=k)
        ax[2].plot(ids, np.array(written["per_kind"][k]["bytes"]) / 1e6, label=k)
    ax[1].set(xlabel="checkpoint id", ylabel="MB", yscale="log", title="Total storage")
    ax[2].set(xlabel="checkpoint id", ylabel="MB written", yscale="log", title="Bytes per interval")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoints", type=int, default=100)
    p.add_argument("--scale-down", type=int, default=100, help="Criteo Kaggle table sizes / this")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batches", type=int, default=2, help="batches per checkpoint interval")
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--ratio", type=float, default=0.02, help="IncrCP's R")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", default=str(RESULTS / "incremental_kinds.json"))
    args = p.parse_args()
    sizes = criteo_kaggle_sizes(args.scale_down)
    plan = ShardPlan.build(sizes, 1)
    assert np.array_equal(plan.local_to_global(0, np.arange(plan.total_rows)),
                          np.arange(plan.total_rows))
    stream = SyntheticStream(SyntheticConfig(table_sizes=sizes))
    root = args.dir or tempfile.mkdtemp(prefix="mpickpt-kinds-")
    try:
        print(f"writing {args.checkpoints} checkpoints of each kind under {root}", flush=True)
        written = write_all(root, plan, args, stream)
        restores = restore_all(root, plan, args)
        s = summarize(written, restores, plan, args)
        print_table(s)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": s, "written": written,
                                              "restores": restores}, indent=1))
        plot(written, restores, Path(args.out).with_suffix(".png"))
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
