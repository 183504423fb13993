"""StepUndo: what the last steps changed on this rank, so that it can go back to a step boundary.

A peer can die in the middle of a step, after this rank applied part of it: the sparse update runs
before the dense allreduce, the dense update after it, the parity fold at the end. Each step's
record holds what its parts overwrote: the rows it updated (their words before the update: weights
and optimizer state), the dense parameters and optimizer state before the dense update, the parity
fold it applied (a fold undoes itself), and the reader position before the step. Two records are
kept: the step in progress and the last completed one. A survivor undoes the step a death
interrupted to reach its last completed step; at the relaunch, a survivor that completed one step
more than another undoes that one too, so every survivor resumes from the same step. Local.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mpickpt.model.contract import STEP_UNDO, require
from mpickpt.parity.row_words import RowWords


@dataclass
class StepRecord:
    """What one step (`step`, the step it leads to) overwrote, part by part."""

    step: int
    reader_before: dict
    rows: torch.Tensor | None = None
    old_words: torch.Tensor | None = None
    sparse_applied: bool = False
    dense_before: dict | None = None
    dense_applied: bool = False
    fold: tuple | None = None
    extra: dict = field(default_factory=dict)


class StepUndo:
    """The undo records of one rank's model (and parity store). Construction is local; it hooks
    itself into the embeddings' updates and the model's dense update."""

    def __init__(self, model, parity_store=None):
        require(model, STEP_UNDO)
        self.model, self.parity = model, parity_store
        self.words = RowWords(model.embeddings)
        self.current: StepRecord | None = None
        self.last: StepRecord | None = None
        model.embeddings.add_update_hook(self)
        model.before_dense_update.append(self._dense_before)

    # ---- the trainer's calls ---------------------------------------------------------------
    def begin(self, step: int, reader_before: dict) -> None:
        """Step `step` starts; the reader is at `reader_before`. Local."""
        self.current = StepRecord(step, reader_before)

    def complete(self) -> None:
        """The step in progress finished on this rank: it becomes the last completed one."""
        if self.current is not None and self.parity is not None:
            self.current.fold = self.parity.last_fold
            self.parity.last_fold = None
        self.last, self.current = self.current, None

    def undo_current(self) -> None:
        """Take back whatever the interrupted step applied, its dense gradients included: the
        step is done again, and its backward would add to what the interrupted one left in
        `.grad` (found as a wrong digest when a death landed between a step's backward and its
        dense update: every rank's dense part then took a doubled gradient). Local."""
        self.model.dense_optimizer.zero_grad(set_to_none=True)
        if self.current is not None:
            if self.parity is not None:
                self.parity.abandon()
                self.parity.last_fold = None  # a fold of the interrupted step never happened
            self._undo(self.current)
            self.current = None

    def undo_last(self) -> dict:
        """Go back one more step (other survivors did not complete it); returns the reader
        position before it. Local."""
        record, self.last = self.last, None
        self._undo(record)
        return record.reader_before

    # ---- update hook (sparse update) ----------------------------------------------------------
    def before_update(self, rows: torch.Tensor):
        if self.current is not None:  # restoring the old words is right whether or not the
            old = self.words.gather(rows)  # update then ran, so the record is armed at once
            self.current.rows, self.current.old_words = rows.clone(), old
            self.current.sparse_applied = True

    def after_update(self, rows: torch.Tensor, token) -> None:
        pass

    def step_done(self) -> None:
        pass

    # ---- dense update ----------------------------------------------------------------------------
    def _dense_before(self) -> None:
        if self.current is not None:
            self.current.dense_before = {k: v.clone()
                                         for k, v in self.model.dense_state().items()}
            self.current.dense_applied = True

    @torch.no_grad()
    def _undo(self, r: StepRecord) -> None:
        if r.sparse_applied and r.rows is not None and len(r.rows):
            self.words.scatter(r.rows, r.old_words)
        if r.dense_applied and r.dense_before is not None:
            self.model.load_dense_state(r.dense_before)
        if r.fold is not None and self.parity is not None:
            self.parity.unfold(r.fold)
