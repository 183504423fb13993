"""Load: one rank's part of a committed checkpoint of any kind (rows, dense state, RNG states).

Incremental kinds are restored by applying their segments (`mpickpt.kinds`) in order.
Shards are keyed by global row id, so a checkpoint written by N ranks loads onto M ranks: every rank
computes the global-id ranges it owns under the *current* plan and reads, from each shard file, only
the rows in those ranges (plus the checksum blocks around them).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from mpickpt.checkpoint.identity import IdentityCheck
from mpickpt.kinds.registry import checkpoint_segments, format_of
from mpickpt.store.dense_file import dense_arrays
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, list_manifests, parent_manifests, torn_dirs
from mpickpt.store.segments import load_rows, segment_files, wanted_files
from mpickpt.store.shard_file import OpenShards, open_shard, read_all


@dataclass
class LoadedState:
    """One rank's part of a checkpoint, ready to apply to the model."""

    step: int
    rows: dict[str, np.ndarray]
    dense: dict[str, np.ndarray]
    rng: dict[str, bytes]
    manifest: Manifest


def check_files(root: str, manifest: Manifest, paths=None) -> None:
    """Every listed file (of `paths`; None: all) exists with the size the manifest records;
    CheckpointError with the first that does not. Local."""
    from mpickpt.store.catalog import file_problem_messages

    found = file_problem_messages(root, manifest, paths)
    if found:
        raise CheckpointError(found[0])


def check_read_files(root: str, manifest: Manifest, by_step: dict, segments, plan, rank: int,
                     rows: tuple[int, int] | None = None) -> None:
    """`check_files` over the files of `manifest` and its parents that this rank's load reads:
    the segments it opens, the dense files and its own shard and extra files (RNG states).
    Another rank's files are its reader's to check (a restore agrees on every rank's error), so
    N ranks make N checks of a file each, not N^2. Local."""
    read = wanted_files(segments, plan, rank, rows)
    for m in [*parent_manifests(manifest, by_step), manifest]:
        check_files(root, m, [rel for rel, meta in m.files.items()
                              if rel in read or meta["role"] == "dense"
                              or meta.get("rank") == rank])


def usable_problems(root: str, manifest: Manifest, by_step: dict[int, Manifest]) -> list[str]:
    """What stops `manifest`'s checkpoint from being read, without reading rows: its listed
    files' existence and sizes (`store.catalog.file_problem_messages`), then its layers: the
    manifests it builds on, an IncrCP chunk index that reads, and every file its segments name
    (chain files no manifest lists). Local."""
    from mpickpt.store.catalog import file_problem_messages, missing_message

    found = file_problem_messages(root, manifest)
    if found:
        return found
    try:
        segments = checkpoint_segments(root, manifest, by_step)
        for m in parent_manifests(manifest, by_step):
            found += file_problem_messages(root, m)
    except (CheckpointError, OSError, ValueError) as e:
        return [str(e)]
    paths = [os.path.join(root, rel) for rel in segment_files(segments)]
    return found + [missing_message(p, manifest.step) for p in paths if not os.path.isfile(p)]


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
                              f"(optimizer {manifest.optimizer}); this model keeps "
                              f"{sorted(row_names)}: a checkpoint of another --model or "
                              f"--optimizer")


def load_dense(root: str, manifest: Manifest, files: OpenShards | None = None
               ) -> dict[str, np.ndarray]:
    """Every array under /dense of the dense file (`store.dense_file`: packed, or one dataset
    each in formats 1 and 2), verified. `files`: where the file is opened (kept open there),
    else opened and closed here. Local."""
    path = os.path.join(root, manifest.dense_file())
    with _opened(path, files) as f:
        if "dense" not in f:
            raise CheckpointError(f"{path}: has no /dense group")
        return dense_arrays(f, path)


def load_rng(root: str, manifest: Manifest, rank: int, files: OpenShards | None = None
             ) -> dict[str, bytes]:
    """RNG states saved by the same rank number, if that rank existed (`files`: as
    `load_dense`'s). Local."""
    for rel, meta in manifest.files.items():
        if meta["role"] in ("shard", "extra") and meta["rank"] == rank and meta["part"] == 0:
            path = os.path.join(root, rel)
            with _opened(path, files) as f:
                extra = f.get("extra")
                return {} if extra is None else {k: read_all(extra[k], path).tobytes()
                                                 for k in extra if not k.endswith(".crc")}
    return {}


def load_checkpoint(root: str, manifest: Manifest, plan, rank: int, dim: int,
                    templates: dict, by_step: dict[int, Manifest] | None = None,
                    into: dict | None = None) -> LoadedState:
    """Everything this rank needs from one checkpoint of any kind; CheckpointError on any problem.

    `by_step` holds the committed manifests an incremental checkpoint builds on. `into`: the
    arrays the rows are read straight into (`segments.load_rows`); the state's rows are then
    those arrays. Local."""
    check_compatible(manifest, plan, dim, templates)
    by_step = by_step or {}
    segments = checkpoint_segments(root, manifest, by_step)
    check_read_files(root, manifest, by_step, segments, plan, rank)
    # a rank's own shard holds its rows and its RNG states; every listed file it opens must be
    # the one its manifest wrote (not another checkpoint's of the same size)
    with OpenShards(IdentityCheck(root, manifest, by_step)) as files:
        rows = load_rows(root, segments, plan, rank, templates, manifest.step,
                         opener=files.open, into=into)
        return LoadedState(manifest.step, rows, load_dense(root, manifest, files),
                           load_rng(root, manifest, rank, files), manifest)


def _opened(path: str, files: OpenShards | None):
    """The shard at `path`, as a context: kept open in `files` when given, else closed at
    exit. Local."""
    return contextlib.nullcontext(files.open(path)) if files is not None else open_shard(path)


def load_row_range(root: str, manifest: Manifest, plan, rank: int, dim: int, templates: dict,
                   by_step: dict[int, Manifest], rows: tuple[int, int]):
    """Local rows [rows[0], rows[1]) of `rank` from one checkpoint of any kind (partial recovery),
    and the step each row's value is from: the checkpoint's step for exact kinds, the step of the
    save that wrote it for prioritized saves (rows skipped since keep an older value).
    CheckpointError on any problem. Local."""
    check_compatible(manifest, plan, dim, templates)
    segments = checkpoint_segments(root, manifest, by_step)
    check_read_files(root, manifest, by_step, segments, plan, rank, rows)
    with OpenShards(IdentityCheck(root, manifest, by_step)) as files:
        arrays, written = load_rows(root, segments, plan, rank, templates, manifest.step,
                                    rows=rows, with_steps=True, opener=files.open)
    if format_of(manifest).exact:
        written = np.full(len(written), manifest.step, dtype=np.int64)
    return arrays, written


def committed(root: str) -> tuple[list[Manifest], list[str], list[tuple[int, str]]]:
    """(committed manifests oldest first, torn checkpoint directories, (step, message) of every
    damaged or unreadable manifest). Local."""
    damaged: list[tuple[int, str]] = []
    manifests = list_manifests(root, damaged)
    return manifests, torn_dirs(root, manifests), damaged
