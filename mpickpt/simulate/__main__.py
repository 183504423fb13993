"""python -m mpickpt.simulate: what each fault-tolerance strategy costs a job of N ranks.

    python -m mpickpt.simulate                                   # 8 .. 16384 ranks, 2 MTBFs
    python -m mpickpt.simulate --ranks 512 --mtbf 2000 --runs 500
    python -m mpickpt.simulate --young-sweep --ranks 1024         # Young's interval is the optimum
    python -m mpickpt.simulate --crosscheck bench/results/partial_recovery_4ranks.json

Per-event costs come from the cost model (`mpickpt.costmodel`): constants fitted on the scaling
sweep (--sweep) and a machine preset (--machine h100-cluster or local) with a workload per rank.
For every size and node MTBF it prints each strategy's expected failure-related overhead and
goodput with 95 % confidence intervals, its expected PLS, checkpoint storage and write bandwidth,
and names the best strategy among those whose expected PLS stays within --pls-bound; `auto` is
`--recovery auto` with its defaults, and its overhead is compared with the best one's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mpickpt.simulate.scenario import HOUR, MTBF_PRESETS, Scenario
from mpickpt.simulate.strategies import STRATEGIES

REPO = Path(__file__).resolve().parents[2]
DEFAULT_SWEEP = REPO / "bench" / "results" / "scaling.json"
DEFAULT_TRACKING = REPO / "bench" / "results" / "tracking_overhead.json"
SIZES = (8, 32, 128, 512, 2048, 8192, 16384)


def node_mtbf(text: str) -> tuple[str, float]:
    """'cpr', 'llama3' or hours -> (label, seconds). Local."""
    if text in MTBF_PRESETS:
        return text, MTBF_PRESETS[text] * HOUR
    try:
        hours = float(text)
    except ValueError:
        raise SystemExit(f"--mtbf {text!r}: expected {', '.join(MTBF_PRESETS)} or hours per "
                         f"node") from None
    if hours <= 0:
        raise SystemExit(f"--mtbf {text!r}: the node MTBF must be > 0 hours")
    return f"{hours:g}h", hours * HOUR


def costs_for(args, ranks: int):
    """EventCosts at `ranks` from the cost model. Local."""
    from mpickpt.costmodel import H100_CLUSTER, Workload
    from mpickpt.simulate.costs import event_costs

    local, constants, _ = args.fitted
    machine = H100_CLUSTER if args.machine == "h100-cluster" else local
    ec = event_costs(constants, machine, Workload(), ranks, args.ranks_per_node)
    return ec.with_(reschedule=args.reschedule, relaunch=args.relaunch,
                    priority_upkeep=args.priority_upkeep)


def priority_upkeep(path: str) -> dict:
    """The MFU and SSU trackers' measured share of a step (bench/tracking_overhead.py); empty
    when the file has none (the trackers then cost nothing in the simulation). Local."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        print(f"simulate: no tracker upkeep in {path}: prioritized saves' trackers cost 0",
              file=sys.stderr)
        return {}
    return {rule: r["upkeep_pct"] / 100 for rule, r in doc.get("priority", {}).items()}


def table_for(args, ranks: int, mtbf: tuple[str, float], strategies: list[str]) -> dict:
    """Every strategy at one size and MTBF, the best one and auto's ratio to it. Local."""
    from mpickpt.simulate.montecarlo import simulate

    sc = Scenario(ranks=ranks, train_seconds=args.train_hours * HOUR,
                  ranks_per_node=args.ranks_per_node, node_mtbf=mtbf[1], shape=args.shape,
                  multi_prob=args.multi_prob, time_limit=args.time_limit * HOUR,
                  preempt_mtbf=args.preempt_mtbf * HOUR, target_pls=args.target_pls,
                  spare_nodes=args.spare_nodes)
    ec = costs_for(args, ranks)
    rows = {s: simulate(s, sc, ec, args.runs, args.seed) for s in strategies}
    ok = {s: r for s, r in rows.items()
          if r["pls"].mean <= args.pls_bound and not r["diverged"]}
    best = min(ok, key=lambda s: ok[s]["overhead"].mean) if ok else None
    out = {"ranks": ranks, "mtbf": mtbf[0], "job_mtbf_h": sc.job_mtbf / HOUR, "rows": rows,
           "best": best, "costs": ec.as_dict()}
    if best is not None and "auto" in rows:
        out["auto_over_best"] = rows["auto"]["overhead"].mean / max(
            rows[best]["overhead"].mean, 1e-12)
    return out


def print_block(t: dict) -> None:
    print(f"\n{t['ranks']} ranks, node MTBF {t['mtbf']} (job MTBF {t['job_mtbf_h']:.2f} h)")
    print(f"  {'strategy':<12} {'overhead %':>16} {'goodput':>7} {'PLS':>15} {'interval':>9} "
          f"{'storage GB':>10} {'write GB/s':>10} {'failures':>8}")
    for name, r in t["rows"].items():
        o, pls = r["overhead"], r["pls"]
        mark = " <- best" if name == t["best"] else ""
        mode = f" ({r['mode']})" if "mode" in r else ""
        mode += f" never finishes in {r['diverged']:.0%} of runs" if r["diverged"] else ""
        print(f"  {name:<12} {o.mean * 100:8.3f} ± {o.half * 100:5.3f} {r['goodput'].mean:7.4f} "
              f"{pls.mean:7.4f} ± {pls.half:5.4f} {r['interval_s'] / 60:7.1f}mn "
              f"{r['storage_bytes'] / 1e9:10.0f} {r['write_Bps'] / 1e9:10.3f} "
              f"{r['failures'].mean:8.1f}{mode}{mark}")
    if "auto_over_best" in t:
        print(f"  auto / best overhead: {t['auto_over_best']:.3f}")


def report_crossovers(tables: list[dict]) -> list[dict]:
    """Print and return where the best strategy changes with the size. Local."""
    from mpickpt.simulate.plot import crossovers

    found = crossovers(tables)
    for c in found:
        print(f"crossover at node MTBF {c['mtbf']}: best is {c['from']} at {c['from_ranks']} "
              f"ranks, {c['to']} at {c['to_ranks']}")
    if not found:
        print("no crossover: the same strategy is best at every size")
    return found


def young_sweep(args) -> dict:
    """Full recovery's simulated overhead at multiples of Young's interval. Local."""
    from mpickpt.simulate.montecarlo import Estimate, run_many
    from mpickpt.simulate.strategies import Strategy

    label, mtbf = node_mtbf(args.mtbf[0])
    ranks = args.ranks[0]
    sc = Scenario(ranks=ranks, train_seconds=args.train_hours * HOUR,
                  ranks_per_node=args.ranks_per_node, node_mtbf=mtbf, shape=args.shape,
                  multi_prob=args.multi_prob, time_limit=0.0)
    base = Strategy(sc, costs_for(args, ranks))
    out = []
    for factor in (0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0):
        s = Strategy(sc, base.ec)
        s.plan = base.plan.with_(interval=base.plan.interval * factor)
        e = Estimate.of([(r.wall - sc.train_seconds) / sc.train_seconds
                         for r in run_many(s, sc, args.runs, args.seed)])
        out.append({"factor": factor, "interval_s": s.plan.interval, "overhead": e.mean,
                    "half": e.half})
        print(f"  {factor:5.2f} x Young ({s.plan.interval / 60:7.1f} min): overhead "
              f"{e.mean * 100:.3f} ± {e.half * 100:.3f} %")
    return {"ranks": ranks, "mtbf": label, "points": out}


def run_crosscheck(args) -> dict:
    """The simulator against the partial-recovery benchmark's runs (`simulate.crosscheck`)."""
    from mpickpt.simulate.crosscheck import crosscheck, table

    try:
        result = crosscheck(args.crosscheck, runs=max(args.runs, 4000), seed=args.seed)
    except ValueError as e:
        raise SystemExit(f"simulate: {e}") from None
    print(table(result))
    return result


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpickpt.simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES))
    p.add_argument("--mtbf", type=lambda s: s.split(","), default=["cpr", "llama3"],
                   help="node MTBFs: cpr (896 h), llama3 (6,300 h) or hours")
    p.add_argument("--strategies", default="all", help=f"comma-separated: {', '.join(STRATEGIES)}")
    p.add_argument("--runs", type=int, default=100, help="Monte Carlo runs per strategy and size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", choices=("h100-cluster", "local"), default="h100-cluster")
    p.add_argument("--sweep", default=str(DEFAULT_SWEEP), help="scaling sweep JSON to fit on")
    p.add_argument("--tracking", default=str(DEFAULT_TRACKING),
                   help="bench/tracking_overhead.py's JSON: the MFU/SSU trackers' upkeep")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--train-hours", type=float, default=168.0)
    p.add_argument("--shape", type=float, default=0.68, help="gamma shape of node failures")
    p.add_argument("--multi-prob", type=float, default=0.05)
    p.add_argument("--time-limit", type=float, default=48.0, help="hours per allocation (0: none)")
    p.add_argument("--preempt-mtbf", type=float, default=0.0, help="hours between preemptions")
    p.add_argument("--reschedule", type=float, default=120.0, help="seconds to replace a node")
    p.add_argument("--relaunch", type=float, default=180.0, help="seconds to relaunch a job")
    p.add_argument("--spare-nodes", type=int, default=0,
                   help="hot spare nodes: failures of up to this many nodes are replaced in "
                        "place by warm spares (0.5 s + 1.5 s per 16k ranks) instead of "
                        "--reschedule")
    p.add_argument("--target-pls", type=float, default=0.02,
                   help="PLS target of the cpr strategies")
    p.add_argument("--pls-bound", type=float, default=0.1,
                   help="strategies with a larger expected PLS are not ranked")
    p.add_argument("--young-sweep", action="store_true")
    p.add_argument("--crosscheck", default=None, metavar="JSON",
                   help="compare with bench/partial_recovery.py's emulated runs in JSON")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the overhead-vs-ranks plot (PNG) here")
    args = p.parse_args(argv)
    if args.crosscheck:
        return args
    if not Path(args.sweep).exists():
        raise SystemExit(f"simulate: {args.sweep}: no scaling sweep to fit the cost model on "
                         f"(run bench/scaling.py, or pass --sweep)")
    names = list(STRATEGIES) if args.strategies == "all" else args.strategies.split(",")
    for n in names:
        if n not in STRATEGIES:
            raise SystemExit(f"simulate: unknown strategy {n!r}; known: {', '.join(STRATEGIES)}")
    args.names = names
    from mpickpt.costmodel import fitted_local
    args.fitted = fitted_local(args.sweep)  # once: every size and MTBF uses the same fit
    args.priority_upkeep = priority_upkeep(args.tracking)
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    started = time.perf_counter()
    if args.crosscheck:
        doc = {"crosscheck": run_crosscheck(args)}
    elif args.young_sweep:
        doc = {"young_sweep": young_sweep(args)}
    else:
        tables = []
        for m in args.mtbf:
            for n in args.ranks:
                tables.append(table_for(args, n, node_mtbf(m), args.names))
                print_block(tables[-1])
        doc = {"tables": tables, "crossovers": report_crossovers(tables)}
        if args.plot:
            from mpickpt.simulate.plot import plot
            plot(tables, args.plot)
    doc["args"] = {k: v for k, v in vars(args).items() if k not in ("names", "fitted", "priority_upkeep")}
    print(f"\n{time.perf_counter() - started:.1f} s", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, default=_plain))
    return doc


def _plain(o):
    return {"mean": o.mean, "half": o.half} if hasattr(o, "half") else str(o)


if __name__ == "__main__":
    main()
