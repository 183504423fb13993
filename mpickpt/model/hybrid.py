"""The hybrid-parallel DLRM: sharded embedding bags (model parallel) + replicated dense part (data
parallel), with one training step that a checkpoint manager can wrap."""
from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpickpt.model.dense import DenseArch, DLRMDense
from mpickpt.model.dense_state import dense_state_of, load_dense_state_into
from mpickpt.model.embedding import ShardedEmbeddingBags
from mpickpt.model.optimizers import OptimizerConfig, make_dense_optimizer
from mpickpt.model.shard_plan import ShardPlan, ShardPlanOptions
from mpickpt.timing import PhaseTimer

DIGEST_VERSION = b"mpickpt-digest-v1"


class HybridDLRM:
    """One rank's part of the model. Construction is local but deterministic (same seed, same model
    on every rank and for every world size); `train_step`, `predict`, `gather_tables` and `digest`
    are collective."""

    def __init__(self, topo, arch: DenseArch, table_sizes, optim: OptimizerConfig, seed: int,
                 plan_options: ShardPlanOptions | None = None, timer: PhaseTimer | None = None,
                 shard_lost: bool = False):
        """`shard_lost`: this rank's shard starts lost (a replacement of a dead rank; see
        ShardedEmbeddingBags)."""
        if len(table_sizes) != arch.num_tables:
            raise ValueError(f"{len(table_sizes)} tables given, dense arch expects {arch.num_tables}")
        self.topo, self.arch, self.optim, self.seed = topo, arch, optim, seed
        self.timer = timer or PhaseTimer(topo.device, enabled=False)
        self.plan = ShardPlan.build(table_sizes, topo.world_size, plan_options)
        self.embeddings = ShardedEmbeddingBags(topo, self.plan, arch.dim, optim, seed, self.timer,
                                               lost=shard_lost)
        self.dense = self._initial_dense()
        self.dense_optimizer = make_dense_optimizer(optim, self.dense.parameters())
        self.steps_done = 0
        self.before_dense_update: list = []
        """Callables run right before the dense optimizer step (the survivors' undo log)."""

    @property
    def state_lock(self):
        """Held while this rank's state changes (see ShardedEmbeddingBags.state_lock)."""
        return self.embeddings.state_lock

    def _initial_dense(self) -> DLRMDense:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return DLRMDense(self.arch).to(self.topo.device)

    @torch.no_grad()
    def reset_to_initial(self) -> None:
        """Every row, the optimizer state and the dense part as before the first step (a rollback
        with nothing committed). Local, and the same on every rank."""
        with self.state_lock:
            n = len(self.embeddings.local_gids)
            self.load_row_state({k: v.cpu() for k, v in self.initial_row_range(0, n).items()})
            initial = self._initial_dense()
            for p, q in zip(self.dense.parameters(), initial.parameters()):
                p.copy_(q)
            self.dense_optimizer = make_dense_optimizer(self.optim, self.dense.parameters())

    def train_step(self, batch, votes: torch.Tensor | None = None) -> float:
        """One synchronous step on this rank's slice of the global batch; returns the global mean
        loss. Collective: all-to-alls on the embeddings, one allreduce for dense gradients + loss.

        `votes` (a small float tensor) rides the allreduce and comes back summed over the ranks,
        in place: agreement on a step boundary at no extra collective (the stop signal vote)."""
        batch = batch.to(self.topo.device)
        pooled, ctx = self.embeddings.lookup(batch.sparse, update=True)
        leaf = pooled.detach().requires_grad_()
        global_batch = batch.size * self.topo.world_size
        with self.timer.phase("dense"):
            logits = self.dense(batch.dense, leaf)
            loss_sum = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="sum")
            (loss_sum / global_batch).backward()
        # sparse first: update hooks (parity upkeep) exchange their data during the allreduce
        self.embeddings.apply_gradients(leaf.grad, ctx)
        with self.timer.phase("allreduce"):
            loss = self._allreduce_dense_grads(loss_sum.detach(), votes) / global_batch
        with self.timer.phase("dense"), self.state_lock:
            for hook in self.before_dense_update:
                hook()
            self.dense_optimizer.step()
            self.dense_optimizer.zero_grad(set_to_none=True)
        self.embeddings.finish_step()
        self.steps_done += 1
        return loss

    def _allreduce_dense_grads(self, loss_sum: torch.Tensor, votes=None) -> float:
        """Sum dense gradients, the loss and the votes over ranks in one flat buffer.
        Collective."""
        grads = [p.grad for p in self.dense.parameters()]
        extra = [] if votes is None else [votes.to(loss_sum.device, loss_sum.dtype).reshape(-1)]
        flat = torch.cat([g.reshape(-1) for g in grads] + [loss_sum.reshape(1)] + extra)
        self.topo.wait(dist.all_reduce(flat, group=self.topo.pg, async_op=True))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
        if votes is not None:
            votes.copy_(flat[offset + 1:].view_as(votes))
        return float(flat[offset])

    @torch.no_grad()
    def predict(self, batch) -> torch.Tensor:
        """Click probabilities for this rank's batch. Collective (the lookup is)."""
        batch = batch.to(self.topo.device)
        pooled, _ = self.embeddings.lookup(batch.sparse)
        return torch.sigmoid(self.dense(batch.dense, pooled))

    def row_state(self) -> dict[str, torch.Tensor]:
        """This rank's row-aligned state: 'weight' and 'state/<name>' (n_local, ...). Local."""
        emb = self.embeddings
        return {"weight": emb.weight, **{f"state/{k}": v for k, v in emb.optimizer.state.items()}}

    def dense_state(self) -> dict[str, torch.Tensor]:
        """Replicated state: 'param/<name>' and 'opt/<i>/<key>' tensors. Local."""
        return dense_state_of(self.dense.named_parameters(), self.dense_optimizer)

    @torch.no_grad()
    def load_row_state(self, arrays: dict) -> None:
        """Replace this rank's rows and sparse optimizer state (full local arrays). Local."""
        mine = self._matching_rows(arrays)
        with self.state_lock:
            for name, target in mine.items():
                target.copy_(torch.as_tensor(arrays[name]).to(target.device))

    @torch.no_grad()
    def load_row_range(self, arrays: dict, start: int, stop: int) -> None:
        """Replace local rows [start, stop) of the weights and sparse optimizer state. Local."""
        mine = self._matching_rows(arrays)
        with self.state_lock:
            for name, target in mine.items():
                target[start:stop] = torch.as_tensor(arrays[name]).to(target.device)

    def _matching_rows(self, arrays: dict) -> dict:
        """This rank's row state, once `arrays` is checked to hold the same arrays. Local."""
        mine = self.row_state()
        if set(arrays) != set(mine):
            raise ValueError(f"row state has {sorted(arrays)}, this model needs {sorted(mine)}")
        return mine

    def initial_row_range(self, start: int, stop: int) -> dict:
        """Local rows [start, stop) as they were before training (weights and optimizer state).
        Local."""
        rows = self.embeddings.initial_rows(start, stop)
        return {name: (rows if name == "weight" else torch.zeros_like(t[start:stop], device="cpu"))
                for name, t in self.row_state().items()}

    def load_dense_state(self, arrays: dict) -> None:
        """Replace dense parameters and dense optimizer state. Local."""
        with self.state_lock:
            load_dense_state_into(self.dense.named_parameters(), self.dense_optimizer, arrays)

    def gather_tables(self, root: int = 0) -> dict | None:
        """Every table's rows and sparse optimizer state in global row order, on `root` only.

        Collective over the control channel. Returns {table: {"weight": array, state: array}}
        on root, None elsewhere: the whole model's rows on root (`each_table` holds one)."""
        out = {} if self.topo.rank == root else None
        for t, arrays in self.each_table(root):
            if out is not None:
                out[t] = arrays
        return out

    def each_table(self, root: int = 0):
        """Yield (table, {"weight": array, state: array}) in table order, the arrays in global
        row order on `root` and None elsewhere: one table's rows on root at a time. Collective
        over the control channel (every rank iterates to the end)."""
        emb = self.embeddings
        tables, _ = self.plan.split_global(emb.local_gids)
        arrays = {"weight": emb.weight, **emb.optimizer.state}
        local = {name: t.detach().cpu().numpy() for name, t in arrays.items()}
        for t in range(self.plan.num_tables):
            mask = tables == t
            part = (emb.local_gids[mask], {k: v[mask] for k, v in local.items()})
            parts = self.topo.control.gather(part, root=root)
            yield t, (_assemble(parts) if self.topo.rank == root else None)

    def digest(self) -> str:
        """SHA-256 of the whole training state in a canonical, world-size-independent order:
        embedding rows by global id, their optimizer state, dense parameters, dense optimizer
        state; hashed on rank 0 table by table as they arrive. Collective; every rank returns
        the same hex string."""
        h = hashlib.sha256(DIGEST_VERSION) if self.topo.rank == 0 else None
        for t, arrays in self.each_table(root=0):
            if h is not None:
                for name in sorted(arrays):
                    h.update(f"table{t}/{name}".encode())
                    h.update(np.ascontiguousarray(arrays[name]).tobytes())
        hexdigest = None
        if h is not None:
            _hash_dense(h, self.dense, self.dense_optimizer)
            hexdigest = h.hexdigest()
        return self.topo.control.bcast(hexdigest, root=0)


def _assemble(parts) -> dict[str, np.ndarray]:
    gids = np.concatenate([p[0] for p in parts])
    order = np.argsort(gids, kind="stable")
    return {k: np.concatenate([p[1][k] for p in parts])[order] for k in parts[0][1]}


def _hash_dense(h, dense, optimizer) -> None:
    for name, p in dense.named_parameters():
        h.update(f"dense/{name}".encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    for i, p in enumerate(dense.parameters()):
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            h.update(f"dense_opt/{i}/{key}".encode())
            h.update(torch.as_tensor(value).detach().cpu().contiguous().numpy().tobytes())
