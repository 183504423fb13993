"""Sharded embedding bags: model-parallel tables exchanged with all-to-all.

Per step, on every rank (collective over the topology's process group):

1. `lookup`: the rank's (B, T, L) indices are routed to the rows' owners (all-to-all #1: counts, then
   (local row, segment) pairs). Owners call the *index hooks* with the local rows they received (row
   tracking attaches there), pool their rows per requested bag segment with `embedding_bag(sum)`, and
   send the pooled vectors back (all-to-all #2). A bag whose rows live on several ranks (row-wise
   split tables, multi-hot) arrives as several partial sums that the requester adds up.
2. `apply_gradients`: the gradient of each segment goes back to its owner (all-to-all #3); the owner
   sums per unique row and runs the fused sparse optimizer on its shard.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mpickpt import counter_rng
from mpickpt.model.optimizers import OptimizerConfig, make_sparse_optimizer
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.timing import PhaseTimer

IndexHook = Callable[[torch.Tensor], None]
INIT_CHUNK_ROWS = 1 << 18


@dataclass
class LookupContext:
    """What `apply_gradients` needs from the `lookup` of the same step."""

    seg_bag: torch.Tensor  # requester: bag (b * T + t) of each segment, in owner-major order
    send_segs: list[int]  # requester: segments sent to each owner
    recv_segs: list[int]  # owner: segments received from each requester
    rows: torch.Tensor  # owner: sorted unique local rows received this step
    inverse: torch.Tensor  # owner: index into `rows` of each received entry
    recv_seg: torch.Tensor  # owner: segment (index into received segments) of each entry
    shape: tuple[int, int]  # (B, T)


def init_rows(seed: int, gids: np.ndarray, table_sizes_of_rows: np.ndarray, dim: int) -> np.ndarray:
    """DLRM's initialisation, U(-1/sqrt(n_t), 1/sqrt(n_t)), as a pure function of (seed, global id).

    Local. Independent of the world size, so every sharding of the same model starts identical."""
    u = counter_rng.uniform(seed, gids[:, None], np.arange(dim)[None, :])
    bound = 1.0 / np.sqrt(table_sizes_of_rows.astype(np.float64))[:, None]
    return ((2.0 * u - 1.0) * bound).astype(np.float32)


def initial_rows_of(seed: int, plan: ShardPlan, gids: np.ndarray, dim: int) -> torch.Tensor:
    """DLRM's initial weights of the rows with global ids `gids` (`init_rows`, in chunks), on
    the CPU. Local."""
    tables, _ = plan.split_global(gids)
    sizes = np.asarray(plan.table_sizes, dtype=np.int64)[tables]
    out = torch.empty(len(gids), dim, dtype=torch.float32)
    for a in range(0, len(gids), INIT_CHUNK_ROWS):
        b = a + INIT_CHUNK_ROWS
        out[a:b] = torch.from_numpy(init_rows(seed, gids[a:b], sizes[a:b], dim))
    return out


class ShardedEmbeddingBags:
    """This rank's shards of all embedding tables plus their sparse optimizer state."""

    def __init__(self, topo, plan: ShardPlan, dim: int, optim: OptimizerConfig, seed: int,
                 timer: PhaseTimer | None = None, lost: bool = False):
        """`lost`: the shard is born lost (rows and optimizer state NaN, as `wipe_rows` leaves
        them), for a process that replaces a dead rank and recovers the shard anyway: computing
        its initial rows would be wasted (most of a replacement's start)."""
        if plan.world_size != topo.world_size:
            raise ValueError(f"shard plan is for {plan.world_size} ranks, job has {topo.world_size}")
        self.topo, self.plan, self.dim = topo, plan, dim
        self.device = topo.device
        self.timer = timer or PhaseTimer(enabled=False)
        self.local_gids = plan.rank_global_ids(topo.rank)
        self.seed = seed
        self.weight = self._init_weight(seed) if not lost else \
            torch.full((len(self.local_gids), dim), float("nan"), device=self.device)
        self.optimizer = make_sparse_optimizer(optim, len(self.local_gids), dim, self.device)
        if lost:
            self.wipe_range(0, len(self.local_gids))
        self.state_lock = threading.RLock()
        """Held while the rank's state changes (updates, folds, loads): a thread that must see
        one consistent state (the survivor dump) takes it and so waits out a change in
        progress. Never held across a collective."""
        self.index_hooks: list[IndexHook] = []
        self.count_hooks: list = []
        self.update_hooks: list = []
        self.gradient_hooks: list[Callable[[], None]] = []
        self.exchange_hooks: list = []
        self._offsets = torch.as_tensor(plan.table_offsets, device=self.device)

    def share_rows(self, shared) -> bool:
        """Move the rows and sparse optimizer state into `shared` memory in place
        (`parity.shared_rows.SharedRows`: the tensors stay the same objects), so that a parity
        rebuild on this host can map them. True where all of them moved. Local; call it before
        anything takes views of them."""
        return all([shared.adopt(t) for t in (self.weight, *self.optimizer.state.values())])

    def _init_weight(self, seed: int) -> torch.Tensor:
        return self.initial_rows(0, len(self.local_gids)).to(self.device)

    def initial_rows(self, start: int, stop: int) -> torch.Tensor:
        """The initial weights of local rows [start, stop) (a pure function of the seed and the
        global ids), on the CPU. Local."""
        return initial_rows_of(self.seed, self.plan, self.local_gids[start:stop], self.dim)

    def add_index_hook(self, hook: IndexHook) -> Callable[[], None]:
        """Call `hook(local_rows)` on the owner each step with the rows it received. Local.

        `local_rows` is a sorted int64 tensor of unique rows on the shard's device: exactly the
        rows this step's update will touch. Returns a function that removes the hook."""
        self.index_hooks.append(hook)
        return lambda: self.index_hooks.remove(hook)

    def add_count_hook(self, hook) -> Callable[[], None]:
        """Call `hook(local_rows, counts)` on the owner in every *training* lookup: the sorted
        unique rows the step updates and how many lookups each had. Local to register; returns a
        remover."""
        self.count_hooks.append(hook)
        return lambda: self.count_hooks.remove(hook)

    @torch.no_grad()
    def wipe_rows(self, ranks) -> None:
        """Emulated loss: if this rank is in `ranks`, its rows and optimizer state become NaN.
        Local."""
        if self.topo.rank in ranks:
            self.wipe_range(0, len(self.local_gids))

    @torch.no_grad()
    def wipe_range(self, start: int, stop: int) -> None:
        """Emulated loss of local rows [start, stop): rows and optimizer state become NaN.
        Local."""
        self.weight[start:stop] = float("nan")
        for t in self.optimizer.state.values():
            t[start:stop] = float("nan")

    def add_update_hook(self, hook) -> Callable[[], None]:
        """Bracket every sparse update: `hook.rows_known(rows)` in the training lookup, as soon as
        the rows the update will touch are known (optional method), `token =
        hook.before_update(rows)` before the optimizer changes `rows`, `hook.after_update(rows,
        token)` after, and `hook.step_done()` from `finish_step` at the end of the training step.
        Local to register; the calls run on every rank in every step and may be collective.
        Returns a remover."""
        self.update_hooks.append(hook)
        return lambda: self.update_hooks.remove(hook)

    def add_exchange_hook(self, hook) -> Callable[[], None]:
        """Carry a hook's small messages in every lookup's first exchange (the entry counts):
        `hook.outgoing()` runs on every rank before it and returns None (on every rank alike) or
        one list of ints per destination rank, of one length on every rank; then
        `hook.incoming(fields)` gets the list each source sent this rank, before the index
        hooks. A hook with a message for every lookup spares it an exchange of its own. Local to
        register; returns a remover."""
        self.exchange_hooks.append(hook)
        return lambda: self.exchange_hooks.remove(hook)

    gradient_hooks_gate_updates = True
    """The gradients' all-to-all follows the gradient hooks on every rank, and rows change
    only after it (`mpickpt.model.contract`). gloo's all-to-all waits for every peer, also one
    that sends this rank nothing; parity relies on the gate over gloo only."""

    def add_gradient_hook(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call `hook()` on every rank in each training step after its lookup and dense
        backward, right before the pooled gradients leave for their owners: no row of this step
        has changed anywhere yet, and no owner changes one before this rank's gradients reach
        it (a rebuild joins its sweep here). Local unless the hook is collective. Returns a
        function that removes the hook."""
        self.gradient_hooks.append(hook)
        return lambda: self.gradient_hooks.remove(hook)

    def lookup(self, sparse: torch.Tensor, update: bool = False) -> tuple[torch.Tensor, LookupContext]:
        """Pooled (sum) embeddings (B, T, dim) of this rank's batch. Collective over `topo.pg`
        (and over the update hooks' groups when `update`).

        `update`: `apply_gradients` with this lookup's context follows in the same step, so the
        update hooks hear the rows it will touch now (`rows_known`)."""
        B, T, L = sparse.shape
        with self.timer.phase("route"):
            gid = (sparse.to(self.device) + self._offsets[:T].view(1, T, 1)).reshape(-1)
            bag = torch.arange(B * T, device=self.device).repeat_interleave(L)
            owner, lrow = self.plan.owner_of(gid)
            route = _segments(owner, bag, lrow, self.topo.world_size, B * T)
        with self.timer.phase("alltoall"):
            recv_counts = self._exchange_counts(route.counts, self._outgoing())
            recv_entries, recv_segs = recv_counts[0::2], recv_counts[1::2]
            packed = self._alltoall(route.packed, route.send_entries, recv_entries, 2)
        recv_rows, recv_seg = _owner_segments(packed, recv_entries, recv_segs, self.device)
        with self.timer.phase("optimizer"):  # the unique rows serve the hooks and the update
            rows, inverse = torch.unique(recv_rows, return_inverse=True)
        for hook in self.index_hooks:
            hook(rows)
        if update and self.count_hooks:
            counts = torch.bincount(inverse, minlength=len(rows))
            for hook in self.count_hooks:
                hook(rows, counts)
        with self.timer.phase("update_hooks"):
            for hook in self.update_hooks if update else ():
                if hasattr(hook, "rows_known"):
                    hook.rows_known(rows)
        with self.timer.phase("lookup"):
            pooled = F.embedding_bag(recv_rows, self.weight, _bag_offsets(recv_seg), mode="sum")
        with self.timer.phase("alltoall"):
            back = self._alltoall(pooled, recv_segs, route.send_segs)
        with self.timer.phase("lookup"):
            out = torch.zeros(B * T, self.dim, device=self.device).index_add_(0, route.seg_bag, back)
        ctx = LookupContext(route.seg_bag, route.send_segs, recv_segs, rows, inverse, recv_seg,
                            (B, T))
        return out.view(B, T, self.dim), ctx

    def apply_gradients(self, grad: torch.Tensor, ctx: LookupContext) -> None:
        """Send pooled gradients to the owners and update their rows. Collective over `topo.pg`."""
        B, T = ctx.shape
        with self.timer.phase("update_hooks"):
            for hook in self.gradient_hooks:
                hook()
        with self.timer.phase("alltoall"):
            seg_grad = grad.reshape(B * T, self.dim)[ctx.seg_bag]
            owner_grad = self._alltoall(seg_grad.contiguous(), ctx.send_segs, ctx.recv_segs)
        with self.timer.phase("optimizer"):
            row_grad = torch.zeros(len(ctx.rows), self.dim, device=self.device)
            row_grad.index_add_(0, ctx.inverse, owner_grad[ctx.recv_seg])
        with self.timer.phase("update_hooks"):
            tokens = [h.before_update(ctx.rows) for h in self.update_hooks]
        with self.timer.phase("optimizer"):
            with self.state_lock:
                self.optimizer.step(self.weight, ctx.rows, row_grad)
        with self.timer.phase("update_hooks"):
            for hook, token in zip(self.update_hooks, tokens):
                hook.after_update(ctx.rows, token)

    def finish_step(self) -> None:
        """End of a training step: update hooks complete their work (parity upkeep folds the
        deltas it exchanged beside the dense allreduce). Collective if a hook is."""
        with self.timer.phase("update_hooks"):
            for hook in self.update_hooks:
                hook.step_done()

    def _outgoing(self) -> list[tuple[object, list[list[int]]]]:
        """(hook, its list per destination) of the exchange hooks with a message. Local unless
        a hook's `outgoing` is collective."""
        out = [(hook, hook.outgoing()) for hook in self.exchange_hooks]
        return [(hook, fields) for hook, fields in out if fields is not None]

    def _exchange_counts(self, counts: torch.Tensor, carried=()) -> list[int]:
        """The (entries, segments) pairs, interleaved by rank, that every rank sends this one;
        the `carried` hooks' fields travel after each pair, and each hook hears its own
        (`add_exchange_hook`). Collective over `topo.pg`."""
        world = self.topo.world_size
        send = counts.view(world, 2)
        if carried:
            fields = torch.tensor([sum((f[d] for _, f in carried), []) for d in range(world)],
                                  dtype=counts.dtype, device=counts.device).view(world, -1)
            send = torch.cat([send, fields], dim=1)
        send = send.contiguous().view(-1)
        out = torch.empty_like(send)
        self.topo.wait(dist.all_to_all_single(out, send, group=self.topo.pg, async_op=True))
        got = out.view(world, -1).tolist()
        at = 2
        for hook, f in carried:
            width = len(f[0])
            hook.incoming([row[at:at + width] for row in got])
            at += width
        return [n for row in got for n in row[:2]]

    def _alltoall(self, send: torch.Tensor, send_splits, recv_splits, width: int = 1):
        """Variable-size all-to-all along dim 0; `width` elements per entry for flat tensors."""
        shape = (sum(recv_splits) * width,) if send.dim() == 1 else (sum(recv_splits), *send.shape[1:])
        out = torch.empty(shape, dtype=send.dtype, device=self.device)
        self.topo.wait(dist.all_to_all_single(out, send, [n * width for n in recv_splits],
                                              [n * width for n in send_splits],
                                              group=self.topo.pg, async_op=True))
        return out


@dataclass
class _Route:
    packed: torch.Tensor  # (local row, segment within owner) pairs, owner-major, flattened
    counts: torch.Tensor  # (entries, segments) per owner, interleaved, int64 (2 * world,)
    send_entries: list[int]
    send_segs: list[int]
    seg_bag: torch.Tensor


def _segments(owner, bag, lrow, world: int, num_bags: int) -> _Route:
    """Group entries by (owner, bag): one segment per bag part that an owner pools. Local."""
    key = owner * num_bags + bag
    order = torch.argsort(key, stable=True)
    key, lrow, owner = key[order], lrow[order], owner[order]
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    seg = torch.cumsum(first, 0) - 1
    seg_key = key[first]
    n_entries = torch.bincount(owner, minlength=world)
    n_segs = torch.bincount(seg_key // num_bags, minlength=world)
    seg_base = torch.cumsum(n_segs, 0) - n_segs
    packed = torch.stack([lrow, seg - seg_base[owner]], dim=1).reshape(-1)
    counts = torch.stack([n_entries, n_segs], dim=1).reshape(-1)
    return _Route(packed, counts, n_entries.tolist(), n_segs.tolist(), seg_key % num_bags)


def _owner_segments(packed, recv_entries, recv_segs, device):
    """Owner side: local rows and owner-wide segment ids of the received entries. Local."""
    pairs = packed.view(-1, 2)
    world = len(recv_entries)
    source = torch.repeat_interleave(torch.arange(world, device=device),
                                     torch.tensor(recv_entries, device=device))
    segs = torch.tensor(recv_segs, device=device)
    base = torch.cumsum(segs, 0) - segs
    return pairs[:, 0].contiguous(), pairs[:, 1] + base[source]


def _bag_offsets(seg: torch.Tensor) -> torch.Tensor:
    """`embedding_bag` offsets for entries whose segment ids are sorted and gap-free. Local."""
    if seg.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=seg.device)
    starts = torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1
    return torch.cat([torch.zeros(1, dtype=torch.long, device=seg.device), starts])
