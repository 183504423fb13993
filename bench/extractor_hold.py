"""The IncrCP extractor's CPU per ingestion against `--incrcp-hold` (issue 23, point 2).

    python bench/extractor_hold.py --scale-down 5 --ingestions 20

One process writes a chain of incremental checkpoints of one rank (`--incrcp-reset never`, the
Criteo Kaggle tables / --scale-down, D = 16, the Zipf stream's touched rows, --batches of 512
per interval) through the production writer, planner and extractor (`tests/local_chain.py`),
once per hold limit, and reports the extractor's CPU per ingestion (`time.process_time` around
`Extractor.ingest`, the first --skip ingestions left out), the bytes of its bundles (rows 0 and
1) and of its last row-0 bundle alone, and whether that was held. 0 reads every bundle back from
its file; 64M was the limit before --incrcp-hold (the row-0 arenas kept 64 MB then); the default
holds a bundle up to 512 MB. Rounds alternate the order of the limits. Writes
bench/results/extractor_hold.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests/

from bench.incremental_kinds import touched_rows  # noqa: E402
from mpickpt.data.synthetic import (SyntheticConfig, SyntheticStream,  # noqa: E402
                                    criteo_kaggle_sizes)
from mpickpt.incrcp.held_bundle import HOLD_BYTES  # noqa: E402
from mpickpt.model.shard_plan import ShardPlan  # noqa: E402
from tests.local_chain import LocalChain  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HOLDS = {"0": 0, "64M": 64 << 20, f"{HOLD_BYTES >> 20}M (default)": HOLD_BYTES}


def chain_cpu(args, hold: int, root: str) -> dict:
    """Write one chain with `hold`; the extractor's CPU per ingestion and bundle bytes. Local."""
    sizes = criteo_kaggle_sizes(args.scale_down)
    plan = ShardPlan.build(sizes, 1)
    stream = SyntheticStream(SyntheticConfig(table_sizes=sizes))
    chain = LocalChain(root, plan, 16, "incrcp", seed=1, incrcp_reset="never", keep=2)
    extractor = chain.extractors[0]
    extractor.limit_held(hold)
    ingest, cpu = extractor.ingest, []

    def timed(*a, **k):
        start = time.process_time()
        out = ingest(*a, **k)
        cpu.append(time.process_time() - start)
        return out

    extractor.ingest = timed
    for i in range(args.ingestions + 1):  # the first save is the baseline
        rows = touched_rows(stream, plan, i * args.batches * 512, args.batches, 512)
        chain.touch(0, rows, np.random.default_rng(i))
        chain.save(i + 1)
    kept = cpu[args.skip:]
    bundles = [s.bundle_bytes for s in chain.ingestions[args.skip:]]
    row0 = sorted(Path(root).rglob("bundle-*-row0.h5"))  # the last ingestion's, live
    return {"cpu_ms_median": 1e3 * float(np.median(kept)),
            "cpu_ms_mean": 1e3 * float(np.mean(kept)),
            "bundle_mb_median": float(np.median(bundles)) / 1e6,
            "last_row0_mb": row0[-1].stat().st_size / 1e6 if row0 else 0.0,
            "held_last": extractor.held is not None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale-down", type=int, default=5, help="Criteo Kaggle table sizes / this")
    p.add_argument("--ingestions", type=int, default=20)
    p.add_argument("--skip", type=int, default=5, help="first ingestions left out")
    p.add_argument("--batches", type=int, default=100, help="batches of 512 per interval")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--out", default=str(RESULTS / "extractor_hold.json"))
    args = p.parse_args(argv)
    if args.skip >= args.ingestions:
        p.error(f"--skip {args.skip} leaves none of --ingestions {args.ingestions}")
    runs = []
    for r in range(args.rounds):
        for label in (list(HOLDS) if r % 2 == 0 else list(reversed(HOLDS))):
            root = tempfile.mkdtemp(prefix="hold-", dir=args.dir)
            try:
                runs.append({"round": r, "hold": label, **chain_cpu(args, HOLDS[label], root)})
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"round {r} hold {label}: {runs[-1]['cpu_ms_median']:.1f} ms", flush=True)
    summary = []
    for label in HOLDS:
        mine = [x for x in runs if x["hold"] == label]
        summary.append({"hold": label,
                        "cpu_ms_median": float(np.median([x["cpu_ms_median"] for x in mine])),
                        "bundle_mb_median": mine[0]["bundle_mb_median"],
                        "last_row0_mb": mine[0]["last_row0_mb"],
                        "held_last": all(x["held_last"] for x in mine)})
    base = summary[0]["cpu_ms_median"]
    print("| --incrcp-hold | extractor CPU per ingestion (ms, median) | vs 0 | bundles, rows 0 + "
          "1 (MB, median) | last row-0 bundle (MB) | held |\n|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['hold']} | {s['cpu_ms_median']:.1f} | {s['cpu_ms_median'] / base:.2f} | "
              f"{s['bundle_mb_median']:.1f} | {s['last_row0_mb']:.1f} | {s['held_last']} |")
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args),
                                          "runs": runs, "summary": summary}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
