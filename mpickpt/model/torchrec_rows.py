"""FusedRows: this rank's rows of a TorchRec DMP as mpickpt's `embeddings` (see
`mpickpt.model.contract`): live [rows, dim] views of one fused table-batched module's weights and
optimizer states, and the row hooks mpickpt's trackers, parity and step undo attach to.

FBGEMM fuses the optimizer into the backward pass, so there is no point between gradient and
update. The rows an update touches are exactly the ids the lookup sees: a forward pre-hook on the
sharded collection's lookup reads them from the KeyedJaggedTensor after the input distribution
(table-wise ids are table rows, row-wise ids are already shard-local) and maps each feature's
ids to local rows of the fused buffer. During a training step (`TorchRecModel.train_step`
opens it) that hook calls the index and count hooks and the update hooks' `rows_known` and
`before_update` (the rows' old values: nothing else changes them before the backward);
the gradient reaching the lookup's output (back from the ranks that pooled it, right before the
fused backward updates this rank's rows) calls the gradient hooks; `after_backward` then calls
`after_update`, and `finish_step` `step_done`. Lookups outside a training step (predictions) call
no hook.
Local unless a hook is collective.
"""
from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch


OPTIMIZERS = {"EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad", "EXACT_ADAGRAD": "adagrad",
              "EXACT_SGD": "sgd"}
"""fbgemm's EmbOptimType names -> mpickpt's optimizer kinds, for the fused optimizers read."""


class TorchRecContractError(ValueError):
    """A DMP model whose sharded modules this adapter cannot map."""


class FusedRows:
    """This rank's rows of one fused table-batched module: live views, global ids, lock, hooks."""

    def __init__(self, topo, lookup, fused, table_index: dict[str, int]):
        emb = fused.emb_module
        tables = fused.config.embedding_tables
        if not hasattr(emb, "optimizer") or not hasattr(emb, "split_optimizer_states"):
            raise TorchRecContractError(
                f"tables {[t.name for t in tables]} use {type(fused).__name__} ("
                f"{type(emb).__name__}); mpickpt maps fused kernels (compute_kernel='fused', "
                f"the optimizer in the backward)")
        kind = getattr(emb.optimizer, "name", str(emb.optimizer))
        if kind not in OPTIMIZERS:
            raise TorchRecContractError(
                f"fused optimizer {kind} of tables {[t.name for t in tables]}: mpickpt reads "
                f"{', '.join(OPTIMIZERS)} (Adam's step counter is in no state dict)")
        dims = {t.local_cols for t in tables}
        if len(dims) != 1:
            raise TorchRecContractError(f"tables {[t.name for t in tables]} have dims {dims}: "
                                        f"one fused module must hold one dim")
        self.topo, self.dim = topo, dims.pop()
        self.device = topo.device
        self.state_lock = threading.RLock()
        self.tables = [(table_index[t.name], int(t.local_metadata.shard_offsets[0]),
                        int(t.local_rows)) for t in tables]
        self.feature_base = _feature_bases(tables)
        self.weight = stitch(emb.split_embedding_weights(), "weights")
        states = emb.split_optimizer_states() if kind != "EXACT_SGD" else []
        per_state = list(zip(*states)) if states else []
        self.optimizer = SimpleNamespace(
            config=SimpleNamespace(kind=OPTIMIZERS[kind]),
            state={f"momentum{i + 1}": stitch(list(parts), f"optimizer state {i}")
                   for i, parts in enumerate(per_state)})
        self.local_gids = np.empty(0, dtype=np.int64)  # set once the plan is known
        self.index_hooks: list = []
        self.count_hooks: list = []
        self.update_hooks: list = []
        self.gradient_hooks: list[Callable[[], None]] = []
        self._training = False
        self._pending: tuple | None = None
        """(rows, update-hook tokens) of the training lookup whose backward has not run."""
        self._trainer_thread: int | None = None
        self._update_locked = False
        lookup.register_forward_pre_hook(self._on_lookup)
        lookup.register_forward_hook(self._guard_update)

    # ---- hooks (the contract's IndexHooks, CountHooks, UpdateHooks) ----------------------------
    def add_index_hook(self, fn: Callable[[torch.Tensor], None]) -> Callable[[], None]:
        """`fn(rows)` with the sorted unique local rows of each training lookup. Local; returns
        a remover."""
        self.index_hooks.append(fn)
        return lambda: self.index_hooks.remove(fn)

    def add_count_hook(self, fn) -> Callable[[], None]:
        """`fn(rows, counts)`: the rows and how often each was looked up. Local; a remover."""
        self.count_hooks.append(fn)
        return lambda: self.count_hooks.remove(fn)

    def add_update_hook(self, hook) -> Callable[[], None]:
        """Bracket the fused update (see the module doc). Local to register; a remover."""
        self.update_hooks.append(hook)
        return lambda: self.update_hooks.remove(hook)

    def add_gradient_hook(self, hook: Callable[[], None]) -> Callable[[], None]:
        """Call `hook()` on every rank in each training step when the gradient reaches this
        rank's lookup output, before the fused backward updates its rows and before the update
        lock is taken: no rank changes a row of the step before its own hooks have run (a
        rebuild joins its sweep here). Runs on the thread that runs the backward. Local unless
        the hook is collective. Returns a remover."""
        self.gradient_hooks.append(hook)
        return lambda: self.gradient_hooks.remove(hook)

    def rows_of(self, kjt) -> tuple[torch.Tensor, torch.Tensor]:
        """(sorted unique local rows, index into them of each id) of a lookup's ids. Local."""
        keys = kjt.keys()
        missing = [k for k in keys if k not in self.feature_base]
        if missing:
            raise TorchRecContractError(f"the lookup sees features {missing} of no table "
                                        f"this rank holds")
        values = kjt.values()  # on the lookup's device (the GPU there): no copy to the host
        base = torch.tensor([self.feature_base[k] for k in keys], dtype=torch.int64,
                            device=values.device)
        per_key = torch.tensor(kjt.length_per_key(), dtype=torch.int64, device=values.device)
        local = values.to(torch.int64) + torch.repeat_interleave(base, per_key)
        rows, inverse = torch.unique(local, return_inverse=True)
        return rows.to(self.weight.device), inverse.to(self.weight.device)

    def _on_lookup(self, module, inputs) -> None:
        """The lookup's forward pre-hook: a training lookup's rows go to the hooks."""
        if not self._training:
            return
        rows, inverse = self.rows_of(inputs[0])
        for fn in self.index_hooks:
            fn(rows)
        if self.count_hooks:
            counts = torch.bincount(inverse, minlength=len(rows))
            for fn in self.count_hooks:
                fn(rows, counts)
        for hook in self.update_hooks:
            if hasattr(hook, "rows_known"):
                hook.rows_known(rows)
        self._pending = (rows, [h.before_update(rows) for h in self.update_hooks])

    def _guard_update(self, module, inputs, output) -> None:
        """The lookup's forward hook: in a training step, the gradient reaching the lookup's
        output (right before the fused backward updates the rows) takes `state_lock`, and
        `training(False)` gives it back, so a survivor dump never sees a half-applied update;
        the gradient hooks run first, outside the lock (they may be collective, and a dump
        must not wait on a collective a dead peer never joins). On CUDA the backward may run
        in autograd's device thread, which cannot take a lock the training thread gives
        back: there the update is not guarded (the step undo still restores the rows' old
        values).
        """
        if self._training and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._enter_update)

    def _enter_update(self, grad):
        for hook in self.gradient_hooks:
            hook()
        if threading.get_ident() == self._trainer_thread and not self._update_locked:
            self.state_lock.acquire()
            self._update_locked = True
        return None

    def training(self, on: bool) -> None:
        """Open (`on`) or close a training step on the calling thread: its lookup calls the
        hooks; closing gives back the update lock. Local."""
        self._training = on
        if on:
            self._pending, self._trainer_thread = None, threading.get_ident()
        elif self._update_locked:
            self._update_locked = False
            self.state_lock.release()

    def after_backward(self) -> None:
        """The fused update ran (the backward returned): `after_update` for each hook."""
        pending, self._pending = self._pending, None
        if pending is not None:
            rows, tokens = pending
            for hook, token in zip(self.update_hooks, tokens):
                hook.after_update(rows, token)

    def finish_step(self) -> None:
        """End of the training step: `step_done` for each update hook (may be collective)."""
        for hook in self.update_hooks:
            hook.step_done()

    # ---- lost rows ------------------------------------------------------------------
    @torch.no_grad()
    def wipe_rows(self, ranks) -> None:
        """Emulated loss: this rank's rows and optimizer state become NaN if it is in `ranks`."""
        if self.topo.rank in ranks:
            self.wipe_range(0, len(self.local_gids))

    @torch.no_grad()
    def wipe_range(self, start: int, stop: int) -> None:
        """Emulated loss of local rows [start, stop): rows and optimizer state become NaN."""
        with self.state_lock:
            self.weight[start:stop] = float("nan")
            for t in self.optimizer.state.values():
                t[start:stop] = float("nan")


def _feature_bases(tables) -> dict[str, int]:
    """Feature name -> the local row where its table's rows start in the fused buffer."""
    bases, at = {}, 0
    for t in tables:
        for name in t.feature_names:
            bases[name] = at
        at += int(t.local_rows)
    return bases


def stitch(parts: list[torch.Tensor], what: str) -> torch.Tensor:
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
