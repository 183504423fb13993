"""Restore: find the newest valid checkpoint (or a chosen step) and load this rank's rows.

Incremental kinds are restored by applying their layers (`mpickpt.store.layers`) in order.
Shards are keyed by global row id, so a checkpoint written by N ranks loads onto M ranks: every rank
computes the global-id ranges it owns under the *current* plan and reads, from each shard file, only
the rows in those ranges (plus the checksum blocks around them).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from mpickpt.store.errors import CheckpointError
from mpickpt.store.layers import (GAP, Segment, SegmentReader, checkpoint_segments, newest_rows,
                                   parent_manifests)
from mpickpt.store.manifest import Manifest, list_manifests, torn_dirs
from mpickpt.store.shard_file import open_shard, read_all


@dataclass
class LoadedState:
    """One rank's part of a checkpoint, ready to apply to the model."""

    step: int
    rows: dict[str, np.ndarray]
    dense: dict[str, np.ndarray]
    rng: dict[str, bytes]
    manifest: Manifest


def check_files(root: str, manifest: Manifest, paths=None) -> None:
    """Every listed file exists with the size the manifest records. Local."""
    for rel in paths if paths is not None else manifest.files:
        path = os.path.join(root, rel)
        if not os.path.exists(path):
            raise CheckpointError(f"{path}: file of checkpoint step {manifest.step} is missing")
        size, want = os.path.getsize(path), manifest.files[rel]["size"]
        if size != want:
            raise CheckpointError(f"{path}: {size} bytes, the manifest of step {manifest.step} "
                                  f"records {want} (truncated or overwritten)")


def check_compatible(manifest: Manifest, plan, dim: int, row_names) -> None:
    """The checkpoint fits the model being restored. Local."""
    if list(manifest.plan["table_sizes"]) != list(plan.table_sizes):
        raise CheckpointError(f"checkpoint step {manifest.step} has tables "
                              f"{manifest.plan['table_sizes']}, the model has {list(plan.table_sizes)}")
    if manifest.dim != dim:
        raise CheckpointError(f"checkpoint step {manifest.step} has embedding dimension "
                              f"{manifest.dim}, the model has {dim}")
    saved = sorted(manifest.stats.get("row_arrays", []))
    if saved and saved != sorted(row_names):
        raise CheckpointError(f"checkpoint step {manifest.step} saved {saved} per row "
                              f"(optimizer {manifest.optimizer}); the model needs {sorted(row_names)}")


def owned_ranges(plan, rank: int) -> list[tuple[int, int, int, int]]:
    """(table, first global id, end global id, first local row) of each shard of `rank`. Local."""
    off = plan.table_offsets
    return [(s.table, int(off[s.table] + s.row_start), int(off[s.table] + s.row_end), s.local_start)
            for s in plan.shards_of(rank)]


def load_rows(root: str, segments: list[Segment], plan, rank: int, templates: dict,
              step: int, complete: bool = True) -> dict:
    """This rank's rows under `plan` from `segments`; where several hold a row, the highest
    order (newest step) wins. Local.

    `templates` maps row-array names to (shape tail, dtype). With `complete`, every row must come
    from some segment (benchmarks read an incremental checkpoint's increments alone)."""
    n = plan.local_rows(rank)
    out = {k: np.empty((n, *tail), dtype=dt) for k, (tail, dt) in templates.items()}
    newest = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    ranges = owned_ranges(plan, rank)
    with SegmentReader(root) as reader:
        for seg in segments:
            for table, group, start, stop, gmin, gmax in reader.groups(seg):
                mine = [r for r in ranges if table in (r[0], -1) and gmax >= r[1] and gmin < r[2]]
                if not mine or stop <= start:
                    continue
                gids = reader.gids(seg, group, start, stop)
                if seg.runs:
                    _apply_merged(reader, seg, group, start, gids, mine, out, newest)
                else:
                    _apply_sorted(reader, seg, group, start, gids, mine, out, newest)
    if complete and (newest == np.iinfo(np.int64).min).any():
        missing = np.nonzero(newest == np.iinfo(np.int64).min)[0]
        raise CheckpointError(f"checkpoint step {step} lacks {missing.size} rows of rank {rank}, "
                              f"e.g. global ids {plan.local_to_global(rank, missing[:5]).tolist()}")
    return out


def _apply_sorted(reader, seg, group, start, gids, mine, out, newest) -> None:
    """A segment with ascending gids: read only the owned ranges. Local."""
    for _, g0, g1, local0 in mine:
        i0, i1 = (int(i) for i in np.searchsorted(gids, [g0, g1]))
        if i1 > i0:
            local = local0 + gids[i0:i1] - g0
            keep = seg.order >= newest[local]
            if not keep.any():
                continue
            for name in out:
                out[name][local[keep]] = reader.rows(seg, group, name, start + i0, start + i1)[keep]
            newest[local[keep]] = seg.order


def _apply_merged(reader, seg, group, start, gids, mine, out, newest) -> None:
    """Adjacent chunks read in one go: select owned rows, newest value per row. Local."""
    orders = seg.row_orders(len(gids))
    local = np.full(len(gids), -1, dtype=np.int64)
    for _, g0, g1, local0 in mine:
        inside = (gids >= g0) & (gids < g1)
        local[inside] = local0 + gids[inside] - g0
    pos = np.nonzero((local >= 0) & (orders != GAP))[0]
    pos = pos[newest_rows(gids[pos], orders[pos])]
    pos = pos[orders[pos] >= newest[local[pos]]]
    if pos.size == 0:
        return
    for name in out:
        out[name][local[pos]] = reader.rows(seg, group, name, start, start + len(gids))[pos]
    newest[local[pos]] = orders[pos]


def load_dense(root: str, manifest: Manifest) -> dict[str, np.ndarray]:
    """Every dataset under /dense of the dense file, verified. Local."""
    path = os.path.join(root, manifest.dense_file())
    out = {}
    with open_shard(path) as f:
        names: list[str] = []
        f["dense"].visititems(lambda n, o: names.append(n) if hasattr(o, "shape")
                              and not n.endswith(".crc") else None)
        for name in names:
            out[name] = read_all(f["dense"][name], path)
    return out


def load_rng(root: str, manifest: Manifest, rank: int) -> dict[str, bytes]:
    """RNG states saved by the same rank number, if that rank existed. Local."""
    for rel, meta in manifest.files.items():
        if meta["role"] in ("shard", "extra") and meta["rank"] == rank and meta["part"] == 0:
            path = os.path.join(root, rel)
            with open_shard(path) as f:
                extra = f.get("extra")
                return {} if extra is None else {k: read_all(extra[k], path).tobytes()
                                                 for k in extra if not k.endswith(".crc")}
    return {}


def load_checkpoint(root: str, manifest: Manifest, plan, rank: int, dim: int,
                    templates: dict, by_step: dict[int, Manifest] | None = None) -> LoadedState:
    """Everything this rank needs from one checkpoint of any kind; CheckpointError on any problem.

    `by_step` holds the committed manifests an incremental checkpoint builds on. Local."""
    check_compatible(manifest, plan, dim, templates)
    by_step = by_step or {}
    for m in [*parent_manifests(manifest, by_step), manifest]:
        check_files(root, m)
    segments = checkpoint_segments(root, manifest, by_step)
    rows = load_rows(root, segments, plan, rank, templates, manifest.step)
    return LoadedState(manifest.step, rows, load_dense(root, manifest),
                       load_rng(root, manifest, rank), manifest)


def committed(root: str) -> tuple[list[Manifest], list[str]]:
    """(committed manifests oldest first, torn checkpoint directories). Local."""
    manifests = list_manifests(root)
    return manifests, torn_dirs(root, manifests)
