"""Export: one checkpoint as a single plain HDF5 file keyed by (table, row), for use outside mpickpt.

Layout of the export::

    /                          attrs: step, kind, codec, dim, table_sizes, optimizer, world_size,
                                      ckpt_id, source_dir, format
    /embeddings/table_<t>      float32 (rows of t, D); row i is row i of table t
    /optimizer/table_<t>/<s>   sparse optimizer state of table t (with_optimizer)
    /optimizer/dense/<i>/<k>   dense optimizer state of the i-th dense parameter (with_optimizer)
    /dense/<param name>        dense parameters

Tables are assembled one at a time from all shard files by global id, reading block by block with
checksum verification; any missing, truncated or corrupted input raises CheckpointError naming the
file, and no output is left behind. Local: nothing here uses MPI.
"""
from __future__ import annotations

import os

import h5py
import numpy as np

from mpickpt.checkpoint.identity import IdentityCheck
from mpickpt.checkpoint.load import check_files
from mpickpt.checkpoint.verify import id_ranges
from mpickpt.kinds.registry import checkpoint_segments, format_of
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, list_manifests, parent_manifests
from mpickpt.store.segments import GAP, SegmentReader, newest_rows
from mpickpt.checkpoint.model_spec import architecture, describe
from mpickpt.store.shard_file import BLOCK_ROWS, open_hdf5, open_shard, read_rows
from mpickpt.store.dense_file import dense_arrays
from mpickpt.store.tables import (READ_ERRORS, TablePiece, error_text, row_array_names,
                                  shard_index, stored_row_arrays, table_offsets, table_pieces)

EXPORT_FORMAT = "mpickpt-export-2"
"""2: the model's architecture and inputs are attributes (`checkpoint.model_spec`)."""


def export_checkpoint(root: str, manifest: Manifest, out: str, with_optimizer: bool = False,
                      provenance: bool = False) -> dict:
    """Write the checkpoint's model as one HDF5 file at `out` (temp name, then rename).

    The file depends only on the model at that step, so exports of one step written under any
    checkpoint kind are byte-identical; `provenance` adds where it came from (kind, ckpt_id,
    source_dir, world_size). Returns {"tables": n, "rows": total rows, "bytes": size of `out`}.
    Local."""
    by_step = {m.step: m for m in list_manifests(root, [])}  # damaged ones: named if needed
    by_step[manifest.step] = manifest
    for m in [*parent_manifests(manifest, by_step), manifest]:
        check_files(root, m)
    IdentityCheck(root, manifest, by_step).check_all()  # no file of another checkpoint
    if not format_of(manifest).layered:
        index, errors = shard_index(root, manifest)
        if errors:
            raise CheckpointError(next(iter(errors.values())))
    else:
        index = checkpoint_segments(root, manifest, by_step)
    tmp = os.path.join(os.path.dirname(out) or ".", f".{os.path.basename(out)}.tmp-{os.getpid()}")
    dense = read_dense(root, manifest, with_optimizer)
    _check_room(out, manifest, dense, with_optimizer)
    try:
        with open_hdf5(tmp, "w") as f:
            write_attrs(f, root, manifest, provenance, dense)
            write_tables(f, root, manifest, index, with_optimizer)
            for name, array in dense.items():
                f.create_dataset(name, data=array)
        os.replace(tmp, out)
    except (OSError, RuntimeError) as e:  # h5py's errors on a full disk are RuntimeErrors
        remove_quietly(tmp)
        if getattr(e, "filename", None) in (tmp, out) or os.path.basename(tmp) in str(e):
            why = " ".join(str(getattr(e, "strerror", None) or e).split())  # HDF5's: lines
            raise CheckpointError(f"{out}: the export could not be written: {why}") from e
        raise
    except BaseException:
        remove_quietly(tmp)
        raise
    offsets = table_offsets(manifest)
    return {"tables": len(offsets) - 1, "rows": int(offsets[-1]), "bytes": os.path.getsize(out)}


EXPORT_SLACK, EXPORT_EXTRA = 1.05, 1 << 20
"""The room an export needs beyond its arrays' bytes (HDF5's metadata)."""


def _check_room(out: str, manifest: Manifest, dense: dict, with_optimizer: bool) -> None:
    """CheckpointError naming `out` where its filesystem has less room than the export needs
    (its rows, a row-wise sparse optimizer state of one value a row where it has one, and the
    dense arrays), before anything is written: HDF5 fails a full disk only as it closes the
    file. Local."""
    rows = int(sum(manifest.plan["table_sizes"]))
    per_row = manifest.dim * 4 + (4 if with_optimizer and manifest.optimizer != "sgd" else 0)
    need = int((rows * per_row + sum(a.nbytes for a in dense.values())) * EXPORT_SLACK) \
        + EXPORT_EXTRA
    try:
        st = os.statvfs(os.path.dirname(os.path.abspath(out)))
    except OSError:
        return  # the write will say what is wrong
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise CheckpointError(f"{out}: no room for the export: it needs about "
                              f"{need / 1e6:.1f} MB, and {free / 1e6:.1f} MB are free there")


def write_attrs(f: h5py.File, root: str, manifest: Manifest, provenance: bool,
                dense: dict[str, np.ndarray]) -> None:
    """Root attributes describing the model: its architecture, inputs and output (so that it can
    be rebuilt from the file alone), and optionally where it came from. Local."""
    sizes = manifest.plan["table_sizes"]
    shapes = {k.removeprefix("dense/"): v.shape for k, v in dense.items()
              if k.startswith("dense/")}
    arch = architecture(shapes, manifest.dim, len(sizes), manifest.stats.get("model"))
    f.attrs.update({"format": EXPORT_FORMAT, "step": manifest.step,
                    "codec": manifest.codec, "dim": manifest.dim, "optimizer": manifest.optimizer,
                    "table_sizes": np.asarray(sizes, dtype=np.int64),
                    "embeddings": "embeddings/table_<t>: rows x dim float32, row r of table t",
                    **describe(arch)})
    if provenance:
        f.attrs.update({"kind": manifest.kind, "world_size": manifest.world_size,
                        "ckpt_id": manifest.ckpt_id, "source_dir": os.path.abspath(root)})


def write_tables(f: h5py.File, root: str, manifest: Manifest, index, with_optimizer: bool) -> None:
    """Assemble and write every table, one in memory at a time. `index` is table -> shard paths
    (full checkpoints) or the checkpoint's ordered segments (incremental kinds). Local."""
    names = ["weight"] + ([n for n in row_array_names(manifest) if n != "weight"]
                          if with_optimizer else [])
    offsets = table_offsets(manifest)
    for t in range(len(offsets) - 1):
        arrays = (assemble_table(manifest, t, index.get(t, []), names) if isinstance(index, dict)
                  else assemble_layers(root, manifest, index, t, names))
        f.create_dataset(f"embeddings/table_{t}", data=arrays.pop("weight"))
        for name, array in arrays.items():
            f.create_dataset(f"optimizer/table_{t}/{name.removeprefix('state/')}", data=array)


def assemble_table(manifest: Manifest, table: int, paths: list[str],
                   names: list[str]) -> dict[str, np.ndarray]:
    """Rows 0..size-1 of `table` for each row array in `names`, from the shard files `paths`.

    CheckpointError when a row is missing, duplicated, or fails its checksum. Local."""
    offsets = table_offsets(manifest)
    g0, size = int(offsets[table]), int(offsets[table + 1] - offsets[table])
    out: dict[str, np.ndarray] = {}
    filled = np.zeros(size, dtype=bool)
    for path in dict.fromkeys(paths):
        try:
            with open_shard(path) as f:
                for piece in (p for p in table_pieces(f) if p.table == table):
                    filled[place_piece(piece, path, g0, size, filled, names, out)] = True
        except CheckpointError:
            raise
        except READ_ERRORS as e:
            raise CheckpointError(error_text(path, e)) from None
    if not filled.all():
        missing = np.nonzero(~filled)[0]
        raise CheckpointError(f"checkpoint step {manifest.step}: table {table} rows "
                              f"{id_ranges(missing)} ({missing.size} rows) are in no shard file")
    return out


def assemble_layers(root: str, manifest: Manifest, segments: list, table: int,
                    names: list[str]) -> dict[str, np.ndarray]:
    """Rows of `table` from an incremental checkpoint's segments, newer overwriting older. Local."""
    offsets = table_offsets(manifest)
    g0, size = int(offsets[table]), int(offsets[table + 1] - offsets[table])
    out: dict[str, np.ndarray] = {}
    newest = np.full(size, np.iinfo(np.int64).min, dtype=np.int64)
    with SegmentReader(root) as reader:
        for seg in segments:
            try:
                for t, group, start, stop, _, _ in reader.groups(seg):
                    if t not in (table, -1) or stop <= start:
                        continue
                    rows = reader.gids(seg, group, start, stop) - g0
                    orders = seg.row_orders(len(rows))
                    pos = np.nonzero(orders != GAP)[0]
                    pos = pos[newest_rows(rows[pos], orders[pos])]
                    pos = pos[(rows[pos] >= 0) & (rows[pos] < size)]  # a bundle mixes tables
                    pos = pos[orders[pos] >= newest[rows[pos]]]
                    for name in names:
                        data = reader.rows(seg, group, name, start, stop)
                        out.setdefault(name, np.zeros((size, *data.shape[1:]), dtype=data.dtype))
                        out[name][rows[pos]] = data[pos]
                    newest[rows[pos]] = orders[pos]
            except CheckpointError:
                raise
            except READ_ERRORS as e:
                raise CheckpointError(error_text(reader.path(seg), e)) from None
    missing = np.nonzero(newest == np.iinfo(np.int64).min)[0]
    if missing.size:
        raise CheckpointError(f"checkpoint step {manifest.step}: table {table} rows "
                              f"{id_ranges(missing)} ({missing.size} rows) are in none of its "
                              f"layers")
    return out


def place_piece(piece: TablePiece, path: str, g0: int, size: int, filled: np.ndarray,
                names: list[str], out: dict[str, np.ndarray]) -> np.ndarray:
    """Copy one file's rows of a table into `out` by global id; returns the table rows. Local."""
    rows = read_rows(piece.group["gids"], piece.start, piece.stop, path) - g0
    where = f"{path}: {piece.where}"
    if rows.size and (rows.min() < 0 or rows.max() >= size):
        raise CheckpointError(f"{where}: global ids outside the table (rows {rows.min()}.."
                              f"{rows.max()} of {size})")
    if np.any(np.diff(rows) <= 0):
        raise CheckpointError(f"{where}: gids are not strictly ascending")
    if filled[rows].any():
        raise CheckpointError(f"{where}: table rows {id_ranges(rows[filled[rows]])} are also in "
                              f"another shard file")
    datasets = stored_row_arrays(piece.group, path)
    n = datasets["gids"].shape[0]
    for name in names:
        ds = datasets.get(name)
        if ds is None or ds.shape[0] != n:
            what = "is missing" if ds is None else f"has {ds.shape[0]} rows, gids {n}"
            raise CheckpointError(f"{where}: dataset {name} {what}")
        target = out.setdefault(name, np.zeros((size, *ds.shape[1:]), dtype=ds.dtype))
        for a in range(0, rows.size, BLOCK_ROWS):
            b = min(rows.size, a + BLOCK_ROWS)
            target[rows[a:b]] = ds.rows(piece.start + a, piece.start + b)
    return rows


def read_dense(root: str, manifest: Manifest, with_optimizer: bool) -> dict[str, np.ndarray]:
    """Export name -> array of the dense file's parameters (and optimizer state). Local."""
    rels = [k for k, v in manifest.files.items() if v["role"] == "dense"]
    if not rels:
        raise CheckpointError(f"{root}: the manifest of step {manifest.step} lists no dense file")
    path = os.path.join(root, rels[0])
    out = {}
    try:
        with open_shard(path) as src:
            arrays = dense_arrays(src, path)
        if not any(name.startswith("param/") for name in arrays):
            raise CheckpointError(f"{path}: no dense parameters (/dense/param/...)")
        for name, array in sorted(arrays.items()):
            if name.startswith("param/"):
                out[f"dense/{name[len('param/'):]}"] = array
            elif name.startswith("opt/") and with_optimizer:
                out[f"optimizer/dense/{name[len('opt/'):]}"] = array
    except CheckpointError:
        raise
    except READ_ERRORS as e:
        raise CheckpointError(error_text(path, e)) from None
    return out


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
