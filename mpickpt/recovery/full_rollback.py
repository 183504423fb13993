"""Full recovery: every rank, the dense part and the reader go back to the newest committed
checkpoint (the checkpoint in flight is let finish first), and training replays from there."""
from __future__ import annotations

from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome, RecoveryPolicy, Unrecoverable


class FullRollback(RecoveryPolicy):
    """Covers any loss, given a checkpoint directory."""

    name = "full"
    action = "falling back to the latest checkpoint"

    def __init__(self, ckpt, restorer, world_size: int):
        self.ckpt, self.restorer, self.world_size = ckpt, restorer, world_size

    def why_not(self, loss: Loss) -> str | None:
        if self.ckpt is None:
            return "there is no checkpoint to fall back to (--ckpt-dir)"
        return None

    def recover(self, loss: Loss) -> Outcome:
        self.ckpt.quiesce()
        restored = self.restorer.restore(latest=True)
        if restored is None:
            raise Unrecoverable(f"{loss}, and no checkpoint is committed yet")
        self.ckpt.restored(restored)
        return Outcome(self.name, restored.step, restored.reader_state,
                       frozenset(range(self.world_size)))
