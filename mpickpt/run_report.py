"""RunReport: what a training run did, as JSON for benchmarks (`--run-report PATH`, rank 0).

Per executed step its training step and loss (replays after a rollback appear again), the time of
the step and when it ended (seconds since the report began: the differences between steps hold
everything the loop did between them, reading and checkpoint calls too), every checkpoint save's
cost (foreground, and its background write until commit), every loss of shards with its recovery
(policy, the step training went on from, seconds), the final test metrics, PLS, and the interval
planner's history. Local: rank 0 keeps and writes it; the other ranks keep nothing.
"""
from __future__ import annotations

import json
import os
import resource
import time


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's children that have ended (the checkpoint
    writers and the IncrCP extractor, once the checkpoint manager has closed). Local."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class RunReport:
    """Collects one run's events (on every rank where a path is given; rank 0 writes them).
    Local."""

    def __init__(self, path: str | None, is_root: bool, start_step: int):
        """Every rank keeps the record where a `path` is given (a replacement of rank 0 goes on
        from a survivor's: `record`, `adopt`); rank 0 writes it."""
        self.path, self.is_root = path, is_root
        self.started = time.perf_counter()
        self.doc = {"start_step": start_step, "steps": [], "recoveries": [], "tests": []}

    @property
    def on(self) -> bool:
        return self.path is not None

    def record(self) -> dict:
        """The events so far and the seconds since this process's record began. Local."""
        return {"doc": self.doc, "seconds": time.perf_counter() - self.started}

    def adopt(self, record: dict) -> None:
        """Go on from another rank's `record` (this process replaces rank 0, which kept the
        run's): its events, and its clock. Local."""
        self.doc = record["doc"]
        self.started = time.perf_counter() - record["seconds"]

    def step(self, step: int, loss: float, seconds: float) -> None:
        if self.on:
            self.doc["steps"].append([step, loss, seconds, time.perf_counter() - self.started])

    def looped(self, seconds: float) -> None:
        """The training loop's wall time (steps, reading, checkpoint calls; not start-up or the
        run's end), summed over its passes."""
        if self.on:
            self.doc["loop_seconds"] = self.doc.get("loop_seconds", 0.0) + seconds

    def recovered(self, loss, outcome, seconds: float, executed: int) -> None:
        if self.on:
            self.doc["recoveries"].append({
                "after_step": loss.after_step, "executed": executed, "policy": outcome.policy,
                "resumed_at": outcome.step, "replayed": loss.after_step - outcome.step,
                "seconds": seconds, "shards": [[s.rank, s.start, s.stop] for s in loss.shards]})

    def tested(self, step: int, result) -> None:
        if self.on and result is not None:
            self.doc["tests"].append({"step": step, "auc": result.auc,
                                      "logloss": result.logloss, "samples": result.samples})

    def finish(self, trainer) -> None:
        """Add the totals and write the file (temp + rename) on rank 0. Local."""
        if not self.on or not self.is_root:
            return
        d = self.doc
        d["wall_seconds"] = time.perf_counter() - self.started
        d["world_size"] = trainer.topo.world_size
        d["global_batch"] = trainer.config.global_batch
        d["num_batches"] = trainer.config.num_batches
        d["skipped_lines"] = trainer.skipped_lines()
        ft = trainer.faults
        d["pls"] = {"value": ft.pls.value, "events": ft.pls.events}
        d["mode"] = ft.mode
        d["plans"] = ft.planner.history
        d["failures"] = len(ft.emulator.fired) if ft.emulator is not None else \
            len(d["recoveries"])
        if trainer.ckpt is not None:
            d["save_seconds"] = trainer.ckpt.save_seconds
            d["write_seconds"] = trainer.ckpt.write_seconds
            d["write_cpu_seconds"] = trainer.ckpt.write_cpu_seconds
            d["write_bytes"] = trainer.ckpt.write_bytes
            d["background_cpu_seconds"] = children_cpu_seconds()
            d["companion_cpu_seconds"] = trainer.ckpt.incremental.companion_cpu_seconds
            d["companion_bytes"] = trainer.ckpt.incremental.companion_bytes
            copier = trainer.ckpt.copier
            d["copy_cpu_seconds"] = copier.cpu_seconds if copier is not None else 0.0
            d["restore_seconds"] = trainer.restorer.seconds
            d["checkpoints"] = trainer.ckpt.counters["saved"]
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(d, f)
        os.replace(tmp, self.path)
