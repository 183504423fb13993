"""File specs: what goes into each file of a checkpoint and where it lies under the root.

The one home of the shard format's names: relative paths of every file a checkpoint writes, the
attributes stamped on them, and which staged rows go into which dataset. The writers (`engine`)
build `FileSpec`s from here and write them; the readers (`checkpoint`, the extractor, `verify`)
find files and check attributes with the same functions. Local: nothing here uses MPI or torch.

Layout under the checkpoint root::

    manifest-<step>.json                             the commit record (`store.manifest`)
    step-<step>-<attempt>/rank-<r>-part-<j>.h5       shard files: /rows/{gids, weight, state/..}
    step-<step>-<attempt>/rank-<r>-extra.h5          RNG states, when the shard lives in a chain
    step-<step>-<attempt>/dense.h5                   replicated dense state
    chains/<chain>/rank-<r>/col-<step>-part-<j>.h5   an IncrCP increment (a 2-D list column)
    chains/<chain>/rank-<r>/bundle-<step>-row<i>.h5  an ingestion's chunks of list row i
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

SHARD_ROLES = ("shard", "dense", "extra", "chunk")
"""'shard': a rank's rows in the step directory; 'dense': replicated state; 'extra': RNG states of
a step whose rows live elsewhere; 'chunk': rows written into a chain (not listed in manifests)."""


def checkpoint_id(step: int, attempt: str) -> str:
    """Directory (relative to the root) of one attempt at checkpointing `step`. Local."""
    return f"step-{step:012d}-{attempt}"


def shard_relpath(ckpt_id: str, rank: int, part: int) -> str:
    return f"{ckpt_id}/rank-{rank:05d}-part-{part}.h5"


def extra_relpath(ckpt_id: str, rank: int) -> str:
    return f"{ckpt_id}/rank-{rank:05d}-extra.h5"


def dense_relpath(ckpt_id: str) -> str:
    return f"{ckpt_id}/dense.h5"


def chain_relpath(chain: str, rank: int) -> str:
    """Directory of one rank's chunk files and chunk-index generations in a chain. Local."""
    return f"chains/{chain}/rank-{rank:05d}"


def column_relpath(chain: str, rank: int, step: int, part: int) -> str:
    """Where the foreground writer puts the increment of checkpoint `step` (writer part `part`)."""
    return f"{chain_relpath(chain, rank)}/col-{step:012d}-part-{part}.h5"


BUNDLE_RE = re.compile(r"^bundle-(\d{12})-row\d+\.h5$")
"""A bundle's file name: the step of the ingestion that wrote it, and its row of the lists."""


def bundle_relpath(chain: str, rank: int, step: int, row: int) -> str:
    """Where the extractor's ingestion of checkpoint `step` puts its chunks of list row `row`
    (`incrcp.extraction`: row 0 or 1)."""
    return f"{chain_relpath(chain, rank)}/bundle-{step:012d}-row{row}.h5"


def shard_attrs(step: int, kind: str, codec: str, rank: int, part: int, parts: int,
                world_size: int) -> dict:
    """Root attributes of a shard (or chunk) file. `verify` checks step, rank, part and world size
    against the manifest. Local."""
    return {"step": step, "kind": kind, "codec": codec, "rank": rank, "part": part,
            "parts": parts, "world_size": world_size}


@dataclass
class FileSpec:
    """One file for a writer: datasets gathered from the staged arrays, attributes, blobs."""

    root: str
    relpath: str
    role: str
    rank: int
    part: int = 0
    attrs: dict = field(default_factory=dict)
    datasets: list = field(default_factory=list)
    """(dataset name, staged array name, rows) triples; rows: None (all), [(a, b), ...] ranges
    (of local rows, or of positions in a compactly staged array: `shard_specs(compact=True)`),
    or an array of selected local rows."""
    group_attrs: dict = field(default_factory=dict)
    blobs: dict = field(default_factory=dict)
    """dataset name -> bytes (RNG states), written as uint8 arrays."""
    codecs: dict = field(default_factory=dict)
    """staged array name -> Codec fields (plain dict) it is encoded with."""
    packs: dict = field(default_factory=dict)
    """dataset name -> (`dense_file.DenseEntry`s, bytes, staged-name prefix): staged arrays
    written back to back as one uint8 dataset."""

    def __post_init__(self):
        assert self.role in SHARD_ROLES, self.role

    @property
    def path(self) -> str:
        return os.path.join(self.root, self.relpath)

    @property
    def meta(self) -> dict:
        """What the manifest records of the file besides its size. Local."""
        return {"role": self.role, "rank": self.rank, "part": self.part}


def part_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Split local rows [0, n) into `parts` contiguous ranges, one per writer. Local."""
    return [(n * j // parts, n * (j + 1) // parts) for j in range(parts)]


def shard_specs(root: str, plan, rank: int, gids: np.ndarray, row_names, relpath_of, role: str,
                attrs_of, selected: np.ndarray | None = None, codecs: dict | None = None,
                parts: int = 1, compact: bool = False) -> list[FileSpec]:
    """One spec per writer part: that part's rows of `gids` and every row array in `row_names`,
    packed (`store.tables`): one dataset per array holding the part's rows of every table of
    `rank`, in local row order, and the tables' row ranges in the attribute ``rows/tables``.
    Local.

    `relpath_of(part)` and `attrs_of(part)` name and stamp each file; `selected` (sorted local
    rows) restricts an incremental save to those rows; `compact`: the row arrays were staged
    compactly, the k-th selected row at row k (the keys stay in their places); `codecs` maps
    row-array names to the Codec fields the writer encodes them with."""
    from mpickpt.store.tables import PACKED_GROUP, PIECES_ATTR

    specs = []
    for j, (a, b) in enumerate(part_bounds(plan.local_rows(rank), parts)):
        spec = FileSpec(root, relpath_of(j), role, rank, j, attrs_of(j), codecs=dict(codecs or {}))
        lines, rows, spans = _packed_rows(plan, rank, gids, a, b, selected)
        if lines:
            spec.group_attrs[PACKED_GROUP] = {PIECES_ATTR: np.array(lines, dtype=np.int64)}
            staged = _merged_ranges(spans) if compact and selected is not None else rows
            spec.datasets += [(f"{PACKED_GROUP}/gids", "gids", rows)]
            spec.datasets += [(f"{PACKED_GROUP}/{name}", name, staged) for name in row_names]
        specs.append(spec)
    return specs


def _packed_rows(plan, rank: int, gids: np.ndarray, a: int, b: int,
                 selected: np.ndarray | None) -> tuple[list, object, list]:
    """(the (table, start, stop, gid_min, gid_max) lines of local rows [a, b), the rows to write:
    one [(lo, hi)] range when whole shards are saved, else the selected rows, and those rows'
    [i, j) spans of positions in `selected`). Local."""
    lines, at, ranges, chosen, spans = [], 0, [], [], []
    for s in plan.shards_of(rank):
        lo, hi = max(a, s.local_start), min(b, s.local_start + s.rows)
        if lo >= hi:
            continue
        rows = None
        if selected is not None:
            i, j = (int(x) for x in np.searchsorted(selected, [lo, hi]))
            rows = selected[i:j]
            if i == j:
                continue
            spans.append((i, j))
        first, last = (lo, hi - 1) if rows is None else (int(rows[0]), int(rows[-1]))
        count = hi - lo if rows is None else len(rows)
        lines.append((s.table, at, at + count, int(gids[first]), int(gids[last])))
        at += count
        if rows is None:
            ranges.append((lo, hi))
        else:
            chosen.append(rows)
    if selected is not None:
        return lines, (np.concatenate(chosen) if chosen else selected[:0]), spans
    return lines, _merged_ranges(ranges), spans


def _merged_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent [a, b) ranges joined (a part's shards are consecutive local rows). Local."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def dense_spec(root: str, ckpt_id: str, step: int, arrays: dict, param_order) -> FileSpec:
    """The replicated dense state, written once (by rank 0's last writer), packed into one
    dataset (`store.dense_file`). `arrays` maps names under ``dense/`` to (shape, dtype), in the
    order to pack them; `param_order` numbers the dense optimizer state (``opt/<i>``). Local."""
    from mpickpt.store import dense_file

    entries, size, index = _dense_layout(tuple((name, (tuple(shape), dtype))
                                               for name, (shape, dtype) in arrays.items()))
    return FileSpec(root, dense_relpath(ckpt_id), "dense", 0, 0,
                    {"step": step, "kind": "full", "codec": "fp32",
                     "param_order": list(param_order)},
                    group_attrs={dense_file.GROUP: {dense_file.INDEX_ATTR: index}},
                    packs={dense_file.PACKED: (entries, size, "dense/")})


@lru_cache(maxsize=8)
def _dense_layout(arrays: tuple) -> tuple[tuple, int, str]:
    """(entries, pack size, index JSON) of the dense arrays ((name, (shape, dtype)), ...): laid
    out once per set of shapes, not in every stall (entries are frozen, so sharing them is
    safe). Local."""
    from mpickpt.store import dense_file

    entries, size = dense_file.layout(dict(arrays))
    return tuple(entries), size, dense_file.index_json(entries)


def extra_spec(root: str, ckpt_id: str, rank: int, step: int, kind: str, blobs: dict) -> FileSpec:
    """RNG states of a step whose rows live in a chain column. Local."""
    return FileSpec(root, extra_relpath(ckpt_id, rank), "extra", rank, 0,
                    {"step": step, "kind": kind, "rank": rank}, blobs=blobs)
