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
poolings), a fused optimizer other than those above. This version meets the core contract only:
features that need row hooks (incremental kinds, parity, the step undo), row ranges or initial
rows refuse it by the contract's own check.
Construction is collective (the shard gather); the rest is local unless it says otherwise.
"""
from __future__ import annotations

import hashlib
import threading
from types import SimpleNamespace

import numpy as np
import torch

from mpickpt.model.dense_state import dense_state_of, load_dense_state_into
from mpickpt.model.shard_plan import Shard, ShardPlan

DIGEST_VERSION = b"mpickpt-torchrec-digest-v1"
_OPTIMIZERS = {"EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad", "EXACT_ADAGRAD": "adagrad",
               "EXACT_SGD": "sgd"}
"""fbgemm's EmbOptimType names -> mpickpt's optimizer kinds, for the fused optimizers read."""


class TorchRecContractError(ValueError):
    """A DMP model whose sharded modules this adapter cannot map."""


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


class FusedRows:
    """This rank's rows of one fused table-batched module: live views, global ids, lock."""

    def __init__(self, topo, fused, table_index: dict[str, int]):
        emb = fused.emb_module
        tables = fused.config.embedding_tables
        kind = getattr(emb.optimizer, "name", str(emb.optimizer))
        if kind not in _OPTIMIZERS:
            raise TorchRecContractError(
                f"fused optimizer {kind} of tables {[t.name for t in tables]}: mpickpt reads "
                f"{', '.join(_OPTIMIZERS)} (Adam's step counter is in no state dict)")
        dims = {t.local_cols for t in tables}
        if len(dims) != 1:
            raise TorchRecContractError(f"tables {[t.name for t in tables]} have dims {dims}: "
                                        f"one fused module must hold one dim")
        self.topo, self.dim = topo, dims.pop()
        self.device = topo.device
        self.state_lock = threading.RLock()
        self.tables = [(table_index[t.name], int(t.local_metadata.shard_offsets[0]),
                        int(t.local_rows)) for t in tables]
        self.weight = _stitch(emb.split_embedding_weights(), "weights")
        states = emb.split_optimizer_states() if kind != "EXACT_SGD" else []
        per_state = list(zip(*states)) if states else []
        self.optimizer = SimpleNamespace(
            config=SimpleNamespace(kind=_OPTIMIZERS[kind]),
            state={f"momentum{i + 1}": _stitch(list(parts), f"optimizer state {i}")
                   for i, parts in enumerate(per_state)})
        self.local_gids = np.empty(0, dtype=np.int64)  # set once the plan is known


class TorchRecModel:
    """A DMP model as mpickpt sees it. Construction is collective (over `topo.control`)."""

    def __init__(self, dmp, topo, dense_optimizer=None, loss_fn=None):
        """`dense_optimizer`: the torch optimizer of the dense part, or a callable that makes
        it from the dense parameters (None: no dense optimizer to save); `loss_fn(logits,
        labels)`: default binary cross-entropy with logits."""
        from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

        self.dmp, self.topo, self.dense_optimizer = dmp, topo, dense_optimizer
        self.loss_fn = loss_fn or torch.nn.functional.binary_cross_entropy_with_logits
        found = [(n, m) for n, m in dmp.module.named_modules()
                 if isinstance(m, ShardedEmbeddingBagCollection)]
        if len(found) != 1:
            raise TorchRecContractError(f"{type(dmp.module).__name__}: mpickpt maps a model "
                                        f"with one sharded EmbeddingBagCollection, found "
                                        f"{[n for n, _ in found] or 'none'}")
        self.sharded_path, self.sharded = found[0]
        configs = self.sharded._embedding_bag_configs
        self.table_names = [c.name for c in configs]
        self.table_sizes = [int(c.num_embeddings) for c in configs]
        _check_sharding(self.sharded, self.sharded_path)
        fused = [m for lookup in self.sharded._lookups for m in lookup._emb_modules]
        if len(fused) != 1:
            raise TorchRecContractError(
                f"{self.sharded_path}: this rank holds {len(fused)} fused embedding modules "
                f"(tables grouped by dim, pooling or kernel); mpickpt maps exactly one per rank")
        self.embeddings = FusedRows(topo, fused[0], {n: i for i, n in
                                                      enumerate(self.table_names)})
        self.plan = self._gather_plan()
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

    @property
    def state_lock(self):
        return self.embeddings.state_lock

    def _gather_plan(self) -> ShardPlan:
        """Every rank's shards in its local order, over the control channel. Collective."""
        local, mine = 0, []
        for table, row_start, rows in self.embeddings.tables:
            mine.append((table, row_start, row_start + rows, local))
            local += rows
        everyone = self.topo.control.allgather(mine)
        shards = [Shard(t, a, b, rank, start) for rank, part in enumerate(everyone)
                  for t, a, b, start in part]
        return ShardPlan.from_shards(self.table_sizes, self.topo.world_size, shards)

    # ---- training -------------------------------------------------------------------------------
    def train_step(self, batch, votes: torch.Tensor | None = None) -> float:
        """One step over this rank's part of the global batch (a torchrec `Batch`): forward,
        backward (the fused optimizer updates the rows in it), dense optimizer step; `votes`
        summed over the ranks in place. Collective. Returns the global mean loss."""
        with self.state_lock:
            logits = self.dmp(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = self.loss_fn(logits, batch.labels.float())
            if self.dense_optimizer is not None:
                self.dense_optimizer.zero_grad()
            loss.backward()
            extra = [loss.detach().reshape(1)] + ([votes.reshape(-1).float()]
                                                 if votes is not None else [])
            grads = [] if self.ddp else [p.grad if p.grad is not None else torch.zeros_like(p)
                                         for _, p in self.dense_params]
            flat = torch.cat([g.reshape(-1) for g in grads] + extra)
            self.topo.wait(torch.distributed.all_reduce(flat, group=self.topo.pg,
                                                        async_op=True))
            at, world = 0, self.topo.world_size
            for (_, p), g in zip(self.dense_params, grads):
                p.grad = (flat[at:at + g.numel()] / world).view_as(p)
                at += g.numel()
            if self.dense_optimizer is not None:
                self.dense_optimizer.step()
        if votes is not None:
            votes.copy_(flat[at + 1:].reshape(votes.shape).to(votes.dtype))
        return float(flat[at]) / world

    @torch.no_grad()
    def predict(self, batch) -> torch.Tensor:
        """Click probabilities of this rank's batch. Collective (the lookup is)."""
        return torch.sigmoid(self.dmp(batch.dense_features, batch.sparse_features).squeeze(-1))

    # ---- state ----------------------------------------------------------------------------------
    def row_state(self) -> dict[str, torch.Tensor]:
        """'weight' and 'state/<name>': live views of the fused module's buffers. Local."""
        emb = self.embeddings
        return {"weight": emb.weight, **{f"state/{k}": v for k, v in emb.optimizer.state.items()}}

    def dense_state(self) -> dict[str, torch.Tensor]:
        """'param/<name>' for the dense part and 'opt/<i>/<key>' for its optimizer. Local."""
        return dense_state_of(self.dense_params, self.dense_optimizer)

    @torch.no_grad()
    def load_row_state(self, arrays: dict) -> None:
        """Write this rank's rows and fused optimizer state into the fused module. Local."""
        mine = self.row_state()
        if set(arrays) != set(mine):
            raise ValueError(f"row state has {sorted(arrays)}, this model needs {sorted(mine)}")
        with self.state_lock:
            for name, target in mine.items():
                target.copy_(torch.as_tensor(arrays[name]).reshape(target.shape)
                             .to(target.device))

    def load_dense_state(self, arrays: dict) -> None:
        """Replace the dense parameters and the dense optimizer's state. Local."""
        with self.state_lock:
            load_dense_state_into(self.dense_params, self.dense_optimizer, arrays)

    def digest(self) -> str:
        """SHA-256 of the rows by global id (with their optimizer state) and the dense part.
        Collective; the same hex string on every rank."""
        emb = self.embeddings
        local = {k: t.detach().cpu().numpy() for k, t in self.row_state().items()}
        parts = self.topo.control.gather((emb.local_gids, local), root=0)
        hexdigest = None
        if self.topo.rank == 0:
            gids = np.concatenate([p[0] for p in parts])
            order = np.argsort(gids, kind="stable")
            h = hashlib.sha256(DIGEST_VERSION)
            for name in sorted(local):
                h.update(name.encode())
                h.update(np.ascontiguousarray(np.concatenate([p[1][name] for p in parts])[order])
                         .tobytes())
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


def _stitch(parts: list[torch.Tensor], what: str) -> torch.Tensor:
    """One live view over consecutive per-table slices of a flat buffer (rows first). Local."""
    first = parts[0]
    tail = tuple(first.shape[1:])
    width = int(np.prod(tail)) if tail else 1
    rows = sum(int(p.shape[0]) for p in parts)
    flat = torch.as_strided(first, (rows, *tail), (width, *first.stride()[1:]))
    at = 0
    for p in parts:
        if p.numel() and (p.data_ptr() != flat[at].data_ptr() or not p.is_contiguous()):
            raise TorchRecContractError(f"the fused module's {what} are not one flat buffer in "
                                        f"table order; mpickpt cannot view them in place")
        at += int(p.shape[0])
    return flat
