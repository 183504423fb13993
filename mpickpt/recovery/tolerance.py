"""FaultTolerance: one trainer's failures and their recovery, wired from its configuration.

It holds the step clock, the running PLS, the interval planner, the recovery chain of `--recovery`,
and the sources of losses (an `--inject-failure`, the `--failure-model` emulator). The trainer asks
it after every step whether shards were lost (`loss_after`), lets it recover them (`recover`), and
feeds it step times. Construction is local; `recover` and the planner's `after_save` are
collective.
"""
from __future__ import annotations

from mpickpt.model.contract import EMULATED_FAILURES, require
from mpickpt.durations import Duration, StepClock
from mpickpt.faults.emulator import FailureEmulator
from mpickpt.faults.loss import Loss
from mpickpt.recovery.base import Outcome
from mpickpt.recovery.build import build_recovery
from mpickpt.recovery.planner import RecoveryPlanner
from mpickpt.recovery.pls import PLSAccount


class FaultTolerance:
    """Losses, recovery, PLS and interval planning of one rank."""

    def __init__(self, config, topo, model, ckpt, restorer, parity, say, step: int = 0,
                 pls: dict | None = None, start_state: dict | None = None):
        """`step`: where training resumes; `pls`: the PLS it carried (a manifest's or a survivor
        dump's stats); `start_state`: the reader position of the first sample (where a rollback
        with nothing committed starts over)."""
        self.config, self.topo, self.model, self.parity, self.say = config, topo, model, parity, say
        faults, rec = config.faults, config.recovery
        if faults.inject_failure is not None or faults.failure_model is not None:
            require(model, EMULATED_FAILURES)
        self.clock = StepClock(faults.hours_per_step(config.num_batches))
        self.pls = PLSAccount.resumed(config.num_batches * config.global_batch, pls)
        self.mode = rec.resolved_mode(parity is not None)
        self.emulator = self._emulator(faults, model.plan)
        lost_share = self.emulator.lost_share if self.emulator else 1.0 / topo.world_size
        mtbf = rec.mtbf or (faults.failure_model.mean if faults.failure_model else None)
        self.planner = RecoveryPlanner(topo, rec, self.mode, ckpt, restorer, self.clock, mtbf,
                                       lost_share, config.num_batches, say)
        self.recovery = build_recovery(self.mode, topo, model, parity, ckpt, restorer, self.pls,
                                       self.planner, config.global_batch, say, start_state)
        self.injected: set[int] = set()
        """Steps of the scripted losses already fired."""
        if ckpt is not None:
            ckpt.stats_sources.append(lambda: {"pls": self.pls.to_stats()})
            if self.planner.watches_saves:
                ckpt.on_saved = self.planner.after_save
            if self.planner.plans_interval:
                ckpt.schedule.interval = self.planner.first_interval(ckpt.schedule.interval)
                ckpt.schedule.restart(step)

    def _emulator(self, faults, plan) -> FailureEmulator | None:
        model = faults.failure_model
        if model is None:
            return None
        per_unit = self.clock.steps(Duration(1.0, model.scale.unit))
        emulator = FailureEmulator(model, per_unit, faults.failure_fraction or
                                   1.0 / plan.world_size,
                                   [plan.local_rows(r) for r in range(plan.world_size)],
                                   faults.failure_seed, whole_ranks=self.parity is not None)
        self.say(f"failure emulator: {model}, each failure loses {emulator.lost_per_failure} of "
                 f"{emulator.servers} emulated embedding servers ({emulator.lost_share:.1%} of "
                 f"the rows), seed {faults.failure_seed}; recovery: {self.mode}")
        return emulator

    def state(self) -> dict:
        """Which losses fired so far: the scripted steps and the emulator's progress (a new
        generation's members all take the first survivor's, `adopt`). Local."""
        return {"injected": sorted(self.injected),
                "emulator": self.emulator.progress() if self.emulator is not None else None}

    def adopt(self, state: dict | None) -> None:
        """Go on from `state()` of the generation's first survivor, so that every member, a
        replacement included, fires the same losses at the same steps (each scripted one once,
        a replay too). Local."""
        if state is None:
            return
        self.injected = set(state["injected"])
        if self.emulator is not None and state["emulator"] is not None:
            self.emulator.go_on_from(*state["emulator"])

    def note_step(self, seconds: float) -> None:
        """The wall time of the step just trained. Local."""
        self.clock.note_step(seconds)

    def loss_after(self, step: int) -> Loss | None:
        """The shards lost after `step`, if any: an `--inject-failure` event (each once: a
        rollback replays its step), or the emulator's next failure. Local; the same on every
        rank."""
        inject = self.config.faults.inject_failure
        event = inject.due(step, self.injected) if inject is not None else None
        if event is not None:
            return Loss.of_ranks(event.ranks, step, self.model.plan)
        return self.emulator.step_done(step) if self.emulator is not None else None

    def recover(self, loss: Loss) -> Outcome:
        """Emulate the loss (the lost rows, optimizer state and, of whole ranks, parity become
        NaN) and recover it. Collective."""
        for shard in loss.of_rank(self.topo.rank):
            self.model.embeddings.wipe_range(shard.start, shard.stop)
        if self.parity is not None:
            self.parity.lose_parity({s.rank for s in loss.shards if s.whole})
        return self.recovery.recover(loss)

    def summary(self) -> list[str]:
        """Lines for the end of the run's log. Local."""
        lines = []
        if self.emulator is not None:
            lines.append(self.emulator.summary())
        if self.pls.recoveries or self.mode in ("partial", "auto"):
            lines.append(f"PLS {self.pls.value:.5f} after {self.pls.recoveries} partial "
                         f"recoveries (portion of lost samples, CPR eq. 3)")
        return lines + self.planner.summary()

