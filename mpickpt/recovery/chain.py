"""Recovery: the configured policies, tried in order; the first that covers a loss recovers it."""
from __future__ import annotations

from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome, Unrecoverable


class Recovery:
    """The trainer's one entry point for lost ranks. `recover` is collective."""

    def __init__(self, policies, say):
        self.policies, self.say = list(policies), say
        self.rows_replaced: list = []
        """Callables run (collectively) after a recovery replaced rows with older values, e.g.
        parity re-encoding what it protects."""
        self.history: list[Outcome] = []

    def recover(self, loss: Loss) -> Outcome:
        """Recover `loss` with the first policy that covers it; Unrecoverable names why none
        does. Collective (every rank sees the same loss and takes the same decision)."""
        reasons = []
        for policy in self.policies:
            why = policy.why_not(loss)
            if why is not None:
                reasons.append(why)
                continue
            if reasons:
                self.say(f"{loss}: {'; '.join(reasons)}; {policy.action}")
            elif not policy.announces:
                self.say(f"{loss}; {policy.action}")
            outcome = policy.recover(loss)
            if outcome.rolled_back:
                for hook in self.rows_replaced:
                    hook()
            self.history.append(outcome)
            return outcome
        raise Unrecoverable(f"{loss}: {', and '.join(reasons)}")
