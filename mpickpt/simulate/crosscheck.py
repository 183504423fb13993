"""The simulator against the partial-recovery benchmark's emulated runs. Local.

`bench/partial_recovery.py` runs real jobs (mpiexec, gloo) that emulate a job of 56 hours under
CPR's failure process (gamma, shape 0.68, MTBF 28 h for the whole job), every failure losing a
fixed share F of the embedding shards, with full recovery at Young's interval and CPR-vanilla at
a target PLS. Its JSON keeps, per configuration, the runs' overheads and PLS with 95 % intervals,
and the mean per-event costs in steps: save (foreground, waits included) and background write per
checkpoint, restore per recovery, and the interval the job planned.

Here that job becomes a `Scenario` (one failure domain, the job; lost share F; no multi-node
failures, no time limit) and its measured costs `EventCosts` in emulated seconds (a step is the
emulated hours / steps). The simulator is given the costs and the planned interval; it predicts
the failures, the work rollbacks lose, the PLS and the overhead they add up to. A configuration
agrees when the simulated mean lies within the benchmark's 95 % interval widened by the
simulation's own.

The simulated job fails as the emulated one does: its failure clock counts training work
(replays included, saves and restores not) and a rollback first lets the checkpoint in flight
commit (the writers of an emulated failure survive); at cluster scale the simulator runs on the
wall clock and a real failure loses the checkpoint in flight.
"""
from __future__ import annotations

import json
from pathlib import Path

from mpickpt.simulate.costs import EventCosts
from mpickpt.simulate.montecarlo import run_many, summarize
from mpickpt.simulate.scenario import HOUR, Scenario
from mpickpt.simulate.strategies import build

EMULATED_HOURS = 56.0
JOB_MTBF_HOURS = 28.0
CPR_SHAPE = 0.68
"""bench/partial_recovery.py's emulation (`--failure-model cpr:28h --emulated-hours 56`), used
when its JSON does not record it."""


def strategy_of(config: str) -> tuple[str, float] | None:
    """Benchmark configuration -> (simulator strategy, target PLS); None when the simulator has
    no counterpart (prioritized saves are emulated differently). Local."""
    if config == "full":
        return "full", 0.0
    if config.startswith("vanilla@"):
        return "cpr", float(config.split("@")[1])
    return None


def scenario_for(doc: dict, row: dict, target_pls: float) -> Scenario:
    emu = doc.get("emulation", {})
    hours = emu.get("hours", EMULATED_HOURS)
    return Scenario(ranks=doc["args"]["ranks"], ranks_per_node=doc["args"]["ranks"],
                    train_seconds=hours * HOUR,
                    node_mtbf=emu.get("mtbf_hours", JOB_MTBF_HOURS) * HOUR,
                    shape=emu.get("shape", CPR_SHAPE), multi_prob=0.0, time_limit=0.0,
                    lost_share=row["fraction"], target_pls=target_pls or 0.02,
                    failure_clock="work", inflight_commits=True)


def costs_for(doc: dict, row: dict, step: float) -> tuple[EventCosts, float]:
    """The row's measured costs in emulated seconds, and its planned interval in seconds. A write
    longer than the interval is already inside the measured save (the save waited for it). Local."""
    ev = row.get("events") or {}
    if ev.get("interval_steps") is None or ev.get("save_steps") is None \
            or "overhead_half" not in row:
        raise ValueError(f"{row['config']}: the benchmark JSON has no per-event costs or "
                         f"intervals (written before bench/partial_recovery.py recorded them: "
                         f"run it again)")
    interval = ev["interval_steps"] * step
    load = (ev.get("load_steps") or 0.0) * step
    write = min((ev.get("write_steps") or 0.0) * step, interval)
    ec = EventCosts(stall=ev["save_steps"] * step, write=write, load=load, load_node=load,
                    rebuild_node=0.0, reschedule=doc["args"]["reschedule_minutes"] * 60.0)
    return ec, interval


def check_row(doc: dict, row: dict, runs: int, seed: int) -> dict | None:
    """One configuration: the benchmark's figures beside the simulator's. Local."""
    mapped = strategy_of(row["config"])
    if mapped is None:
        return None
    name, target = mapped
    hours = doc.get("emulation", {}).get("hours", EMULATED_HOURS)
    step = hours * HOUR / doc["args"]["steps"]
    sc = scenario_for(doc, row, target)
    ec, interval = costs_for(doc, row, step)
    strategy = build(name, sc, ec)
    own = strategy.plan.interval
    strategy.plan = strategy.plan.with_(interval=interval)
    sim = summarize(strategy, sc, run_many(strategy, sc, runs, seed))
    bench = {"overhead": row["overhead"]["total"], "overhead_half": row["overhead_half"],
             "pls": row["pls"], "pls_half": row["pls_half"],
             "failures": sum(row["failures"]) / len(row["failures"])}
    out = {"config": row["config"], "fraction": row["fraction"], "strategy": name,
           "interval_steps": interval / step, "simulator_interval_steps": own / step,
           "bench": bench,
           "sim": {"overhead": sim["overhead"].mean, "overhead_half": sim["overhead"].half,
                   "pls": sim["pls"].mean, "pls_half": sim["pls"].half,
                   "failures": sim["failures"].mean}}
    out["agree"] = {k: abs(out["sim"][k] - bench[k]) <= bench[f"{k}_half"] + out["sim"][f"{k}_half"]
                    for k in ("overhead", "pls")}
    return out


def crosscheck(path: str | Path, runs: int = 4000, seed: int = 0) -> dict:
    """Every configuration of the benchmark JSON at `path` that the simulator models. Local."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a partial-recovery benchmark JSON ({e})") from None
    if "rows" not in doc or "args" not in doc:
        raise ValueError(f"{path}: expected bench/partial_recovery.py's JSON (keys 'args' and "
                         f"'rows'), got keys {sorted(doc)}")
    rows = [r for r in (check_row(doc, row, runs, seed) for row in doc["rows"]) if r]
    return {"source": str(path), "ranks": doc["args"]["ranks"], "steps": doc["args"]["steps"],
            "seeds": doc["args"]["seeds"], "runs": runs, "rows": rows,
            "all_agree": all(all(r["agree"].values()) for r in rows)}


def table(result: dict) -> str:
    out = [f"cross-check at {result['ranks']} ranks: {result['seeds']} emulated runs per "
           f"configuration vs {result['runs']} simulated",
           "| config | F | interval (steps) | failures bench / sim | overhead bench | overhead sim "
           "| PLS bench | PLS sim | agree |", "|" + "---|" * 9]
    for r in result["rows"]:
        b, s = r["bench"], r["sim"]
        agree = "yes" if all(r["agree"].values()) else \
            "no (" + ", ".join(k for k, v in r["agree"].items() if not v) + ")"
        out.append(f"| {r['config']} | {r['fraction']:g} | {r['interval_steps']:.1f} "
                   f"(own {r['simulator_interval_steps']:.1f}) | {b['failures']:.2f} / "
                   f"{s['failures']:.2f} | {b['overhead']:.2%} ± {b['overhead_half']:.2%} | "
                   f"{s['overhead']:.2%} ± {s['overhead_half']:.2%} | {b['pls']:.4f} ± "
                   f"{b['pls_half']:.4f} | {s['pls']:.4f} ± {s['pls_half']:.4f} | {agree} |")
    return "\n".join(out)
