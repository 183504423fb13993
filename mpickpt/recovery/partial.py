"""Partial recovery (CPR, SCAR §4.1): only the lost shards go back to their last save.

The lost rows and their sparse optimizer state are reloaded from the newest committed checkpoint of
any kind (full, incremental, quantized, prioritized: only the ranks that lost rows read, and only
those rows); every other rank keeps its current rows, the dense part keeps its parameters, and the
reader goes on without replaying a sample. With nothing committed yet the lost rows restart from
the initial model (a pure function of the seed and the global ids), their save at step 0. The
samples trained since the lost shards' last save are counted in the job's PLS (`recovery.pls`,
CPR eq. 3; for prioritized saves the last save is the newest, partial one, as in CPR).
"""
from __future__ import annotations

from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome, RecoveryPolicy, cannot_start_over


class PartialRecovery(RecoveryPolicy):
    """Covers any loss, given a checkpoint directory."""

    name = "partial"
    action = "reloading only the lost shards from the latest checkpoint (partial recovery)"

    def __init__(self, ckpt, restorer, model, pls, global_batch: int, say):
        self.ckpt, self.restorer, self.model = ckpt, restorer, model
        self.pls, self.global_batch, self.say = pls, global_batch, say

    def why_not(self, loss: Loss) -> str | None:
        if self.ckpt is None:
            return "partial recovery needs a checkpoint directory (--ckpt-dir)"
        return None

    def recover(self, loss: Loss) -> Outcome:
        self.ckpt.quiesce()  # the checkpoint in flight is the newest once committed
        restored = self.restorer.restore_rows(loss.shards)
        total = sum(self.model.plan.local_rows(r) for r in range(self.model.plan.world_size))
        if restored is None:
            cannot_start_over(self.model, loss)
            self._initial_rows(loss)
            saved, source = 0, "the initial model (nothing committed yet)"
        else:
            self.ckpt.partially_restored(restored)
            saved, source = restored.step, f"checkpoint step {restored.step}" + _ages(restored)
        gained = self.pls.partial_recovery(
            loss.after_step, self.global_batch, [(s.rows / total, saved) for s in loss.shards])
        seconds = self.restorer.seconds[-1] if restored is not None else 0.0
        self.say(f"partial recovery: {loss.share(total):.1%} of the embedding rows reloaded from "
                 f"{source} in {seconds:.2f} s; the rest of the model and the reader went on. "
                 f"PLS +{gained:.5f} = {self.pls.value:.5f}")
        return Outcome(self.name, loss.after_step, None, loss.ranks)

    def _initial_rows(self, loss: Loss) -> None:
        """Nothing committed yet: the lost rows start over from the initial model. Local."""
        for shard in loss.of_rank(self.model.topo.rank):
            self.model.load_row_range(self.model.initial_row_range(shard.start, shard.stop),
                                      shard.start, shard.stop)


def _ages(restored) -> str:
    """For a prioritized checkpoint: how old the reloaded values are (rows skipped by the
    prioritized saves keep the value of the save that last wrote them)."""
    written = restored.written
    if not written or set(written) == {restored.step}:
        return ""
    steps = sorted(written)
    fresh = written.get(restored.step, 0) / sum(written.values())
    return f" (values from steps {steps[0]}..{steps[-1]}, {fresh:.0%} from step {restored.step})"
