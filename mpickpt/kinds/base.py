"""What a checkpoint kind is: the one place that says, for one `--ckpt-kind`, whether a save is a
full baseline, which rows it writes, what it builds on, where its files go and how restore layers
it.

A `Kind` has two faces:

- planning (the trainer side, `KindPlanner` calls it): extra reasons for a new baseline and the rows
  and parents of an increment, from agreed inputs, so every rank decides the same;
- format (the reading side, `format_of(manifest.kind)`): the segments a committed checkpoint of
  this kind consists of, in the order restore applies them.

Every chain starts with a full baseline, whose format is `full` whatever the kind; increments carry
the kind's `format` name in their manifests. Two kinds may share a format (`intermittent` writes
`differential` increments). Adding a kind is one module with a `Kind` subclass plus its line in
`mpickpt.kinds.KIND_CLASSES`. Local: nothing here uses MPI.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpickpt.store.file_spec import shard_relpath
from mpickpt.store.manifest import Manifest
from mpickpt.store.segments import Segment


@dataclass
class ChainState:
    """A planner's current chain: its baseline and the increments written since."""

    since_base: np.ndarray
    """Per local row: changed since the baseline."""
    base_step: int | None = None
    """Step of the baseline; None until the next save, which must then be a baseline."""
    steps: list[int] = field(default_factory=list)
    """Steps of the increments since the baseline, oldest first."""
    name: str = ""
    """Chain identifier for kinds whose increments live in a chain directory (else '')."""


@dataclass
class SavePlan:
    """What one checkpoint writes."""

    kind: str
    """Format of this checkpoint as the manifest records it ('full' for a baseline)."""
    rows: np.ndarray | None
    """Sorted local rows to write, or None for every row."""
    parents: list[int]
    chain: str
    reason: str
    columns: list[int] = field(default_factory=list)
    """incrcp: the chain's incremental steps up to and including this one (its 2-D list columns)."""
    format: "Kind | None" = None
    """The kind object that lays this save's files out (set by the planner)."""

    @property
    def is_full(self) -> bool:
        return self.rows is None


@dataclass
class Increment:
    """An increment's rows and what restore needs besides them (a kind's `increment` answer)."""

    rows: np.ndarray
    parents: list[int]
    columns: list[int] = field(default_factory=list)


class Kind:
    """One checkpoint kind. Subclasses set the class attributes and override what differs."""

    name = ""
    """The `--ckpt-kind` value."""
    format = ""
    """Manifest kind of its increments (its own name unless it shares another kind's format)."""
    tracks_rows = True
    """Needs the modified-row bit-vector (every kind but `full`)."""
    layered = True
    """A checkpoint of this format reads files of other checkpoints (its parents) too."""
    rng_in_extra_file = False
    """Its increments' shard files live outside the step directory, so the RNG states of a step
    travel in a small per-rank extra file there."""
    save_share = 1.0
    """Share of each table's rows one save may write (below 1 for prioritized saves, which are
    then planned that much more often, for the same save bandwidth)."""
    exact = True
    """A checkpoint holds every row's value at its step (rows it does not write did not change
    since they were written); False for kinds that skip changed rows (prioritized saves)."""

    def __init__(self, total_rows: int = 0, config=None):
        """`total_rows`: rows of the whole model; `config`: the CheckpointConfig whose options a
        kind reads (None: its defaults, e.g. to restore a committed checkpoint). Local."""
        self.total_rows = total_rows

    # ---- planning ------------------------------------------------------------------------
    def baseline_reason(self, chain: ChainState, counts: np.ndarray, reduce_max) -> str | None:
        """Why the next save must be a new baseline although the chain has one (None: it need
        not). `counts` = [rows changed since the last save, since the baseline], summed over
        ranks; `reduce_max` agrees on a vector of local measurements. Collective when it
        reduces."""
        return None

    def chain_name(self, step: int, attempt: str) -> str:
        """Name of the chain a baseline at `step` starts ('' when increments need none)."""
        return ""

    def started(self, chain: ChainState) -> None:
        """A new baseline was planned: forget the previous chain's history. Local."""

    def increment(self, chain: ChainState, step: int, changed: np.ndarray,
                  counts: np.ndarray) -> Increment:
        """Rows and parents of the increment at `step` (`chain.steps` holds the earlier ones;
        `changed`: local rows changed since the last save). Local."""
        raise NotImplementedError

    def record_write(self, full: bool, seconds: float) -> None:
        """This rank's write time of a finished checkpoint. Local."""

    def record_restore(self, chain: str, step: int, seconds: float) -> None:
        """A measured restore of checkpoint `step`'s increments (from a companion). Local."""

    def attach(self, model) -> str | None:
        """Hook whatever the kind tracks into the model's embeddings (at construction of the
        manager); returns a line for the log, or None. Local."""
        return None

    def detach(self) -> None:
        """Undo `attach`. Local. Safe twice."""

    def companion(self, root: str, config, say, background):
        """A background service this kind's increments need after they are durable (IncrCP's
        extractor), or None; `background` (a `mpickpt.background_priority.Background`): how
        and where its process runs. Local."""
        return None

    # ---- files ------------------------------------------------------------------------------
    def shard_location(self, save: SavePlan, ckpt_id: str, rank: int, step: int,
                       part: int) -> tuple[str, str]:
        """(relative path, role) of one writer part's shard file of `save`. Local."""
        return shard_relpath(ckpt_id, rank, part), "shard"

    # ---- format -----------------------------------------------------------------------------
    def segments(self, root: str, manifest: Manifest, parents: list[Manifest]) -> list[Segment]:
        """Every segment of a committed checkpoint of this format, in the order restore applies
        them; `parents` are its committed parent manifests, oldest first. Local."""
        raise NotImplementedError

    def describe(self, root: str, manifest: Manifest) -> dict | None:
        """Format-specific facts for `mpickpt inspect` (None: nothing beyond the manifest).
        Local."""
        return None
