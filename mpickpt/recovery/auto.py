"""`--recovery auto` past parity: partial or full recovery, as CPR's benefit check last decided
from the job's measured costs (`recovery.planner`)."""
from __future__ import annotations

from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome, RecoveryPolicy


class AutoRecovery(RecoveryPolicy):
    """Delegates each loss to partial or full recovery."""

    name = "auto"
    action = "CPR's benefit check decides"

    def __init__(self, planner, partial, full, say):
        self.planner, self.partial, self.full, self.say = planner, partial, full, say

    def why_not(self, loss: Loss) -> str | None:
        return self.partial.why_not(loss)

    def recover(self, loss: Loss) -> Outcome:
        mode = self.planner.mode_for_loss()
        d = self.planner.decision
        why = d.inputs() if d is not None else \
            "nothing measured yet, and nothing to roll back to but the initial model"
        self.say(f"recovery auto: {mode} recovery for this loss ({why})")
        return (self.partial if mode == "partial" else self.full).recover(loss)
