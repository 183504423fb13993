"""Snapshot: copy a rank's state into the staging area, and describe the files to write from it."""
from __future__ import annotations

import os
import time

import numpy as np
import torch

from mpickpt.engine.staging import StagingArea


def state_specs(model, with_dense: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every staged array: row state, global ids, and dense state. Local."""
    specs = {name: (tuple(t.shape), numpy_dtype(t)) for name, t in model.row_state().items()}
    specs["gids"] = ((len(model.embeddings.local_gids),), "int64")
    if with_dense:
        specs.update({f"dense/{k}": (tuple(t.shape), numpy_dtype(t))
                      for k, t in model.dense_state().items()})
    return specs


def numpy_dtype(t: torch.Tensor) -> str:
    """numpy dtype name of a torch tensor. Local."""
    return str(torch.empty(0, dtype=t.dtype).numpy().dtype)


class Snapshotter:
    """Owns the staging area of one rank and copies state into it (the only training stall)."""

    def __init__(self, model, with_dense: bool):
        self.model, self.with_dense = model, with_dense
        self.area: StagingArea | None = None
        cuda = model.topo.device.type == "cuda"
        self._stream = torch.cuda.Stream() if cuda else None

    def prepare(self) -> None:
        """Allocate the staging area for the current state shapes (if they changed). Local."""
        specs = state_specs(self.model, self.with_dense)
        if self.area is None or not self.area.matches(specs):
            self._reallocate(specs)

    def stage(self) -> tuple[float, int]:
        """Copy all state into staging; returns (seconds, bytes). Local."""
        self.prepare()
        sources = dict(self.model.row_state())
        if self.with_dense:
            sources.update({f"dense/{k}": t for k, t in self.model.dense_state().items()})
        start = time.perf_counter()
        nbytes = self._copy(sources)
        return time.perf_counter() - start, nbytes

    def _reallocate(self, specs) -> None:
        if self.area is not None:
            self.area.close()
        self.area = StagingArea(specs, pin_for_cuda=self._stream is not None)
        self.area.arrays["gids"][:] = self.model.embeddings.local_gids

    def _copy(self, sources: dict[str, torch.Tensor]) -> int:
        targets = self.area.tensors()
        if self._stream is None:
            for name, src in sources.items():
                targets[name].copy_(src)
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for name, src in sources.items():
                    targets[name].copy_(src, non_blocking=True)
            self._stream.synchronize()
        return sum(t.numel() * t.element_size() for t in sources.values())

    def close(self) -> None:
        if self.area is not None:
            self.area.close()
            self.area = None


def part_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split local rows [0, n) into `parts` contiguous ranges. Local."""
    return [(n * j // parts, n * (j + 1) // parts) for j in range(parts)]


def shard_file_specs(model, root: str, ckpt_id: str, step: int, parts: int, rng: dict,
                     save=None, codecs: dict | None = None) -> list[dict]:
    """One file spec per writer part: per table, the part's rows of every row array. Local.

    `save` (a SavePlan) selects rows for incremental kinds; incrcp chunks go to the chain's
    directory, and the RNG states then travel in a small per-rank ``extra`` file of the step.
    `codecs` maps row-array names to the lossy Codec the writer encodes them with."""
    plan, rank = model.plan, model.topo.rank
    names = ["gids", *model.row_state()]
    kind = save.kind if save is not None else "full"
    selected = save.rows if save is not None and not save.is_full else None
    codecs = codecs or {}
    encode = {name: {k: v for k, v in vars_of(c).items() if k != "threads"}
              for name, c in codecs.items()}
    label = codecs["weight"].label() if "weight" in codecs else "fp32"
    specs = []
    for j, (a, b) in enumerate(part_bounds(plan.local_rows(rank), parts)):
        datasets, groups = [], {}
        gids = model.embeddings.local_gids
        for s in plan.shards_of(rank):
            lo, hi = max(a, s.local_start), min(b, s.local_start + s.rows)
            if lo >= hi:
                continue
            sel = [(lo, hi)] if selected is None else _rows_within(selected, lo, hi)
            if selected is not None and len(sel) == 0:
                continue
            first, last = (lo, hi - 1) if selected is None else (int(sel[0]), int(sel[-1]))
            group = f"tables/{s.table}"
            groups[group] = {"gid_min": int(gids[first]), "gid_max": int(gids[last])}
            datasets += [(f"{group}/{name}", name, sel) for name in names]
        if kind == "incrcp":
            from mpickpt.incrcp.index import column_relpath
            rel = column_relpath(save.chain, rank, step, j)
        else:
            rel = f"{ckpt_id}/rank-{rank:05d}-part-{j}.h5"
        specs.append({"path": os.path.join(root, rel), "relpath": rel, "datasets": datasets,
                      "group_attrs": groups, "blobs": rng if j == 0 and kind != "incrcp" else {},
                      "codecs": encode,
                      "meta": {"role": "chunk" if kind == "incrcp" else "shard", "rank": rank,
                               "part": j},
                      "attrs": {"step": step, "kind": kind, "codec": label, "rank": rank,
                                "part": j, "parts": parts, "world_size": plan.world_size}})
    if kind == "incrcp":
        rel = f"{ckpt_id}/rank-{rank:05d}-extra.h5"
        specs[0:0] = [{"path": os.path.join(root, rel), "relpath": rel, "datasets": [],
                       "group_attrs": {}, "blobs": rng,
                       "meta": {"role": "extra", "rank": rank, "part": 0},
                       "attrs": {"step": step, "kind": kind, "rank": rank}}]
    return specs


def vars_of(codec) -> dict:
    """A Codec's fields as a plain dict (what the writer process rebuilds it from). Local."""
    from dataclasses import asdict

    return asdict(codec)


def _rows_within(rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The sorted `rows` in [lo, hi). Local."""
    i0, i1 = np.searchsorted(rows, [lo, hi])
    return rows[i0:i1]


def dense_file_spec(model, root: str, ckpt_id: str, step: int) -> dict:
    """The replicated dense state, written once (by rank 0's last writer). Local."""
    rel = f"{ckpt_id}/dense.h5"
    names = [f"dense/{k}" for k in model.dense_state()]
    return {"path": os.path.join(root, rel), "relpath": rel, "group_attrs": {},
            "datasets": [(name, name, None) for name in names], "blobs": {},
            "meta": {"role": "dense", "rank": 0, "part": 0},
            "attrs": {"step": step, "kind": "full", "codec": "fp32",
                      # dense/opt/<i> is numbered in this parameter order
                      "param_order": [n for n, _ in model.dense.named_parameters()]}}


def rng_blobs() -> dict[str, bytes]:
    """This process's RNG states as bytes (torch CPU, and CUDA when present). Local."""
    blobs = {"extra/torch_cpu_rng": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        blobs["extra/torch_cuda_rng"] = torch.cuda.get_rng_state().numpy().tobytes()
    return blobs
