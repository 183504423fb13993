"""Recovery from in-memory parity (ECRM): the lost ranks' rows and optimizer state are decoded from
their groups' survivors while training continues; nothing rolls back."""
from __future__ import annotations

from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome, RecoveryPolicy


class ParityRebuild(RecoveryPolicy):
    """Covers a loss of at most r ranks per parity group, outside a running rebuild."""

    name = "parity"
    action = "rebuilding them from parity while training continues"
    announces = True

    def __init__(self, guard):
        self.guard = guard

    def why_not(self, loss: Loss) -> str | None:
        return self.guard.uncovered(loss.ranks)

    def recover(self, loss: Loss) -> Outcome:
        self.guard.start_rebuild(loss.ranks, loss.after_step)
        return Outcome(self.name, loss.after_step)
