"""Tables: where each embedding table's rows lie among a checkpoint's shard files.

A shard file holds row-aligned datasets (``gids``, ``weight``, ``state/<name>``) in one of two
layouts, which `table_pieces` hides from readers:

- *packed* (format 3, what writers write): one group ``rows`` holds all of the file's rows, table
  after table in the writer's local row order; its attribute ``tables`` is an int64 array with one
  line (table, start, stop, gid_min, gid_max) per table, the tables' row ranges tiling the
  datasets. A file of 26 tables is ~10 HDF5 objects instead of ~190, and each object costs the
  writer and every reader tens of microseconds of CPU.
- *per table* (formats 1 and 2, still read): a group ``tables/<t>`` per table with attributes
  gid_min/gid_max.

Global ids of table t are ``offsets[t] .. offsets[t+1]-1`` with offsets the cumulative table
sizes. Local: nothing here uses MPI, and only HDF5 metadata (attributes, shapes) is read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

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


PACKED_GROUP = "rows"
"""The group of a packed shard file (IncrCP bundles use the same name, without `PIECES_ATTR`)."""
PIECES_ATTR = "tables"
PIECE_FIELDS = 5
"""(table, start, stop, gid_min, gid_max) per line of `PIECES_ATTR`."""


@dataclass(frozen=True)
class TablePiece:
    """Rows [start, stop) of `group`'s row-aligned datasets: one table's rows in a shard file.

    `gid_min`/`gid_max` are None where a per-table group lacks those attributes (damage, which
    `verify` reports)."""

    table: int
    group: h5py.Group
    start: int
    stop: int
    gid_min: int | None
    gid_max: int | None
    packed: bool

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def where(self) -> str:
        """The piece in error messages: its group, and its rows when the group is shared."""
        name = self.group.name
        return f"group {name} rows {self.start}..{self.stop - 1} (table {self.table})" \
            if self.packed else f"group {name}"


def packed_group(f: h5py.File) -> h5py.Group | None:
    """The ``rows`` group of a packed shard file, or None (a per-table file). Local."""
    group = f.get(PACKED_GROUP)
    return group if isinstance(group, h5py.Group) and PIECES_ATTR in group.attrs else None


def table_pieces(f: h5py.File) -> list[TablePiece]:
    """Every table's rows in an open shard file, in file order, whichever its layout. ValueError
    (or KeyError) naming the group when the layout is inconsistent: a piece list that does not
    tile a packed group's rows, a non-numeric table group. Local."""
    group = packed_group(f)
    if group is None:
        return [TablePiece(t, g, 0, int(g["gids"].shape[0]) if "gids" in g else 0,
                           _int_attr(g, "gid_min"),
                           _int_attr(g, "gid_max"), False) for t, g in table_groups(f).items()]
    return packed_pieces(group)


def packed_pieces(group: h5py.Group) -> list[TablePiece]:
    """The pieces a packed group's `PIECES_ATTR` lists, checked to tile its gids. Local."""
    lines = np.asarray(group.attrs[PIECES_ATTR])
    if lines.ndim != 2 or lines.shape[1] != PIECE_FIELDS or lines.dtype.kind not in "iu":
        raise ValueError(f"attribute {group.name}/{PIECES_ATTR} is {lines.dtype} {lines.shape}, "
                         f"expected (tables, {PIECE_FIELDS}) integers")
    n, at, out = int(group["gids"].shape[0]), 0, []
    for table, start, stop, gid_min, gid_max in lines.tolist():
        if start != at or stop < start or stop > n:
            raise ValueError(f"{group.name}: table {table}'s rows {start}..{stop - 1} do not "
                             f"follow row {at - 1} within the group's {n} rows")
        out.append(TablePiece(table, group, start, stop, gid_min, gid_max, True))
        at = stop
    if at != n:
        raise ValueError(f"{group.name}: its tables' rows end at {at}, the group has {n} rows")
    return out


def _int_attr(group: h5py.Group, name: str) -> int | None:
    value = group.attrs.get(name)
    return None if value is None else int(value)


def table_groups(f: h5py.File) -> dict[int, h5py.Group]:
    """table number -> its group in an open per-table shard file (formats 1 and 2); ValueError on
    a non-numeric name. Local."""
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


def shard_index(root: str, manifest: Manifest) -> tuple[dict[int, list[str]], dict[str, str]]:
    """(table -> paths of the shard files holding rows of it, path -> error for unreadable files).

    Local; reads group names only."""
    index: dict[int, list[str]] = {}
    errors: dict[str, str] = {}
    for rel in manifest.shard_files():
        path = os.path.join(root, rel)
        try:
            with open_shard(path) as f:
                for piece in table_pieces(f):
                    index.setdefault(piece.table, []).append(path)
        except READ_ERRORS as e:
            errors[path] = error_text(path, e)
    return index, errors


def error_text(path: str, e: BaseException) -> str:
    """`e` as one line that names `path` (CheckpointErrors already do). Local."""
    text = str(e).strip("'\"")
    return text if text.startswith(path) else f"{path}: {text}"
