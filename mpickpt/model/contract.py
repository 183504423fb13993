"""What mpickpt asks of a model: a core every model meets, and capabilities that features
require, written as typed protocols. `require(model, feature)` refuses a model that lacks what a
feature needs, before any work, naming the model, the members it lacks and the feature that needs
them; nothing is then checkpointed partly. `HybridDLRM` (mpickpt's own) meets all of them.

Invariants no protocol can state, which every model keeps:
- Row i of every `row_state()` tensor is local row i of this rank; `embeddings.local_gids` are
  their global ids, in the order of `plan.shards_of(rank)` (`ShardPlan.rank_global_ids`).
- `row_state()` holds `"weight"` ([rows, dim]) and optimizer state as `"state/<name>"`, each with
  the rows first; they are live tensors, updated in place (trackers keep references).
- `model.state_lock` is `embeddings.state_lock`, re-entrant: no survivor dump or snapshot sees a
  half-applied step.
- Index hooks see, in every lookup that updates rows, the sorted unique local rows the update
  touches (int64, on the model's device); update hooks bracket every sparse update.
- Embeddings that offer `add_gradient_hook(fn)` call every such `fn()` on every rank in each
  training step after the lookup and before that rank changes a row of the step (HybridDLRM's
  before the pooled gradients leave for their owners; the TorchRec adapter's when they have
  come back to the lookup's output, before the fused backward's update); parity's sweeps beside
  the step rely on it (a collective hook then holds every rank until all have called it).
  Embeddings without it are never asked to. Embeddings whose class sets
  `gradient_hooks_gate_updates = True` promise more: after its hooks every rank enters a
  collective over `topo.pg` that no rank leaves before all have entered it, and no rank changes
  a row of the step before it leaves (HybridDLRM: the pooled gradients' all-to-all), so that
  collective holds the ranks and the hook needs no exchange of its own.
- Embeddings that offer `add_exchange_hook(hook)` carry every hook's small int messages in each
  lookup's first exchange (`hook.outgoing()` before it, alike on every rank: None or one
  equal-length list per destination; `hook.incoming(fields)` after, before the index hooks);
  parity's rebuild rounds then add no exchange to a step. Embeddings without it are not asked.
- A model that keeps the process groups it was built on (the TorchRec adapter: its DMP) has
  `regroup()`, which in-place recovery calls on the survivors right after the next generation
  formed; a model that reads `topo.pg` at every call (HybridDLRM) needs none. Construction must
  not be collective beyond what a replacement and the survivors' `regroup` both do.
Local.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np
import torch


# ---- the core -----------------------------------------------------------------------------------
@runtime_checkable
class RowShard(Protocol):
    """The embedding rows a model keeps on this rank."""

    dim: int
    """the embedding dimension"""
    local_gids: np.ndarray
    """global row ids of this rank's rows, in local order (int64)"""
    device: torch.device
    state_lock: Any
    """re-entrant lock over every change of the rows"""
    optimizer: Any
    """the sparse optimizer: `optimizer.config.kind` (recorded in each checkpoint) and
    `optimizer.state`, name -> row-aligned float32 tensor"""


@runtime_checkable
class CheckpointableModel(Protocol):
    """Every model: trains one synchronous step, and hands out and takes back its state."""

    topo: Any
    """the job's `Topology` (rank, world, process groups)"""
    plan: Any
    """a `ShardPlan`: which rows of which table live on which rank"""
    embeddings: RowShard
    state_lock: Any

    def train_step(self, batch, votes: torch.Tensor | None = None) -> float:
        """One step over the global batch (collective); `votes` is summed over the ranks in
        place, inside the step's own allreduce (the stop vote)."""

    def row_state(self) -> dict[str, torch.Tensor]:
        """This rank's rows: "weight" and "state/<name>" (live tensors)."""

    def dense_state(self) -> dict[str, torch.Tensor]:
        """The replicated part: "param/<name>" and "opt/<i>/<key>"."""

    def load_row_state(self, arrays: dict) -> None:
        """Replace this rank's rows and their optimizer state."""

    def load_dense_state(self, arrays: dict) -> None:
        """Replace the replicated part and its optimizer state."""

    def predict(self, batch) -> torch.Tensor:
        """Click probabilities of a batch (collective, no update)."""

    def digest(self) -> str:
        """A hash of the whole model's state (collective)."""


# ---- capabilities ------------------------------------------------------------------------------
class IndexHooks(Protocol):
    """embeddings: `fn(rows)` sees the local rows each lookup will update."""

    def add_index_hook(self, fn: Callable[[torch.Tensor], None]) -> Callable[[], None]:
        """Add a hook; returns its remover."""


class UpdateHooks(Protocol):
    """embeddings: objects told before and after each sparse update (`before_update() ->
    token`, `after_update(rows, token)`, `step_done()`)."""

    def add_update_hook(self, hook) -> None: ...


class CountHooks(Protocol):
    """embeddings: `fn(rows, counts)` sees how often each row was looked up."""

    def add_count_hook(self, fn) -> Callable[[], None]: ...


class RowTensors(Protocol):
    """embeddings: the rows as one float32 tensor updated in place (with `optimizer.state`,
    what parity encodes and the step undo records)."""

    weight: torch.Tensor


class LosesRows(Protocol):
    """embeddings: wipe rows as a failed rank loses them (emulated failures, replacements)."""

    def wipe_rows(self, ranks) -> None: ...

    def wipe_range(self, start: int, stop: int) -> None: ...


class DenseUndo(Protocol):
    """The model: hooks run under the lock before the dense optimizer step, and that optimizer
    (its gradients are cleared when a step is taken back)."""

    before_dense_update: list
    dense_optimizer: Any


class RowRanges(Protocol):
    """The model: load a range of local rows from checkpoint arrays."""

    def load_row_range(self, arrays: dict, start: int, stop: int) -> None: ...


class InitialRows(Protocol):
    """The model: its state before the first step, for a loss before anything committed."""

    def initial_row_range(self, start: int, stop: int) -> dict: ...

    def reset_to_initial(self) -> None: ...


@dataclass(frozen=True)
class Capability:
    """A set of members, on the model or on its `embeddings`, that a feature needs."""

    name: str
    protocol: type
    on_embeddings: bool = False

    def members(self) -> list[str]:
        """The members' names, as `model.x` or `embeddings.x`. Local and pure."""
        names = set(getattr(self.protocol, "__annotations__", {}))
        names |= {n for n, v in vars(self.protocol).items()
                  if callable(v) and not n.startswith("_")}
        return sorted(names)

    def missing(self, model) -> list[str]:
        """The members `model` lacks, qualified. Local."""
        owner = getattr(model, "embeddings", None) if self.on_embeddings else model
        where = "embeddings." if self.on_embeddings else ""
        return [where + n for n in self.members() if owner is None or not hasattr(owner, n)]


CORE = Capability("core", CheckpointableModel)
CORE_ROWS = Capability("core rows", RowShard, on_embeddings=True)
INDEX_HOOKS = Capability("index hooks", IndexHooks, on_embeddings=True)
UPDATE_HOOKS = Capability("update hooks", UpdateHooks, on_embeddings=True)
COUNT_HOOKS = Capability("count hooks", CountHooks, on_embeddings=True)
ROW_TENSORS = Capability("row tensors", RowTensors, on_embeddings=True)
LOSES_ROWS = Capability("row loss", LosesRows, on_embeddings=True)
DENSE_UNDO = Capability("dense undo", DenseUndo)
ROW_RANGES = Capability("row ranges", RowRanges)
INITIAL_ROWS = Capability("initial rows", InitialRows)
CAPABILITIES = (CORE, CORE_ROWS, INDEX_HOOKS, UPDATE_HOOKS, COUNT_HOOKS, ROW_TENSORS,
                LOSES_ROWS, DENSE_UNDO, ROW_RANGES, INITIAL_ROWS)

@dataclass(frozen=True)
class Feature:
    """What a user switches on, and the capabilities it needs of the model."""

    name: str
    needs: tuple[Capability, ...]


TRAINING = Feature("training", (CORE, CORE_ROWS))
INCREMENTAL = Feature("incremental checkpoints (--ckpt-kind other than full)", (INDEX_HOOKS,))
PRIORITY = Feature("prioritized saves (--ckpt-kind priority)",
                   (INDEX_HOOKS, COUNT_HOOKS, ROW_TENSORS))
PARITY = Feature("parity (--parity-k)", (INDEX_HOOKS, UPDATE_HOOKS, ROW_TENSORS, LOSES_ROWS))
STEP_UNDO = Feature("survivor dumps and in-place recovery (the step undo)",
                    (UPDATE_HOOKS, ROW_TENSORS, DENSE_UNDO, LOSES_ROWS))
PARTIAL = Feature("partial recovery (--recovery partial)", (ROW_RANGES,))
FROM_START = Feature("a recovery before the first checkpoint committed", (INITIAL_ROWS,))
EMULATED_FAILURES = Feature("emulated failures (--inject-failure, --failure-model)",
                            (LOSES_ROWS,))
COPY_ON_UPDATE = Feature("copy-on-update snapshots (--ckpt-snapshot copy-on-update)",
                         (UPDATE_HOOKS,))
FEATURES = (TRAINING, INCREMENTAL, PRIORITY, PARITY, STEP_UNDO, PARTIAL, FROM_START,
            EMULATED_FAILURES, COPY_ON_UPDATE)


class ModelContractError(ValueError):
    """A model lacks members a feature needs (raised before any work)."""


def missing_for(model, feature: Feature) -> list[str]:
    """The members `model` lacks for `feature`, qualified (`embeddings.x`). Local."""
    return [m for cap in feature.needs for m in cap.missing(model)]


def require(model, feature: Feature) -> None:
    """Refuse `model` for `feature` unless it has every member the feature needs:
    ModelContractError naming the model's class, the missing members and the feature. Local."""
    missing = missing_for(model, feature)
    if missing:
        raise ModelContractError(
            f"{type(model).__name__} cannot be used with {feature.name}: it lacks "
            f"{', '.join(missing)} ({', '.join(c.name for c in feature.needs)}; see "
            f"mpickpt.model.contract)")


def capabilities_of(model) -> list[str]:
    """The names of the capabilities `model` has in full. Local."""
    return [c.name for c in CAPABILITIES if not c.missing(model)]
