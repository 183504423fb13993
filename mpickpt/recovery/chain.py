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

    def why_not(self, loss: Loss) -> str | None:
        """None where a policy covers `loss`, else why none does (what `recover` would raise).
        Local."""
        policy, reasons = self._first(loss)
        return None if policy is not None else _none_covers(loss, reasons)

    def _first(self, loss: Loss) -> tuple:
        """(the first policy that covers `loss` or None, why each one before it does not)."""
        reasons = []
        for policy in self.policies:
            why = policy.why_not(loss)
            if why is None:
                return policy, reasons
            reasons.append(why)
        return None, reasons

    def recover(self, loss: Loss) -> Outcome:
        """Recover `loss` with the first policy that covers it; Unrecoverable names why none
        does. Collective (every rank sees the same loss and takes the same decision)."""
        policy, reasons = self._first(loss)
        if policy is not None:
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
        raise Unrecoverable(_none_covers(loss, reasons))


def _none_covers(loss: Loss, reasons: list[str]) -> str:
    """Why no policy covers `loss`: each policy's reason. Local."""
    return f"{loss}: {', and '.join(reasons)}"
