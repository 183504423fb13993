"""LocalChain: the checkpoint pipeline of every kind driven in one process, without MPI or a model
(a test and benchmark harness; not part of the package).

It writes exactly what the trainer's ranks would write (the same file specs through the same writer
code, the same planner, the same extraction and commit records), but synchronously and for all
ranks of a plan at once. The property tests and `bench/incremental_kinds.py` use it to write long
chains quickly and to restore any step through the production restore path. Local.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from mpickpt.checkpoint.load import load_checkpoint
from mpickpt.engine.snapshot import codec_fields
from mpickpt.engine.writer_process import write_file
from mpickpt.incrcp.extraction import Extractor
from mpickpt.incrcp.extractor_process import column_refs, time_restore
from mpickpt.kinds.base import SavePlan
from mpickpt.engine.config import CheckpointConfig
from mpickpt.kinds.planner import KindPlanner
from mpickpt.quant.codecs import Codec
from mpickpt.kinds.registry import kind_named
from mpickpt.store.chunk_index import load_index
from mpickpt.store.file_spec import FileSpec, dense_relpath, extra_spec, shard_attrs, shard_specs
from mpickpt.store.manifest import Manifest, apply_retention, list_manifests, write_manifest
from mpickpt.track.priority import make_tracker, shard_ranges


class RankState:
    """One rank's row state (numpy arrays) shaped like a model's `row_state()`. Local."""

    def __init__(self, plan, rank: int, dim: int, seed: int):
        self.plan, self.rank = plan, rank
        n = plan.local_rows(rank)
        rng = np.random.default_rng(seed + rank)
        self.arrays = {"weight": rng.standard_normal((n, dim)).astype(np.float32),
                       "state/sum": np.zeros(n, dtype=np.float32)}
        self.gids = plan.local_to_global(rank, np.arange(n))

    def row_state(self) -> dict:
        return self.arrays

    def update(self, rows: np.ndarray, rng) -> None:
        """A sparse optimizer step on `rows` (sorted unique local rows). Local."""
        self.arrays["weight"][rows] += rng.standard_normal(
            (len(rows), self.arrays["weight"].shape[1])).astype(np.float32)
        self.arrays["state/sum"][rows] += 1.0


class LocalChain:
    """Checkpoints of one policy for every rank of `plan`, written under `root`."""

    def __init__(self, root: str, plan, dim: int, policy: str, keep: int = 1000,
                 ratio: float = 0.02, seed: int = 0, parts: int = 1, incrcp_reset: str = "cost",
                 priority: str | None = None, save_fraction: float = 0.125, bits: int = 32):
        """`bits` < 32: the weights are stored with the adaptive codec at that width, as
        `--ckpt-bits` has the trainer's writers do (the optimizer state stays fp32)."""
        self.root, self.plan, self.dim, self.policy = root, plan, dim, policy
        self.codecs = {} if bits == 32 else {"weight": Codec(name="adaptive", bits=bits)}
        self.keep, self.parts = keep, parts
        self.ranks = [RankState(plan, r, dim, seed) for r in range(plan.world_size)]
        self.changed = [set() for _ in self.ranks]
        config = CheckpointConfig(directory=root, kind=policy, incrcp_ratio=ratio,
                                  incrcp_reset=incrcp_reset, priority=priority,
                                  save_fraction=save_fraction)
        total = int(sum(plan.table_sizes))
        self.planners = [KindPlanner(kind_named(config.kind, total, config), plan.local_rows(r),
                                     self._sum, self._max) for r in range(plan.world_size)]
        if priority is not None:  # what attach() does on a model: a tracker beside each shard
            for state, p in zip(self.ranks, self.planners):
                ranges = shard_ranges(plan, state.rank)
                p.kind.tracker = make_tracker(priority, len(state.gids), ranges, "cpu",
                                              save_fraction,
                                              torch.from_numpy(state.arrays["weight"]))
        self.last_plans: list = []
        self.extractors = [Extractor(root, ratio) for _ in self.ranks]
        self.indexes: dict = {}
        self.history: list[dict] = []
        self.extracted_rows = 0  # rows the extractors moved between chunks, all ingestions
        self.ingestions: list = []  # every ingestion's ExtractionStats, in order
        os.makedirs(root, exist_ok=True)

    # The planners of all ranks see global sums: each rank contributes in turn.
    def _sum(self, values):
        return self._global

    def _max(self, values):
        return values

    def touch(self, rank: int, rows: np.ndarray, rng) -> None:
        """Apply an update to local `rows` of `rank` and mark them as tracked. Local."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        self.ranks[rank].update(rows, rng)
        self.changed[rank].update(rows.tolist())
        tracker = getattr(self.planners[rank].kind, "tracker", None)
        if tracker is not None:
            tracker.observe(torch.from_numpy(rows), torch.ones(len(rows), dtype=torch.int64))

    def save(self, step: int) -> dict:
        """Checkpoint every rank at `step` (write, commit, ingest). Returns what was written."""
        changed = [np.array(sorted(c), dtype=np.int64) for c in self.changed]
        self.changed = [set() for _ in self.ranks]
        since = [p.state.since_base | _mask(len(p.state.since_base), c)
                 for p, c in zip(self.planners, changed)]
        self._global = np.array([sum(len(c) for c in changed), sum(int(s.sum()) for s in since)],
                                dtype=np.int64)
        plans = [p.plan(step, c, "local") for p, c in zip(self.planners, changed)]
        self.last_plans = plans
        start = time.perf_counter()
        files, nbytes = {}, 0
        for state, save in zip(self.ranks, plans):
            got, b = self._write_rank(state, step, save)
            files.update(got)
            nbytes += b
        files.update(self._write_dense(step))
        seconds = time.perf_counter() - start
        save = plans[0]
        manifest = Manifest(step=step, kind=save.kind, ckpt_id=_ckpt_id(step),
                            world_size=self.plan.world_size, dim=self.dim, plan=self.plan.describe(),
                            optimizer="adagrad", files=files, reader_state={}, parents=save.parents,
                            chain=save.chain, stats={"row_arrays": ["state/sum", "weight"],
                                                     "parts": self.parts, "policy": self.policy,
                                                     "bytes": nbytes, "decision": save.reason,
                                                     **({"columns": save.columns}
                                                        if save.columns else {})})
        write_manifest(self.root, manifest)
        apply_retention(self.root, self.keep)
        ingest = self._ingest(step, save) if save.kind == "incrcp" else 0.0
        for p in self.planners:
            p.record_write(save.kind, seconds)
        record = {"step": step, "kind": save.kind, "bytes": nbytes, "write_seconds": seconds,
                  "ingest_seconds": ingest,
                  "rows": sum(len(p.rows) if p.rows is not None else self.plan.local_rows(r)
                              for r, p in enumerate(plans))}
        self.history.append(record)
        return record

    def _write_rank(self, state: RankState, step: int, save: SavePlan):
        arrays = {"gids": state.gids, **state.arrays}
        specs = self._specs(state, step, save)
        files, nbytes = {}, 0
        for spec in specs:
            size, payload, crc = write_file(spec, arrays)
            nbytes += size
            if spec.role != "chunk":
                files[spec.relpath] = {**spec.meta, "size": size, "crc32": crc}
        return files, nbytes

    def _specs(self, state: RankState, step: int, save: SavePlan) -> list[FileSpec]:
        """The files a trainer rank writes for `save` (the same functions it uses). Local."""
        ckpt_id, fmt, rank = _ckpt_id(step), save.format, state.rank
        label = self.codecs["weight"].label() if self.codecs else "fp32"
        located = [fmt.shard_location(save, ckpt_id, rank, step, j) for j in range(self.parts)]
        specs = shard_specs(self.root, self.plan, rank, state.gids, list(state.arrays),
                            relpath_of=lambda j: located[j][0], role=located[0][1],
                            attrs_of=lambda j: shard_attrs(step, save.kind, label, rank, j,
                                                           self.parts, self.plan.world_size),
                            selected=save.rows, parts=self.parts,
                            codecs={k: codec_fields(c) for k, c in self.codecs.items()})
        if fmt.rng_in_extra_file:
            specs.insert(0, extra_spec(self.root, ckpt_id, rank, step, save.kind, {}))
        return specs

    def _write_dense(self, step: int) -> dict:
        spec = FileSpec(self.root, dense_relpath(_ckpt_id(step)), "dense", 0, 0,
                        {"step": step}, datasets=[("dense/param/w", "dense/param/w", None)])
        size, _, crc = write_file(spec, {"dense/param/w": np.full(4, step, dtype=np.float32)})
        return {spec.relpath: {**spec.meta, "size": size, "crc32": crc}}

    def _ingest(self, step: int, save: SavePlan) -> float:
        start = time.perf_counter()
        retained = [m.step for m in list_manifests(self.root) if m.chain == save.chain]
        for rank, extractor in enumerate(self.extractors):
            key = (save.chain, rank)
            if key not in self.indexes:
                self.indexes[key] = load_index(self.root, save.chain, rank)
            reader = extractor.reader()  # as the extractor process: columns opened once
            refs = column_refs(self.root, save.chain, rank, step, self.parts, reader.file)
            stats = extractor.ingest(self.indexes[key], step, refs, ["state/sum", "weight"],
                                     retained, reader=reader)
            self.extracted_rows += stats.extracted_rows
            self.ingestions.append(stats)
        seconds = time.perf_counter() - start
        restore = max(time_restore(self.root, self.indexes[(save.chain, r)], step,
                                   ["state/sum", "weight"]) for r in range(len(self.ranks)))
        for p in self.planners:
            p.record_restore(save.chain, step, restore)
        return seconds

    def snapshot(self) -> list[dict]:
        """A copy of every rank's arrays (the expected state at the current step). Local."""
        return [{k: v.copy() for k, v in r.arrays.items()} for r in self.ranks]

    def restore(self, step: int, plan=None) -> tuple[list[dict], float]:
        """Every rank's rows of checkpoint `step` (under `plan`, default the writing plan) through
        the production restore path, and the seconds it took. Local."""
        plan = plan or self.plan
        manifests = {m.step: m for m in list_manifests(self.root)}
        templates = {"weight": ((self.dim,), np.dtype(np.float32)),
                     "state/sum": ((), np.dtype(np.float32))}
        start = time.perf_counter()
        out = [load_checkpoint(self.root, manifests[step], plan, r, self.dim, templates,
                               manifests).rows for r in range(plan.world_size)]
        return out, time.perf_counter() - start


def _mask(n: int, rows: np.ndarray) -> np.ndarray:
    m = np.zeros(n, dtype=bool)
    m[rows] = True
    return m


def _ckpt_id(step: int) -> str:
    return f"step-{step:012d}-local"
