"""Which kinds exist: `--ckpt-kind` names to Kind classes, and manifest kinds to the class that
restores them. Local."""
from __future__ import annotations

from mpickpt.kinds.base import Kind
from mpickpt.kinds.consecutive import Consecutive
from mpickpt.kinds.differential import Differential
from mpickpt.kinds.full import Full
from mpickpt.kinds.incrcp import Incrcp
from mpickpt.kinds.intermittent import Intermittent
from mpickpt.kinds.priority import Priority
from mpickpt.store.errors import CheckpointError
from mpickpt.store.manifest import Manifest, parent_manifests
from mpickpt.store.segments import Segment

KIND_CLASSES: tuple[type[Kind], ...] = (Full, Differential, Consecutive, Intermittent, Incrcp,
                                        Priority)
"""Every `--ckpt-kind`, in the order `--help` lists them."""
KINDS = tuple(k.name for k in KIND_CLASSES)
_FORMATS = {k.format: k for k in reversed(KIND_CLASSES)}  # a shared format: its first kind


def kind_named(name: str, total_rows: int = 0, config=None) -> Kind:
    """A fresh Kind for `--ckpt-kind name` over a model of `total_rows` rows, reading its options
    from `config` (a CheckpointConfig); ValueError naming the choices otherwise. Local."""
    for cls in KIND_CLASSES:
        if cls.name == name:
            return cls(total_rows, config)
    raise ValueError(f"--ckpt-kind must be one of {', '.join(KINDS)}, got {name!r}")


def format_of(manifest) -> Kind:
    """The Kind that lays out and restores a committed checkpoint of `manifest.kind`. Local."""
    cls = _FORMATS.get(manifest.kind)
    if cls is None:
        raise CheckpointError(f"checkpoint step {manifest.step}: unknown kind {manifest.kind!r}")
    return cls()


def checkpoint_segments(root: str, manifest: Manifest,
                        by_step: dict[int, Manifest]) -> list[Segment]:
    """Every segment of `manifest`'s checkpoint in the order restore applies them; `by_step`
    holds the committed manifests it may build on. CheckpointError if a parent is gone. Local."""
    return format_of(manifest).segments(root, manifest, parent_manifests(manifest, by_step))
