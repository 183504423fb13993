"""Verify: everything that can be checked about a committed checkpoint without a model.

- files: every file the manifest lists exists with the recorded size;
- checksums: every dataset of every file matches its per-block CRCs (`verify_file`);
- structure: file attributes match the manifest, every table group holds gids and the row arrays
  with equal row counts and the manifest's embedding dimension, the dense file has parameters;
- coverage: over all shard files, the gids of table t are exactly its global ids, each once.

Every function returns a list of problems (strings naming the file, dataset or table); empty means
sound. A `VerifySession` shared by the checks of several checkpoints opens each file once and reads
its checksums once (`verify_session`). Local: nothing here uses MPI. Memory: the global ids read,
8 bytes a row, up to the session's budget.
"""
from __future__ import annotations

import os

import numpy as np

from mpickpt.kinds.registry import checkpoint_segments, format_of
from mpickpt.checkpoint.identity import identity_problems
from mpickpt.checkpoint.verify_session import VerifySession
from mpickpt.store.catalog import file_problem_messages, file_problems
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, list_manifests, parent_manifests
from mpickpt.store.segments import GAP, SegmentReader, segment_files
from mpickpt.store.dense_file import dense_listing
from mpickpt.store.tables import (READ_ERRORS, TablePiece, error_text, row_array_names,
                                  stored_row_arrays, table_offsets, table_pieces)


def verify_checkpoint(root: str, manifest: Manifest, session: VerifySession | None = None,
                      by_step: dict[int, Manifest] | None = None) -> list[str]:
    """All problems of one checkpoint (files, checksums, structure, coverage); `by_step`, the
    directory's committed manifests, saves listing them again. Local."""
    if session is None:
        with VerifySession() as own:
            return verify_checkpoint(root, manifest, own, by_step)
    try:
        layered = format_of(manifest).layered
    except CheckpointError as e:
        return manifest_problems(root, manifest) + [str(e)]
    if layered:
        return verify_layered(root, manifest, session, by_step)
    problems = manifest_problems(root, manifest) + file_problem_messages(root, manifest)
    bad = {rel for rel, _ in file_problems(root, manifest)}
    present = [rel for rel in sorted(manifest.files) if rel not in bad]
    crcs = {os.path.join(root, rel): manifest.files[rel].get("crc32") for rel in present}
    session.prefetch(list(crcs), crcs)
    for path, crc in crcs.items():
        problems += session.checksums(path, crc)
    index: dict[int, list[str]] = {}
    for rel in (r for r in manifest.shard_files() if r not in bad):
        problems += shard_structure(root, rel, manifest, index, session)
    unreadable = [rel for rel in manifest.shard_files() if rel in bad]
    problems += coverage(manifest, index, unreadable, session)
    for rel in (r for r in present if manifest.files[r]["role"] == "dense"):
        problems += dense_structure(os.path.join(root, rel), session)
    return dedupe(problems)


def manifest_problems(root: str, manifest: Manifest) -> list[str]:
    """The manifest's own consistency: plan, ranks, and exactly one dense file. Local."""
    where = os.path.join(root, f"manifest-{manifest.step:012d}.json")
    out = []
    if manifest.plan.get("world_size", manifest.world_size) != manifest.world_size:
        out.append(f"{where}: world_size {manifest.world_size} but the plan is for "
                   f"{manifest.plan['world_size']} ranks")
    dense = [k for k, v in manifest.files.items() if v["role"] == "dense"]
    if len(dense) != 1:
        out.append(f"{where}: lists {len(dense)} dense files, expected 1")
    ranks = {v.get("rank") for v in manifest.files.values() if v["role"] == "shard"}
    if ranks - set(range(manifest.world_size)):
        out.append(f"{where}: shard files of ranks {sorted(ranks - set(range(manifest.world_size)))}"
                   f" outside world size {manifest.world_size}")
    return out


def shard_structure(root: str, rel: str, manifest: Manifest, index: dict[int, list[str]],
                    session: VerifySession) -> list[str]:
    """Attributes, groups, row counts and dims of one shard file; adds its tables to `index`. Local."""
    path = os.path.join(root, rel)
    try:
        f = session.open(path)
        out = identity_problems(path, dict(f.attrs).get, manifest.files[rel], manifest)
        pieces = table_pieces(f)
        for group in dict.fromkeys(p.group.name for p in pieces):  # a packed file's one group
            out += group_problems(path, f[group], manifest)
        for piece in pieces:
            out += piece_problems(path, piece, manifest)
            listed = index.setdefault(piece.table, [])
            if path not in listed:  # a file may hold two shards of a table (from_shards plans)
                listed.append(path)
        return out
    except READ_ERRORS as e:
        return [error_text(path, e)]


def piece_problems(path: str, piece: TablePiece, manifest: Manifest) -> list[str]:
    """One table's rows: a table of the manifest, with its gid range attributes. Local."""
    where = f"{path}: {piece.where}"
    if piece.table >= len(manifest.plan["table_sizes"]):
        return [f"{where}: the manifest has only {len(manifest.plan['table_sizes'])} tables"]
    return [f"{where}: attribute {a} is missing" for a, v in
            (("gid_min", piece.gid_min), ("gid_max", piece.gid_max)) if v is None]


def group_problems(path: str, group, manifest: Manifest) -> list[str]:
    """One group of row arrays: expected datasets, equal row counts, the manifest's dim. Local."""
    where = f"{path}: group {group.name}"
    datasets = stored_row_arrays(group, path)
    expected = ["gids", *row_array_names(manifest)]
    out = [f"{where}: dataset {n} is missing" for n in expected if n not in datasets]
    out += [f"{where}: unexpected dataset {n}" for n in sorted(set(datasets) - set(expected))]
    if "gids" not in datasets:
        return out
    n = datasets["gids"].shape[0]
    for name, ds in sorted(datasets.items()):
        if ds.shape[0] != n:
            out.append(f"{where}: dataset {name} has {ds.shape[0]} rows, gids has {n}")
        if name != "gids" and len(ds.shape) > 1 and tuple(ds.shape[1:]) != (manifest.dim,):
            out.append(f"{where}: dataset {name} has row shape {tuple(ds.shape[1:])}, the "
                       f"manifest's dim is {manifest.dim}")
    if "weight" in datasets and len(datasets["weight"].shape) != 2:
        out.append(f"{where}: dataset weight has shape {datasets['weight'].shape}, expected "
                   f"(rows, {manifest.dim})")
    return out


def coverage(manifest: Manifest, index: dict[int, list[str]], unreadable: list[str],
             session: VerifySession) -> list[str]:
    """Per table: the union of gids over all shard files is every global id once. Local."""
    offsets = table_offsets(manifest)
    hint = f" (missing or damaged shard files: {', '.join(unreadable)})" if unreadable else ""
    out = []
    for t in range(len(offsets) - 1):
        out += table_coverage(t, int(offsets[t]), int(offsets[t + 1]), index.get(t, []), hint,
                              session)
    return out


def table_coverage(table: int, g0: int, g1: int, paths: list[str], hint: str,
                   session: VerifySession) -> list[str]:
    """Coverage of global ids [g0, g1) of one table by the gids of `paths`. Local."""
    counts = np.zeros(g1 - g0, dtype=np.int64)
    out: list[str] = []
    per_file = {}
    for path in paths:
        gids, problems = table_gids(path, table, g0, g1, session)
        if gids is None:
            return problems  # unreadable gids: their checksum problem is reported already
        out += problems
        inside = gids[(gids >= g0) & (gids < g1)] - g0
        np.add.at(counts, inside, 1)
        per_file[path] = gids
    gaps = np.nonzero(counts == 0)[0] + g0
    if gaps.size:
        out.append(f"table {table}: {gaps.size} of {g1 - g0} global ids are in no shard file: "
                   f"{id_ranges(gaps)}{hint}")
    dups = np.nonzero(counts > 1)[0] + g0
    if dups.size:
        holders = [os.path.basename(p) for p, g in per_file.items() if np.isin(dups[0], g)]
        out.append(f"table {table}: {dups.size} global ids are in more than one shard file: "
                   f"{id_ranges(dups)} (global id {dups[0]} in {', '.join(holders)})")
    return out


def table_gids(path: str, table: int, g0: int, g1: int,
               session: VerifySession) -> tuple[np.ndarray | None, list[str]]:
    """(checksum-verified gids of one table's rows in a file, every piece of it, or None;
    problems with them). Local."""
    try:
        pieces = [p for p in table_pieces(session.open(path)) if p.table == table]
        got = [session.gids(path, p.group, p.start, p.stop) for p in pieces]
    except READ_ERRORS:
        return None, []
    if not pieces:
        return None, []
    out = []
    for piece, gids in zip(pieces, got):
        out += _piece_gid_problems(path, piece, gids, table, g0, g1)
    return np.concatenate(got), out


def _piece_gid_problems(path: str, piece: TablePiece, gids: np.ndarray, table: int, g0: int,
                        g1: int) -> list[str]:
    where = f"{path}: {piece.where}: dataset gids"
    out = []
    if gids.size and np.any(np.diff(gids) <= 0):
        out.append(f"{where}: global ids are not strictly ascending")
    outside = gids[(gids < g0) | (gids >= g1)]
    if outside.size:
        out.append(f"{where}: {outside.size} global ids outside table {table}'s range "
                   f"{g0}..{g1 - 1}, e.g. {int(outside[0])}")
    if gids.size and (piece.gid_min, piece.gid_max) != (gids[0], gids[-1]):
        out.append(f"{path}: {piece.where}: gid range {piece.gid_min}..{piece.gid_max} in its "
                   f"attributes, the gids run from {gids[0]} to {gids[-1]}")
    return out


def dense_structure(path: str, session: VerifySession) -> list[str]:
    """The dense file holds at least one parameter under /dense/param. Local."""
    try:
        if not any(name.startswith("param/") for name, _, _ in
                   dense_listing(session.open(path), path)):
            return [f"{path}: no dense parameters (/dense/param/... is missing or empty)"]
    except READ_ERRORS as e:
        return [error_text(path, e)]
    return []


def id_ranges(ids: np.ndarray, limit: int = 3) -> str:
    """Sorted ids as 'a..b, c, d..e, +N more ranges'. Local."""
    breaks = np.nonzero(np.diff(ids) != 1)[0]
    starts = np.concatenate([[0], breaks + 1])
    ends = np.concatenate([breaks, [ids.size - 1]])
    parts = [f"{ids[a]}..{ids[b]}" if b > a else f"{ids[a]}" for a, b in zip(starts, ends)]
    more = f", +{len(parts) - limit} more ranges" if len(parts) > limit else ""
    return ", ".join(parts[:limit]) + more


def dedupe(problems: list[str]) -> list[str]:
    """Problems in order, each once. Local."""
    return list(dict.fromkeys(problems))


def verify_layered(root: str, manifest: Manifest, session: VerifySession,
                   by_step: dict[int, Manifest] | None = None) -> list[str]:
    """An incremental checkpoint: its own and its parents' files, checksums of every file its
    layers read (chunk and bundle files included), and coverage of every table by the layers. Local."""
    by_step = dict(by_step if by_step is not None else {m.step: m for m in list_manifests(root)})
    by_step[manifest.step] = manifest
    problems = manifest_problems(root, manifest)
    try:
        layers = [*parent_manifests(manifest, by_step), manifest]
        segments = checkpoint_segments(root, manifest, by_step)
    except CheckpointError as e:
        return problems + [str(e)]
    for m in layers:
        problems += file_problem_messages(root, m)
    files = dict.fromkeys([rel for m in layers for rel in sorted(m.files)] + segment_files(segments))
    recorded = {rel: meta.get("crc32") for m in layers for rel, meta in m.files.items()}
    crcs = {os.path.join(root, rel): recorded.get(rel) for rel in files}
    session.prefetch(list(crcs), crcs)
    for path, crc in crcs.items():
        problems += session.checksums(path, crc)
    if not problems:
        problems += layered_coverage(root, manifest, segments, session)
    return dedupe(problems)


def _segment_gids(reader: SegmentReader, seg, session: VerifySession) -> np.ndarray:
    """Every global id a segment holds (rows it reads only to skip left out). Local."""
    parts = []
    for _, group, start, stop, _, _ in reader.groups(seg):
        gids = session.gids(reader.path(seg), group, start, stop)
        parts.append(gids[seg.row_orders(len(gids)) != GAP])
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def layered_coverage(root: str, manifest: Manifest, segments, session: VerifySession) -> list[str]:
    """Every global id of every table is in some layer. Local."""
    offsets = table_offsets(manifest)
    seen = np.zeros(int(offsets[-1]), dtype=bool)
    with SegmentReader(root, opener=session.open) as reader:
        for seg in segments:
            gids = session.memo(("segment gids", root, seg), lambda: _segment_gids(reader, seg, session))
            if gids.size and (gids.min() < 0 or gids.max() >= seen.size):
                return [f"{reader.path(seg)}: global ids outside the model's {seen.size} rows"]
            seen[gids] = True
    out = []
    for t in range(len(offsets) - 1):
        gaps = np.nonzero(~seen[offsets[t]:offsets[t + 1]])[0] + offsets[t]
        if gaps.size:
            out.append(f"table {t}: {gaps.size} of {offsets[t + 1] - offsets[t]} global ids are in "
                       f"none of step {manifest.step}'s layers: {id_ranges(gaps)}")
    return out
