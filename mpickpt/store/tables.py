"""Tables: where each embedding table's rows lie among a checkpoint's shard files.

A shard file holds, per table it has rows of, a group ``tables/<t>`` with attrs gid_min/gid_max and
row-aligned datasets (``gids``, ``weight``, ``state/<name>``). Global ids of table t are
``offsets[t] .. offsets[t+1]-1`` with offsets the cumulative table sizes. Local: nothing here uses
MPI, and only HDF5 metadata (attributes, shapes) is read.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest
from mpickpt.store.shard_file import CRC_SUFFIX, open_shard

READ_ERRORS = (CheckpointError, OSError, KeyError, ValueError, RuntimeError)
"""What opening or reading a damaged HDF5 file can raise (open_shard can raise KeyError too)."""


def table_sizes(manifest: Manifest) -> list[int]:
    return [int(n) for n in manifest.plan["table_sizes"]]


def table_offsets(manifest: Manifest) -> np.ndarray:
    """First global id of every table, plus the total row count at the end. Local."""
    return np.concatenate([[0], np.cumsum(table_sizes(manifest), dtype=np.int64)])


def row_array_names(manifest: Manifest) -> list[str]:
    """Row-aligned arrays every table group must hold besides `gids` ('weight', 'state/...'). Local."""
    return sorted(manifest.stats.get("row_arrays") or ["weight"])


def rows_per_rank(manifest: Manifest) -> dict[int, dict]:
    """rank -> {"rows": n, "pieces": ["t" or "t[a:b)", ...]} from the manifest's plan. Local."""
    sizes = table_sizes(manifest)
    out: dict[int, dict] = {r: {"rows": 0, "pieces": []} for r in range(manifest.world_size)}
    for table, a, b, rank in sorted(manifest.plan.get("shards", []), key=lambda s: (s[3], s[0])):
        entry = out.setdefault(rank, {"rows": 0, "pieces": []})
        entry["rows"] += b - a
        whole = a == 0 and b == sizes[table]
        entry["pieces"].append(str(table) if whole else f"{table}[{a}:{b})")
    return out


def table_groups(f: h5py.File) -> dict[int, h5py.Group]:
    """table number -> its group in an open shard file; ValueError on a non-numeric name. Local."""
    tables = f.get("tables")
    if tables is None:
        return {}
    out = {}
    for name, group in tables.items():
        if not name.isdigit():
            raise ValueError(f"group /tables/{name} is not named by a table number")
        out[int(name)] = group
    return out


def group_datasets(group: h5py.Group) -> dict[str, h5py.Dataset]:
    """Relative name -> dataset of every data (non-checksum) dataset below `group`. Local."""
    out: dict[str, h5py.Dataset] = {}

    def visit(name: str, obj) -> None:  # a non-None return would stop the visit
        if isinstance(obj, h5py.Dataset) and not name.endswith(CRC_SUFFIX) \
                and "codec" not in obj.parent.attrs:  # parts of an encoded row array
            out[name] = obj

    group.visititems(visit)
    return out


def stored_row_arrays(group: h5py.Group, path: str) -> dict:
    """Relative name -> StoredRows of every row array of a table group, plain or encoded. Local."""
    from mpickpt.store.row_arrays import StoredRows, is_encoded

    out = {name: StoredRows(ds, path) for name, ds in group_datasets(group).items()}
    encoded: list[str] = []
    group.visititems(lambda name, obj: encoded.append(name) if is_encoded(obj) else None)
    out.update({name: StoredRows(group[name], path) for name in encoded})
    return out


def dataset_shape(ds: h5py.Dataset) -> tuple[int, ...]:
    """The logical shape: () for datasets written from 0-d arrays. Local."""
    return () if ds.attrs.get("scalar", False) else tuple(ds.shape)


def shard_index(root: str, manifest: Manifest) -> tuple[dict[int, list[str]], dict[str, str]]:
    """(table -> paths of the shard files holding rows of it, path -> error for unreadable files).

    Local; reads group names only."""
    index: dict[int, list[str]] = {}
    errors: dict[str, str] = {}
    for rel in manifest.shard_files():
        path = os.path.join(root, rel)
        try:
            with open_shard(path) as f:
                for table in table_groups(f):
                    index.setdefault(table, []).append(path)
        except READ_ERRORS as e:
            errors[path] = error_text(path, e)
    return index, errors


def error_text(path: str, e: BaseException) -> str:
    """`e` as one line that names `path` (CheckpointErrors already do). Local."""
    text = str(e).strip("'\"")
    return text if text.startswith(path) else f"{path}: {text}"
