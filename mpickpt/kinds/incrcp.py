"""`incrcp`: consecutive increments kept in IncrCP's 2-D chunk store (IncrCP §4), with its cost
model for new baselines.

Each increment is written by the foreground writers as a column file in the chain directory
(`chains/<chain>/rank-<r>/col-<step>-part-<j>.h5`); once it is durable, a background extractor
process (`mpickpt.incrcp`) ingests it into the rank's 2-D lists. Checkpoint i is its baseline plus
the rectangle of chunks with column <= i that were current at i. A new baseline is taken when
C_base + R_base < C_incre + R_base + R_{i+1}, i.e. C_base < C_incre + R_{i+1}, with R_{i+1}
extrapolated linearly from the last two measured restores of the chain's checkpoints. Local.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpickpt.incrcp.client import ExtractorClient
from mpickpt.incrcp.held_bundle import HOLD_BYTES
from mpickpt.kinds.base import Increment, Kind
from mpickpt.store.chunk_index import check_named_files, load_index
from mpickpt.store.file_spec import column_relpath
from mpickpt.store.segments import Segment, merge_refs, whole_files

RESETS = ("cost", "never")
"""Baselines by IncrCP's cost model, or one chain for the whole run."""


@dataclass
class CostModel:
    """IncrCP's construction/recovery times (seconds; the slowest rank's after the allreduce)."""

    base_write: float = 0.0
    incr_write: float = 0.0
    restores: list[tuple[int, float]] = field(default_factory=list)
    """(checkpoint step, measured restore seconds of its increments) of the current chain."""

    def predicted_restore(self) -> float:
        """R_{i+1}: linear extrapolation of the last two measured restores. Local."""
        if not self.restores:
            return 0.0
        if len(self.restores) == 1:
            return self.restores[-1][1]
        (_, r0), (_, r1) = self.restores[-2:]
        return max(r1, r1 + (r1 - r0))


class Incrcp(Kind):
    """Consecutive increments in the chunk store; baselines from the cost model (or never)."""

    name = format = "incrcp"
    rng_in_extra_file = True

    def __init__(self, total_rows: int = 0, config=None):
        super().__init__(total_rows, config)
        reset = config.incrcp_reset if config is not None else "cost"
        if reset not in RESETS:
            raise ValueError(f"--incrcp-reset must be 'cost' or 'never', got {reset!r}")
        self.reset, self.cost = reset, CostModel()
        self.chain = ""

    def baseline_reason(self, chain, counts, reduce_max):
        if self.reset != "cost" or not chain.steps:
            return None
        c_base, c_incr, r_next = reduce_max(np.array(
            [self.cost.base_write, self.cost.incr_write, self.cost.predicted_restore()]))
        if c_base < c_incr + r_next:
            return (f"cost model: C_base {c_base:.3f} s < C_incre {c_incr:.3f} s + "
                    f"R_next {r_next:.3f} s")
        return None

    def chain_name(self, step, attempt):
        return f"chain-{step:012d}-{attempt}"

    def started(self, chain):
        self.chain, self.cost.restores = chain.name, []

    def increment(self, chain, step, changed, counts):
        # the chunk index, not earlier manifests, locates the earlier increments
        return Increment(changed, [chain.base_step], [*chain.steps, step])

    def record_write(self, full, seconds):
        if full:
            self.cost.base_write = seconds
        else:
            self.cost.incr_write = seconds

    def record_restore(self, chain, step, seconds):
        if chain and chain == self.chain:
            self.cost.restores.append((step, seconds))

    def companion(self, root, config, say, background):
        return Ingestion(root, config.incrcp_ratio, config.inject_extract_crash, say, config.align,
                         background, time_restore=self.reset == "cost", io=config.io,
                         hold=config.incrcp_hold)

    def shard_location(self, save, ckpt_id, rank, step, part):
        return column_relpath(save.chain, rank, step, part), "chunk"

    def segments(self, root, manifest, parents):
        return whole_files(parents[0]) + chunk_segments(root, manifest)

    def describe(self, root, manifest):
        return chunk_store(root, manifest)


def _restore_text(r: dict) -> str:
    seconds = r.get("restore_seconds")
    if seconds is None:
        return ""
    how = "timed" if r.get("restore_timed", True) else "scaled from the last timed one"
    return f"; restore of its increments {seconds * 1e3:.1f} ms ({how})"


def chain_columns(manifest) -> list[int]:
    """Steps of the incremental columns up to and including `manifest`. Local."""
    return [int(c) for c in manifest.stats.get("columns", [manifest.step])]


def chunk_segments(root: str, manifest) -> list[Segment]:
    """The 2-D lists' rectangle of a checkpoint over all writer ranks, column order; a column not
    ingested yet is read from its own (intact) column files. CheckpointCorruptError when a file
    the rectangle needs is missing (`check_named_files`). Local."""
    parts = int(manifest.stats.get("parts", 1))
    pieces = []
    for rank in range(manifest.world_size):
        index = load_index(root, manifest.chain, rank)
        rect = index.rectangle(manifest.step)
        check_named_files(root, index, rect)
        pieces += merge_refs(rect)
        for column in chain_columns(manifest):
            if column not in index.columns:
                pieces += [Segment(column_relpath(manifest.chain, rank, column, j), order=column)
                           for j in range(parts)]
    return sorted(pieces, key=lambda s: s.order)


def chunk_store(root: str, manifest) -> dict:
    """Per writer rank, the 2-D lists and this checkpoint's rectangle in them. Local."""
    ranks = {}
    for rank in range(manifest.world_size):
        index = load_index(root, manifest.chain, rank)
        rect = index.rectangle(manifest.step)
        ranks[str(rank)] = {
            "generation": index.generation, "columns": len(index.columns),
            "depth": {str(t): index.depth(t) for t in sorted(index.cells)},
            "files": len(index.refcounts()),
            "rectangle": {"chunks": len(rect), "rows": sum(r.rows for r in rect),
                          "files": len({r.file for r in rect})},
            "pending_columns": [c for c in manifest.stats.get("columns", [])
                                if c not in index.columns]}
    return {"chain": manifest.chain, "ranks": ranks}


class Ingestion:
    """The trainer's side of the extractor: one ingestion per durable increment, its answers
    logged and fed back into the cost model. Local."""

    def __init__(self, root: str, ratio: float, crash_at: int | None, say, align: int = 0,
                 background="idle", time_restore: bool = True, io: str = "buffered",
                 hold: int = HOLD_BYTES):
        """`time_restore`: whether the extractor reports R for the cost model (only baselines by
        cost read it; `incrcp.restore_probe` decides when it is timed). `io`: --ckpt-io, how
        the extractor writes its bundles. `background`: the extractor's priority and cores (a
        `mpickpt.background_priority.Background`, or a mode name). `hold`: --incrcp-hold,
        the bytes of a row-0 bundle the extractor may keep for the next ingestion."""
        self.root, self.crash_at, self.say, self.align = root, crash_at, say, align
        self.io, self.hold = io, hold
        self.time_restore = time_restore
        self.client = ExtractorClient(root, ratio, say, background)
        self.count = 0
        self.cpu_seconds = 0.0
        """CPU the extractor spent on the answered jobs (its start-up excluded)."""
        self.bytes_written = 0
        """Bundle bytes the extractor wrote in the ingestions that succeeded (a failed one's
        are not counted, its CPU is)."""

    def prioritize(self, background: str) -> None:
        """The extractor at `background` priority. Local."""
        self.client.prioritize(background)

    def written(self, rank: int, step: int, chain: str, parts: int, row_names,
                is_root: bool) -> None:
        """An increment is durable: hand it to the extractor. Local."""
        self.count += 1
        crash = self.crash_at == self.count and is_root
        self.client.submit({"root": self.root, "chain": chain, "rank": rank, "step": step,
                            "parts": parts, "row_names": sorted(row_names),
                            "crash_before_commit": crash, "align": self.align, "io": self.io,
                            "hold": self.hold, "time_restore": self.time_restore})

    def poll(self, kind: Kind, rank: int, drain: bool = False) -> None:
        """Take the extractor's answers (all queued ones with `drain`). Local."""
        answers = self.client.drain() if drain else self.client.poll()
        for r in answers:
            self.cpu_seconds += r.get("cpu_seconds", 0.0)
            if not r["ok"]:
                print(f"mpickpt: rank {rank}: incrcp {r['error']} (the checkpoint stays "
                      f"restorable from its chunk file)", flush=True)
                continue
            self.bytes_written += r["stats"]["bundle_bytes"]
            if r.get("restore_seconds") is not None:
                kind.record_restore(r["chain"], r["step"], r["restore_seconds"])
            self._log(r)

    def _log(self, r: dict) -> None:
        st = r["stats"]
        if st["compared"] or st["dropped_refs"]:
            self.say(f"incrcp step {r['step']}: compared {st['compared']} row-0 chunks "
                     f"(skipped by range {st['skipped_range']}, Bloom "
                     f"{st['skipped_bloom'] if st.get('bloom', True) else 'off'}, "
                     f"ratio {st['skipped_ratio']}), extracted {st['extracted_rows']} rows "
                     f"from {st['extracted_chunks']} chunks into "
                     f"{st['bundle_bytes'] / 1e6:.2f} MB of bundles, dropped "
                     f"{st['dropped_refs']} chunks, deleted {st['deleted_files']} files in "
                     f"{st['seconds']:.2f} s{_restore_text(r)}")

    def close(self) -> None:
        self.client.close()
