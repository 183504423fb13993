"""Describe: a JSON-friendly summary of one checkpoint, for `mpickpt inspect`.

Reads the manifest, file sizes and HDF5 metadata (group names, shapes, dtypes), and the global ids
of every layer for the rows' staleness (checksum-verified); no row data is read. Local: nothing
here uses MPI.
"""
from __future__ import annotations

import datetime
import os
import re

import numpy as np

from mpickpt.kinds.registry import checkpoint_segments, format_of
from mpickpt.store.catalog import status
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, list_manifests
from mpickpt.store.segments import GAP, SegmentReader
from mpickpt.store.shard_file import open_shard
from mpickpt.store.dense_file import dense_listing
from mpickpt.store.tables import (READ_ERRORS, error_text, rows_per_rank, table_offsets,
                                  table_pieces, table_sizes)


def describe(root: str, manifest: Manifest) -> dict:
    """Everything `inspect` shows about `manifest`'s checkpoint under `root`. Local."""
    sizes = table_sizes(manifest)
    found, file_errors = table_rows_found(root, manifest)
    dense, dense_error = dense_datasets(root, manifest)
    store, stale = _format_facts(root, manifest), staleness(root, manifest)
    files = file_entries(root, manifest)
    foreign = [p for f in files for p in f.pop("problems", [])  # said once, where said
               if p not in file_errors and p != dense_error]
    layer_errors = [e for e in ((store or {}).get("error"), stale.get("error")) if e]
    layer_errors += foreign
    return {
        "root": os.path.abspath(root),
        "step": manifest.step,
        "ckpt_id": manifest.ckpt_id,
        "kind": manifest.kind,
        "codec": manifest.codec,
        "created": iso_time(manifest.created),
        "status": f"damaged ({layer_errors[0]})" if layer_errors else status(root, manifest),
        "world_size": manifest.world_size,
        "dim": manifest.dim,
        "optimizer": manifest.optimizer,
        "num_tables": len(sizes),
        "total_rows": sum(sizes),
        "table_sizes": sizes,
        "parents": list(manifest.parents),
        "chain": manifest.chain,
        "chunk_store": store,
        "staleness": stale,
        "layout": {str(r): v for r, v in sorted(rows_per_rank(manifest).items())},
        "reader_state": manifest.reader_state,
        "stats": manifest.stats,
        "files": files,
        "tables": [{"table": t, "size": n, "rows_found": found.get(t, 0)}
                   for t, n in enumerate(sizes)] + extra_tables(found, len(sizes)),
        "dense": dense,
        "errors": list(dict.fromkeys(file_errors + ([dense_error] if dense_error else [])
                                     + layer_errors)),  # each said once
    }


def _format_facts(root: str, manifest: Manifest) -> dict | None:
    """The kind's own facts (IncrCP: its chunk store); {"error": why} where they cannot be
    read (a damaged chunk index, a missing chain file). Local."""
    try:
        return format_of(manifest).describe(root, manifest)
    except (CheckpointError, OSError, ValueError) as e:
        return {"error": error_text(root, e)}


def staleness(root: str, manifest: Manifest) -> dict:
    """How old the checkpoint's rows are: per global row, the step of the newest layer that holds
    it; min / median / max over all rows, how many are as of the checkpoint's step, and whether
    the kind is exact (rows not written since did not change) or approximate (prioritized saves
    skip changed rows). Local; reads the checksummed gids of every layer."""
    fmt = format_of(manifest)
    out = {"exact": fmt.exact}
    try:
        readable = list_manifests(root, [])  # a damaged parent is named by checkpoint_segments
        segments = checkpoint_segments(root, manifest, {m.step: m for m in readable})
        steps = np.full(int(table_offsets(manifest)[-1]), -1, dtype=np.int64)
        with SegmentReader(root) as reader:
            for seg in segments:
                for _, group, start, stop, _, _ in reader.groups(seg):
                    gids = reader.gids(seg, group, start, stop)
                    orders = seg.row_orders(len(gids))
                    keep = orders != GAP
                    np.maximum.at(steps, gids[keep], orders[keep])
    except READ_ERRORS as e:
        return {**out, "error": error_text(root, e)}
    found = steps[steps >= 0]
    if found.size:
        out.update({"min": int(found.min()), "median": int(np.median(found)),
                    "max": int(found.max()), "current": int((found == manifest.step).sum()),
                    "rows": int(found.size)})
    return out


def iso_time(timestamp: float) -> str:
    """Local time with its UTC offset, to the second. Local."""
    return datetime.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")


def file_entries(root: str, manifest: Manifest) -> list[dict]:
    """Every listed file with its recorded size, role, rank, part and what is on disk: missing,
    of another size, or of another checkpoint (its attributes name another step, rank or part:
    a copy of the same size; those messages under ``problems``). Local; reads the attributes
    of each file of the right size."""
    out = []
    for rel, meta in sorted(manifest.files.items()):
        path = os.path.join(root, rel)
        actual = os.path.getsize(path) if os.path.isfile(path) else None
        unread, problems = _identity(path, meta, manifest) if actual == meta["size"] \
            else (False, [])
        state = ("missing" if actual is None else f"size mismatch ({actual} bytes on disk)"
                 if actual != meta["size"] else "ok" if not problems
                 else "damaged" if unread else "another checkpoint's file")
        out.append({"path": rel, "size": meta["size"], "role": meta["role"],
                    "rank": meta.get("rank"), "part": meta.get("part"), "state": state,
                    "problems": problems})
    return out


def _identity(path: str, meta: dict, manifest: Manifest) -> tuple[bool, list[str]]:
    """(whether the file could not be read, `identity.identity_problems` of one listed file or
    why it cannot be read). Local."""
    from mpickpt.checkpoint.identity import identity_problems
    from mpickpt.store import h5_lowlevel

    try:
        with open_shard(path) as f:
            return False, identity_problems(path, lambda key: h5_lowlevel.read_attr(f.id, key),
                                            meta, manifest)
    except READ_ERRORS as e:
        return True, [error_text(path, e)]


def table_rows_found(root: str, manifest: Manifest) -> tuple[dict[int, int], list[str]]:
    """(table -> rows present over all readable shard files, errors of unreadable files). Local."""
    found: dict[int, int] = {}
    errors: list[str] = []
    for rel in manifest.shard_files():
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            errors.append(f"{path}: shard file is missing")
            continue
        try:
            with open_shard(path) as f:
                for piece in table_pieces(f):
                    found[piece.table] = found.get(piece.table, 0) + piece.rows
        except READ_ERRORS as e:
            errors.append(error_text(path, e))
    return found, errors


def extra_tables(found: dict[int, int], num_tables: int) -> list[dict]:
    """Tables present in shard files but not in the manifest's plan. Local."""
    return [{"table": t, "size": None, "rows_found": n}
            for t, n in sorted(found.items()) if t >= num_tables]


def dense_datasets(root: str, manifest: Manifest) -> tuple[list[dict], str | None]:
    """([{"name", "shape", "dtype"}] of the dense file's /dense datasets, error or None). Local."""
    rels = [k for k, v in manifest.files.items() if v["role"] == "dense"]
    if not rels:
        return [], f"{root}: the manifest of step {manifest.step} lists no dense file"
    path = os.path.join(root, rels[0])
    try:
        with open_shard(path) as f:
            if "dense" not in f:
                return [], f"{path}: has no /dense group"
            return [{"name": name, "shape": list(shape), "dtype": dtype}
                    for name, shape, dtype in sorted(dense_listing(f, path),
                                                     key=lambda item: natural_key(item[0]))], None
    except READ_ERRORS as e:
        return [], error_text(path, e)


def natural_key(name: str) -> list:
    """Sort key that orders 'opt/2' before 'opt/10'. Local."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]


def format_text(info: dict) -> list[str]:
    """`describe`'s result as the lines `inspect` prints. Local."""
    mb = sum(f["size"] for f in info["files"]) / 1e6
    lines = [f"checkpoint   {info['root']}/{info['ckpt_id']}",
             f"step         {info['step']}",
             f"kind         {info['kind']}",
             f"codec        {info['codec']}",
             f"created      {info['created']}",
             f"status       {info['status']}",
             f"world size   {info['world_size']}",
             f"dim          {info['dim']}",
             f"optimizer    {info['optimizer']}",
             f"tables       {info['num_tables']} ({info['total_rows']} rows): "
             f"{', '.join(str(n) for n in info['table_sizes'])}",
             f"size         {mb:.2f} MB in {len(info['files'])} files"]
    if info["parents"]:
        lines.append(f"parents      {', '.join(str(p) for p in info['parents'])}")
    if info.get("chain"):
        lines.append(f"chain        {info['chain']}")
    if (info.get("chunk_store") or {}).get("ranks"):
        lines.append("chunk store (2-D lists per writer rank):")
        for r, v in info["chunk_store"]["ranks"].items():
            rect = v["rectangle"]
            lines.append(f"  rank {r}: index generation {v['generation']}, {v['columns']} columns, "
                         f"depth per table {v['depth']}, {v['files']} files; this step reads "
                         f"{rect['chunks']} chunks ({rect['rows']} rows) from {rect['files']} "
                         f"files" + (f"; not yet ingested: {v['pending_columns']}"
                                     if v["pending_columns"] else ""))
    st = info.get("staleness") or {}
    if "min" in st:
        note = ("exact: rows not written since did not change" if st["exact"] else
                "approximate: rows changed since they were last written keep older values")
        lines.append(f"rows as of   step min {st['min']} / median {st['median']} / max "
                     f"{st['max']}; {st['current']} of {st['rows']} rows written at step "
                     f"{info['step']} ({note})")
    lines.append("layout (rows per rank):")
    lines += [f"  rank {r}: {v['rows']} rows, tables {' '.join(v['pieces']) or '-'}"
              for r, v in info["layout"].items()]
    lines.append("reader state:")
    lines += [f"  {k}: {v}" for k, v in sorted(info["reader_state"].items())]
    lines.append("stats:")
    lines += [f"  {k}: {v}" for k, v in sorted(info["stats"].items())]
    lines.append("files:")
    lines += [f"  {f['path']}  {f['size']} bytes  {f['role']} rank {f['rank']} part {f['part']}"
              f"  {f['state']}" for f in info["files"]]
    lines.append("rows per table in the shard files:")
    lines += [f"  table {t['table']}: {t['rows_found']} of {t['size']} rows" for t in info["tables"]]
    lines.append("dense datasets:")
    lines += [f"  {d['name']}  {tuple(d['shape'])}  {d['dtype']}" for d in info["dense"]]
    lines += [f"error: {e}" for e in info["errors"]]
    return lines
