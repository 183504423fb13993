"""CheckpointSchedule: the steps at which checkpoints are due.

Every `interval` steps; a fixed interval keeps checkpoints on its multiples, also after a restore.
The interval can be re-planned at a checkpoint (Young's interval from the measured save cost, or
CPR's interval from a target PLS: `mpickpt.recovery.planner`); the next checkpoint is then due one
new interval after that one. The reader is allowed exactly up to the next due step (gap control),
so re-planning happens before the reader's allowance is renewed. Local.
"""
from __future__ import annotations


class CheckpointSchedule:
    """The next due step and the interval in force. Local."""

    def __init__(self, interval: int, start: int = 0):
        self.interval = max(1, int(interval))
        self.restart(start)

    def restart(self, step: int) -> None:
        """Training continues after `step` (a start or a restore): the next multiple is due."""
        self.next = (step // self.interval + 1) * self.interval

    def due(self, step: int) -> bool:
        return step == self.next

    def passed(self, step: int) -> None:
        """The checkpoint due at `step` was taken (or skipped): the next is one interval on."""
        self.next = step + self.interval

    def replan(self, interval: float, step: int) -> bool:
        """At the checkpoint just taken at `step`, switch to `interval` steps (rounded, >= 1);
        True when it changed. Local."""
        new = max(1, int(round(interval)))
        changed, self.interval = new != self.interval, new
        self.next = step + new
        return changed

    def allowance(self, step: int, total: int) -> int:
        """Batches the reader may deliver after `step`: up to the next checkpoint or the end."""
        return max(0, min(self.next, total) - step)
