"""The recovery interface: a `Loss` (which ranks lost their embedding shards, after which step), the
`RecoveryPolicy` that handles one, and the `Outcome` the trainer applies.

A policy decides locally whether it can handle a loss (`why_not`, pure, the same answer on every
rank) and recovers collectively (`recover`). What a rank keeps going through a recovery depends on
the policy: a parity rebuild keeps everything and decodes the lost rows while training goes on; a
full rollback sends every rank, the dense part and the reader back to a checkpoint; a partial
recovery reloads only the lost ranks' rows while the rest keep training.
"""
from __future__ import annotations

from dataclasses import dataclass

from mpickpt.faults.loss import Loss
from mpickpt.model.contract import FROM_START, missing_for


class Unrecoverable(RuntimeError):
    """Lost shards that no configured policy can bring back."""


def cannot_start_over(model, loss) -> None:
    """Raise Unrecoverable if `model` cannot give back its initial rows (nothing committed
    yet, so the loss must start over from them). Local."""
    missing = missing_for(model, FROM_START)
    if missing:
        raise Unrecoverable(f"{loss}, no checkpoint is committed yet, and "
                            f"{type(model).__name__} cannot start over from its initial state "
                            f"(it lacks {', '.join(missing)})")


@dataclass(frozen=True)
class Outcome:
    """What a recovery did, for the trainer to apply."""

    policy: str
    step: int
    """The step training continues after."""
    reader_state: dict | None = None
    """Restart the reader at this position (None: the reader keeps going)."""
    rolled_back: frozenset[int] = frozenset()
    """Ranks whose rows were replaced by older values (a checkpoint's)."""


class RecoveryPolicy:
    """One way to recover a `Loss`. Subclasses override both methods."""

    name = ""
    action = ""
    """What recovering means, for the log ('falling back to the latest checkpoint')."""
    announces = False
    """`recover` logs the loss itself (the chain then says nothing unless it fell back)."""

    def why_not(self, loss: Loss) -> str | None:
        """Why this policy cannot recover `loss`, or None if it can. Local and pure."""
        raise NotImplementedError

    def recover(self, loss: Loss) -> Outcome:
        """Recover `loss`. Collective; raises Unrecoverable when it turns out it cannot."""
        raise NotImplementedError
