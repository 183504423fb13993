"""TorchRecModel: a TorchRec `DistributedModelParallel` (DMP) model under mpickpt's model
contract (`mpickpt.model.contract`), so that `CheckpointManager(topo, config, TorchRecModel(dmp,
topo))` checkpoints and restores it.

What it maps (measured on torchrec 1.8.0 with fbgemm-gpu-cpu 1.8.0):
- The DMP's one `ShardedEmbeddingBagCollection` keeps this rank's rows in fused table-batched
  modules (`_lookups[i]._emb_modules[j]`, each a `BatchedFusedEmbeddingBag` around fbgemm's
  `SplitTableBatchedEmbeddingBagsCodegen`). Its tables' weights (`split_embedding_weights()`) are
  consecutive slices of one flat buffer, and so are its optimizer states
  (`split_optimizer_states()`): the row state here is a live [rows, dim] view of that buffer
  (writes reach the next forward; the DMP `state_dict`'s local shards are views of it too).
- Table-wise and row-wise shards (`config.embedding_tables[k].local_metadata.shard_offsets`)
  become a `ShardPlan.from_shards` in the module's own local row order; every rank's shards are
  gathered once over the control channel. Global ids follow the EBC's table order.
- Fused optimizers readable here: exact row-wise Adagrad (`state/momentum1`, one value per row),
  exact Adagrad (`state/momentum1`, [rows, dim]) and SGD (no state). fbgemm's CPU kernel has no
  Adam; its step counter is not in any state dict (refused).
- The dense part (every parameter outside the sharded collection: bottom and over arch) and the
  dense optimizer given here are saved as they are ("param/<name>", "opt/<i>/<key>").

Refused at construction, naming the module: no or several sharded collections, column-wise or
table-row-wise shards, several fused modules on one rank (tables of different dims or
poolings, or table-wise beside row-wise tables), a fused optimizer other than those above.

Beyond the core it has every capability of the contract (`FusedRows` has the row hooks, read
from the lookup's ids, and the row loss; the model the row ranges, the dense undo and, built
with `init_seed`, the initial rows), so incremental kinds, quantized saves, prioritized saves,
parity, the step undo and partial recovery take it as they take `HybridDLRM`.
Construction is local (the shards come from the sharding plan's metadata); the rest is local
unless it says otherwise.
"""
from __future__ import annotations

import hashlib
import numpy as np
import torch

from mpickpt.model.dense_state import dense_state_of, load_dense_state_into
from mpickpt.model.embedding import initial_rows_of
from mpickpt.model.shard_plan import Shard, ShardPlan
from mpickpt.model.torchrec_rows import FusedRows, TorchRecContractError

__all__ = ["TorchRecModel", "TorchRecContractError", "dense_allreduce_wrapper"]

DIGEST_VERSION = b"mpickpt-torchrec-digest-v1"


def dense_allreduce_wrapper():
    """A data-parallel wrapper for `DistributedModelParallel(data_parallel_wrapper=...)` that
    leaves the dense part unwrapped: `TorchRecModel.train_step` then averages its gradients in
    one flat allreduce in a fixed order, with the stop votes in it. DDP's buckets are rebuilt
    after its first iteration, which changes the order gloo sums each element in at more than
    two ranks: a DDP model restored from a checkpoint then drifts from the uninterrupted run in
    the last bit (measured: 4 ranks, equal state after the restore, different dense gradients
    one step later). Local."""
    from torchrec.distributed.model_parallel import DataParallelWrapper

    class DenseAllreduce(DataParallelWrapper):
        def wrap(self, dmp, env, device) -> None:
            return None

    return DenseAllreduce()


class TorchRecModel:
    """A DMP model as mpickpt sees it. Construction is local."""

    def __init__(self, dmp, topo, dense_optimizer=None, loss_fn=None,
                 init_seed: int | None = None, shard_lost: bool = False):
        """`dense_optimizer`: the torch optimizer of the dense part, or a callable that makes
        it from the dense parameters (None: no dense optimizer to save); `loss_fn(logits,
        labels)`: default binary cross-entropy with logits; `init_seed`: rewrite every row with
        mpickpt's initialization (a pure function of the seed and the global row id, so every
        world size and sharding plan starts from the same rows) and zero its optimizer state;
        then the model can also start over (`initial_row_range`, `reset_to_initial`). None
        keeps TorchRec's own initial rows, which nothing can recompute. `shard_lost`: this
        rank's rows start lost (NaN), for a process that replaces a dead rank."""
        from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

        self.dmp, self.topo, self.dense_optimizer = dmp, topo, dense_optimizer
        self.loss_fn = loss_fn or torch.nn.functional.binary_cross_entropy_with_logits
        from torchrec.distributed.types import ShardedModule

        found = [(n, m) for n, m in dmp.module.named_modules()
                 if isinstance(m, ShardedEmbeddingBagCollection)]
        unmapped = {n or type(dmp.module).__name__: type(m).__name__
                    for n, m in dmp.module.named_modules()
                    if isinstance(m, ShardedModule) and (len(found) != 1 or m is not found[0][1])}
        if unmapped and len(found) == 1:  # e.g. managed collisions, sequence embeddings: their
            raise TorchRecContractError(  # state would be left out of every checkpoint
                f"{type(dmp.module).__name__}: sharded modules {unmapped} are not mapped by "
                f"mpickpt (it maps one ShardedEmbeddingBagCollection with table-wise or "
                f"row-wise fused tables); their state would be missing from checkpoints")
        if len(found) != 1:
            raise TorchRecContractError(f"{type(dmp.module).__name__}: mpickpt maps a model "
                                        f"with one sharded EmbeddingBagCollection, found "
                                        f"{[n for n, _ in found] or 'none'}")
        self.sharded_path, self.sharded = found[0]
        configs = self.sharded._embedding_bag_configs
        self.table_names = [c.name for c in configs]
        self.table_sizes = [int(c.num_embeddings) for c in configs]
        self.feature_names = [f for c in configs for f in c.feature_names]
        _check_sharding(self.sharded, self.sharded_path)
        modules = [(lookup, m) for lookup in self.sharded._lookups for m in lookup._emb_modules]
        if len(modules) != 1:
            raise TorchRecContractError(
                f"{self.sharded_path}: this rank holds {len(modules)} fused embedding modules "
                f"(tables grouped by dim, pooling, kernel or sharding type); mpickpt maps "
                f"exactly one per rank")
        self.embeddings = FusedRows(topo, *modules[0], {n: i for i, n in
                                                         enumerate(self.table_names)})
        self.plan = self._plan_from_spec()
        self._pg = topo.pg
        self.embeddings.local_gids = self.plan.rank_global_ids(topo.rank)
        sparse = {id(p) for p in self.sharded.parameters()}
        self.dense_params = [(n, p) for n, p in dmp.named_parameters()
                             if id(p) not in sparse and isinstance(p, torch.nn.Parameter)
                             and type(p.data) is torch.Tensor]
        if callable(dense_optimizer) and not isinstance(dense_optimizer, torch.optim.Optimizer):
            self.dense_optimizer = dense_optimizer([p for _, p in self.dense_params])
        self.ddp = any(isinstance(m, torch.nn.parallel.DistributedDataParallel)
                       for m in dmp.modules())
        """The dense part is DDP-wrapped (DMP's default): DDP averages its gradients; else
        (`dense_allreduce_wrapper`) `train_step` does, deterministically."""
        self.before_dense_update: list = []
        """Callables run under the lock right before the dense optimizer step (the undo)."""
        self.init_seed = init_seed
        if init_seed is not None and not shard_lost:
            self.load_row_state(self._initial_row_range(0, len(self.embeddings.local_gids)))
        self._initial_dense = {k: v.clone() for k, v in self.dense_state().items()}
        if shard_lost:
            self.embeddings.wipe_range(0, len(self.embeddings.local_gids))

    @property
    def state_lock(self):
        return self.embeddings.state_lock

    def _plan_from_spec(self) -> ShardPlan:
        """Every rank's shards, read from the sharding plan's shard metadata (no collective: a
        replacement builds its model beside survivors that do not). Each rank's local order is
        the collection's table order; this rank's fused module is checked to agree. Local."""
        per_rank: dict[int, list] = {}
        for t, name in enumerate(self.table_names):
            spec = self.sharded.module_sharding_plan[name].sharding_spec
            for shard in spec.shards:
                rank, start = shard.placement.rank(), int(shard.shard_offsets[0])
                rows = int(shard.shard_sizes[0])
                if rows:  # row-wise: ceil(rows / world) each, so the last ranks may get none
                    per_rank.setdefault(rank, []).append((t, start, start + rows))
        shards = []
        for rank, parts in per_rank.items():
            local = 0
            for t, a, b in parts:
                shards.append(Shard(t, a, b, rank, local))
                local += b - a
        mine = [(s.table, s.row_start, s.row_end - s.row_start)
                for s in sorted((s for s in shards if s.rank == self.topo.rank),
                                key=lambda s: s.local_start)]
        if mine != [t for t in self.embeddings.tables if t[2]]:
            raise TorchRecContractError(f"{self.sharded_path}: the fused module holds "
                                        f"{self.embeddings.tables} (table, first row, rows), "
                                        f"its sharding plan says {mine}")
        return ShardPlan.from_shards(self.table_sizes, self.topo.world_size, shards)

    def regroup(self) -> None:
        """Point the DMP at the process group of the job's current generation (after an
        in-place recovery formed it): every reference to the group it was built on, in the
        sharded modules, their dists, sharding environment and fused optimizer, is replaced.
        Local."""
        new = self.topo.pg
        if new is not self._pg:
            replaced = replace_references(self.dmp, self._pg, new)
            if not replaced:
                raise RuntimeError("the DMP holds no reference to its process group")
            self._pg = new

    # ---- training -------------------------------------------------------------------------------
    def inputs(self, batch):
        """(dense features, KeyedJaggedTensor, labels) of a torchrec `Batch` or of mpickpt's
        `Batch` (sparse (n, T, L): T features in the collection's order, L ids each). Local."""
        if hasattr(batch, "sparse_features"):
            return batch.dense_features, batch.sparse_features, batch.labels.float()
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        n, features, pooling = batch.sparse.shape
        if features != len(self.feature_names):
            raise ValueError(f"batch has {features} sparse features, the collection reads "
                             f"{len(self.feature_names)} ({self.feature_names})")
        kjt = KeyedJaggedTensor(keys=self.feature_names,
                                values=batch.sparse.permute(1, 0, 2).reshape(-1),
                                lengths=torch.full((n * features,), pooling, dtype=torch.int32))
        return batch.dense, kjt, batch.labels

    def train_step(self, batch, votes: torch.Tensor | None = None) -> float:
        """One step over this rank's part of the global batch (a torchrec `Batch` or mpickpt's):
        forward (the lookup's rows go to the row hooks), backward (the fused optimizer updates
        the rows in it, under the lock), dense gradients averaged with the loss and the `votes`
        in one allreduce, dense optimizer step, update hooks' `step_done`. Collective. Returns
        the global mean loss."""
        dense, kjt, labels = self.inputs(batch)
        emb = self.embeddings
        if self.dense_optimizer is not None:
            self.dense_optimizer.zero_grad(set_to_none=True)
        emb.training(True)
        try:
            logits = self.dmp(dense, kjt).squeeze(-1)
            loss = self.loss_fn(logits, labels)
            loss.backward()
        finally:
            emb.training(False)
        emb.after_backward()
        extra = [loss.detach().reshape(1)] + ([votes.reshape(-1).float()]
                                             if votes is not None else [])
        grads = [] if self.ddp else [p.grad if p.grad is not None else torch.zeros_like(p)
                                     for _, p in self.dense_params]
        flat = torch.cat([g.reshape(-1) for g in grads] + extra)
        self.topo.wait(torch.distributed.all_reduce(flat, group=self.topo.pg, async_op=True))
        at, world = 0, self.topo.world_size
        for (_, p), g in zip(self.dense_params, grads):
            p.grad = (flat[at:at + g.numel()] / world).view_as(p)
            at += g.numel()
        with self.state_lock:
            for hook in self.before_dense_update:
                hook()
            if self.dense_optimizer is not None:
                self.dense_optimizer.step()
        emb.finish_step()
        if votes is not None:
            votes.copy_(flat[at + 1:].reshape(votes.shape).to(votes.dtype))
        return float(flat[at]) / world

    @torch.no_grad()
    def predict(self, batch) -> torch.Tensor:
        """Click probabilities of this rank's batch. Collective (the lookup is)."""
        dense, kjt, _ = self.inputs(batch)
        return torch.sigmoid(self.dmp(dense, kjt).squeeze(-1))

    # ---- state ----------------------------------------------------------------------------------
    def row_state(self) -> dict[str, torch.Tensor]:
        """'weight' and 'state/<name>': live views of the fused module's buffers. Local."""
        emb = self.embeddings
        return {"weight": emb.weight, **{f"state/{k}": v for k, v in emb.optimizer.state.items()}}

    def dense_state(self) -> dict[str, torch.Tensor]:
        """'param/<name>' for the dense part and 'opt/<i>/<key>' for its optimizer. Local."""
        return dense_state_of(self.dense_params, self.dense_optimizer)

    def load_row_state(self, arrays: dict) -> None:
        """Write this rank's rows and fused optimizer state into the fused module. Local."""
        self.load_row_range(arrays, 0, len(self.embeddings.local_gids))

    @torch.no_grad()
    def load_row_range(self, arrays: dict, start: int, stop: int) -> None:
        """Write local rows [start, stop) (and their optimizer state) from `arrays`. Local."""
        mine = self.row_state()
        if set(arrays) != set(mine):
            raise ValueError(f"row state has {sorted(arrays)}, this model needs {sorted(mine)}")
        with self.state_lock:
            for name, target in mine.items():
                part = target[start:stop]
                part.copy_(torch.as_tensor(arrays[name]).reshape(part.shape).to(part.device))

    def load_dense_state(self, arrays: dict) -> None:
        """Replace the dense parameters and the dense optimizer's state. Local."""
        with self.state_lock:
            load_dense_state_into(self.dense_params, self.dense_optimizer, arrays)

    # ---- starting over (only with init_seed) ----------------------------------------------------
    @property
    def initial_row_range(self):
        """`initial_row_range(start, stop)`: local rows [start, stop) as before training
        (mpickpt's initialization, zero optimizer state), on the CPU. Local. Only with
        `init_seed` (AttributeError otherwise, so the contract counts it missing)."""
        self._need_seed("initial_row_range")
        return self._initial_row_range

    @property
    def reset_to_initial(self):
        """`reset_to_initial()`: every row, the dense part and its optimizer as before the
        first step. Local. Only with `init_seed`."""
        self._need_seed("reset_to_initial")
        return self._reset_to_initial

    def _need_seed(self, name: str) -> None:
        if self.init_seed is None:
            raise AttributeError(f"TorchRecModel.{name}: built without init_seed, its initial "
                                 f"rows are TorchRec's own and cannot be recomputed")

    def _initial_row_range(self, start: int, stop: int) -> dict:
        rows = initial_rows_of(self.init_seed, self.plan, self.embeddings.local_gids[start:stop],
                               self.embeddings.dim)
        return {name: rows if name == "weight" else
                torch.zeros((stop - start,) + tuple(t.shape[1:]), dtype=t.dtype)
                for name, t in self.row_state().items()}

    def _reset_to_initial(self) -> None:
        with self.state_lock:
            self.load_row_state(self._initial_row_range(0, len(self.embeddings.local_gids)))
            self.load_dense_state(self._initial_dense)

    def digest(self) -> str:
        """SHA-256 of the rows by global id (with their optimizer state) and the dense part,
        hashed on rank 0 one table of one array at a time as they arrive. Collective; the same
        hex string on every rank."""
        gids = self.embeddings.local_gids
        tables, _ = self.plan.split_global(gids)
        local = {k: t.detach().cpu().numpy() for k, t in self.row_state().items()}
        h = hashlib.sha256(DIGEST_VERSION) if self.topo.rank == 0 else None
        for name in sorted(local):
            if h is not None:
                h.update(name.encode())
            for t in range(self.plan.num_tables):  # a table's ids follow the one before's
                mask = tables == t
                parts = self.topo.control.gather((gids[mask], local[name][mask]), root=0)
                if h is not None:
                    order = np.argsort(np.concatenate([p[0] for p in parts]), kind="stable")
                    h.update(np.ascontiguousarray(np.concatenate([p[1] for p in parts])[order])
                             .tobytes())
        hexdigest = None
        if h is not None:
            for name, value in sorted(self.dense_state().items()):
                h.update(name.encode())
                h.update(np.ascontiguousarray(value.cpu().numpy()).tobytes())
            hexdigest = h.hexdigest()
        return self.topo.control.bcast(hexdigest, root=0)


def _check_sharding(sharded, path: str) -> None:
    """Refuse column-wise and table-row-wise shards, naming the tables."""
    wrong = {}
    for name, spec in getattr(sharded, "module_sharding_plan", {}).items():
        kind = str(getattr(spec, "sharding_type", ""))
        if kind not in ("table_wise", "row_wise"):
            wrong[name] = kind
    if wrong:
        raise TorchRecContractError(f"{path}: tables {wrong} are sharded in a way mpickpt does "
                                    f"not map; supported: table_wise, row_wise")


def replace_references(root, old, new, limit: int = 200_000) -> int:
    """Replace every reference to `old` reachable from `root` (object attributes, lists,
    dicts; tensors are not entered) with `new`; returns how many were replaced. Local."""
    seen, stack, count = set(), [root], 0
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, type, str, bytes, int, float)):
            continue
        seen.add(id(obj))
        if isinstance(obj, list):
            items = list(enumerate(obj))
        elif isinstance(obj, dict):
            items = list(obj.items())
        elif isinstance(obj, tuple):
            stack.extend(obj)
            continue
        elif hasattr(obj, "__dict__"):
            items = list(vars(obj).items())
        else:
            continue
        for key, value in items:
            if value is old:
                if hasattr(obj, "__dict__") and not isinstance(obj, (list, dict)):
                    setattr(obj, key, new)
                else:
                    obj[key] = new
                count += 1
            else:
                stack.append(value)
    return count
