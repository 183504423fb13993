"""Snapshot: copy a rank's state into the staging area, and describe the files to write from it."""
from __future__ import annotations

import time

import torch

from mpickpt.engine.staging import StagingArea
from mpickpt.store.file_spec import FileSpec, dense_spec, extra_spec, shard_attrs, shard_specs


def shapes_of(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, numpy dtype name) of each tensor, in their order. Local."""
    return {name: (tuple(t.shape), numpy_dtype(t)) for name, t in tensors.items()}


def state_specs(model, rows: dict, dense: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every staged array: `rows` (the row state), global ids, and `dense`
    (keyed 'dense/<name>'; empty where this rank stages none). Local."""
    specs = shapes_of(rows)
    specs["gids"] = ((len(model.embeddings.local_gids),), "int64")
    specs.update(shapes_of(dense))
    return specs


_NUMPY_NAMES: dict[torch.dtype, str] = {}


def numpy_dtype(t: torch.Tensor) -> str:
    """numpy dtype name of a torch tensor (cached per dtype: it is part of every stall).
    Local."""
    name = _NUMPY_NAMES.get(t.dtype)
    if name is None:
        name = _NUMPY_NAMES[t.dtype] = str(torch.empty(0, dtype=t.dtype).numpy().dtype)
    return name


class Snapshotter:
    """Owns the staging area of one rank and copies state into it (the only training stall)."""

    def __init__(self, model, with_dense: bool):
        self.model, self.with_dense = model, with_dense
        self.area: StagingArea | None = None
        self.dense_shapes: dict[str, tuple[tuple[int, ...], str]] = {}
        """(shape, dtype) of the dense arrays staging was last prepared for, names without
        'dense/' (after `stage`: what it copied, which the dense file of that save describes)."""
        cuda = model.topo.device.type == "cuda"
        self._stream = torch.cuda.Stream() if cuda else None
        self.compact = False
        """Whether the last `stage` put the selected rows compactly, the k-th at row k of each
        row array (the writers then read one slice, not a gather)."""

    @property
    def copier_can_write(self) -> bool:
        """A copy-on-update copier can write rows into the staging area (CPU rows, or CUDA rows
        and an area page-locked and mapped for the device). Local."""
        return self._stream is None or (self.area is not None and self.area.mapped)

    def _state(self) -> tuple[dict, dict]:
        """(row state, dense state keyed 'dense/<name>' or {} where this rank stages none), each
        asked of the model once. Local."""
        rows = dict(self.model.row_state())
        dense = {f"dense/{k}": t for k, t in self.model.dense_state().items()} \
            if self.with_dense else {}
        return rows, dense

    def prepare(self, state: tuple[dict, dict] | None = None) -> None:
        """Allocate the staging area for the shapes of `state` (default: the model's now), if
        they changed. Local."""
        rows, dense = state or self._state()
        specs = state_specs(self.model, rows, dense)
        if self.area is None or not self.area.matches(specs):
            self._reallocate(specs)
        self.dense_shapes = {k[len("dense/"):]: v for k, v in specs.items()
                             if k.startswith("dense/")}

    def stage(self, copier=None, selected=None) -> tuple[float, int]:
        """Copy the state a save writes into staging; returns (seconds, bytes copied now).
        `selected`: the sorted local rows it writes (None: every row); on the CPU only those
        rows are copied, compactly (`compact`: the k-th at row k, one gather and no scatter;
        the writers read no other rows). With `copier` (a
        `CopyOnUpdate`) only the dense part is copied now and the rows are left to it: pending
        until copied in the background or before their first update (CUDA rows: only into a
        staging area the device can write, `StagingArea.mapped`). Local."""
        rows, dense = self._state()
        self.prepare((rows, dense))
        start = time.perf_counter()
        self.compact = False
        if copier is not None and self.copier_can_write:
            nbytes = self._copy(dense)
            targets = self.area.tensors()
            copier.start(rows, {name: targets[name] for name in rows}, selected)
        elif self._stream is not None:
            nbytes = self._copy({**rows, **dense})
        else:
            nbytes = self._copy(dense) + self._copy_rows(rows, selected)
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

    def _copy_rows(self, rows: dict[str, torch.Tensor], selected) -> int:
        """CPU: every row into its place in staging, or the `selected` local rows compactly,
        the k-th into row k (`compact`)."""
        if selected is None:
            return self._copy(rows)
        targets = self.area.tensors()
        idx = torch.as_tensor(selected, dtype=torch.int64)
        with torch.no_grad():  # out= refuses a source that requires grad
            for name, src in rows.items():
                torch.index_select(src, 0, idx, out=targets[name][:len(idx)])
        self.compact = True
        return sum(len(idx) * t[0].numel() * t.element_size() for t in rows.values() if len(t))

    def close(self) -> None:
        if self.area is not None:
            self.area.close()
            self.area = None


def save_file_specs(model, root: str, ckpt_id: str, step: int, parts: int, save,
                    codecs: dict, rng: dict, compact: bool = False) -> list[list[FileSpec]]:
    """The files of one save, one list per writer part: each part's shard file (where the save's
    kind puts it), and with the first part the RNG states, in the shard file or, for kinds whose
    increments live in a chain, in a small extra file of the step directory. Local.

    `codecs` maps row-array names to the lossy Codec the writer encodes them with; `compact`:
    the save's rows were staged compactly (`Snapshotter.compact`)."""
    plan, rank, fmt = model.plan, model.topo.rank, save.format
    label = codecs["weight"].label() if "weight" in codecs else "fp32"
    located = [fmt.shard_location(save, ckpt_id, rank, step, j) for j in range(parts)]
    specs = shard_specs(root, plan, rank, model.embeddings.local_gids, list(model.row_state()),
                        relpath_of=lambda j: located[j][0], role=located[0][1],
                        attrs_of=lambda j: shard_attrs(step, save.kind, label, rank, j, parts,
                                                       plan.world_size),
                        selected=save.rows, parts=parts, compact=compact,
                        codecs={name: codec_fields(c) for name, c in codecs.items()})
    groups = [[spec] for spec in specs]
    if fmt.rng_in_extra_file:
        groups[0].insert(0, extra_spec(root, ckpt_id, rank, step, save.kind, rng))
    else:
        specs[0].blobs = rng
    return groups


def codec_fields(codec) -> dict:
    """A Codec's fields as a plain dict, without its thread count (the writer process rebuilds
    the Codec from it). Local."""
    from dataclasses import asdict

    return {k: v for k, v in asdict(codec).items() if k != "threads"}


def dense_file_spec(shapes: dict, root: str, ckpt_id: str, step: int) -> FileSpec:
    """The replicated dense state, written once (by rank 0's last writer): `shapes`, the
    (shape, dtype) of each staged dense array (`Snapshotter.dense_shapes`), with the parameters
    in the order `dense_state()` lists them (the contract's core). Local."""
    return dense_spec(root, ckpt_id, step, shapes,
                      [n[len("param/"):] for n in shapes if n.startswith("param/")])


def rng_blobs() -> dict[str, bytes]:
    """This process's RNG states as bytes (torch CPU, and CUDA when present). Local."""
    blobs = {"extra/torch_cpu_rng": torch.get_rng_state().numpy().tobytes()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        blobs["extra/torch_cuda_rng"] = torch.cuda.get_rng_state().numpy().tobytes()
    return blobs
