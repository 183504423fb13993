"""Full recovery: every rank, the dense part and the reader go back to the newest committed
checkpoint (the checkpoint in flight is let finish first), and training replays from there. With
nothing committed yet, training starts over from the initial model (a pure function of the seed)
and the first sample. The PLS goes back with them (`recovery.pls`): the rollback replays every sample
since the checkpoint, the partial recoveries after it included."""
from __future__ import annotations

from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome, RecoveryPolicy, Unrecoverable, cannot_start_over


class FullRollback(RecoveryPolicy):
    """Covers any loss, given a checkpoint directory."""

    name = "full"
    action = "falling back to the latest checkpoint"

    def __init__(self, ckpt, restorer, world_size: int, model=None, start_state: dict | None = None,
                 pls=None):
        """`pls`: the job's PLSAccount, returned to the restored checkpoint's value (None: the
        job keeps no PLS)."""
        self.ckpt, self.restorer, self.world_size = ckpt, restorer, world_size
        self.model, self.start_state, self.pls = model, start_state, pls

    def why_not(self, loss: Loss) -> str | None:
        if self.ckpt is None:
            return "there is no checkpoint to fall back to (--ckpt-dir)"
        return None

    def recover(self, loss: Loss) -> Outcome:
        self.ckpt.quiesce()
        restored = self.restorer.restore(latest=True)
        everyone = frozenset(range(self.world_size))
        if restored is None:
            if self.model is None or self.start_state is None:
                raise Unrecoverable(f"{loss}, and no checkpoint is committed yet")
            cannot_start_over(self.model, loss)
            self.model.reset_to_initial()
            self.ckpt.incremental.reset()
            self.ckpt.schedule.restart(0)
            self.restorer.say("nothing committed yet: training starts over from the initial "
                              "model")
            self._pls_back(0, None)
            return Outcome(self.name, 0, self.start_state, everyone)
        self.ckpt.restored(restored)
        manifest = restored.manifest
        self._pls_back(restored.step, manifest.stats.get("pls") if manifest is not None else None)
        return Outcome(self.name, restored.step, restored.reader_state, everyone)

    def _pls_back(self, step: int, stats: dict | None) -> None:
        """The PLS of the checkpoint rolled back to (of the start: 0), logged when it moved.
        Local."""
        if self.pls is None:
            return
        change = self.pls.rolled_back(step, stats)
        if change:
            self.restorer.say(f"full rollback to step {step}: PLS {change:+.5f} = "
                              f"{self.pls.value:.5f} after {self.pls.recoveries} partial "
                              f"recoveries (the samples since are replayed)")
