"""RecoveryPlanner in process, on explicit measurements: Young's interval from the measured O_save,
CPR eq. 4 from a target PLS, the save-share scaling of prioritized saves, the first interval, the
re-plan after every save (median of the last five measurements), `--recovery auto`'s decision, and
the log lines with their inputs.

The planner's inputs are plain objects holding what the checkpoint manager and the restorer record
(lists of measured seconds) and a real `CheckpointSchedule`; the one-rank max of the agreement is
the identity (what `Allreduce(MAX)` returns on one rank)."""
import math
import re
from types import SimpleNamespace

import pytest

from mpickpt.durations import Duration, StepClock
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.schedule import CheckpointSchedule
from mpickpt.recovery.config import RecoveryConfig
from mpickpt.recovery.cpr_model import Costs, benefit_check
from mpickpt.recovery.planner import RecoveryPlanner

STEP_S = 0.1  # measured seconds per step: O_save 0.2 s = 2 steps


def _planner(tmp_path, mode="full", interval="auto", target_pls=None, share=1.0,
             mtbf=Duration(400.0), lost_share=0.25, total=1000, clock=None, start=10):
    lines = []
    ckpt = SimpleNamespace(config=CheckpointConfig(directory=str(tmp_path), interval=interval),
                           kind=SimpleNamespace(save_share=share), save_seconds=[],
                           write_seconds=[], schedule=CheckpointSchedule(start))
    restorer = SimpleNamespace(seconds=[], partial_seconds=[])
    if clock is None:
        clock = StepClock()
        clock.note_step(STEP_S)
    config = RecoveryConfig(mode=mode, target_pls=target_pls, mtbf=mtbf)
    planner = RecoveryPlanner(None, config, mode, ckpt, restorer, clock, mtbf, lost_share, total,
                              lines.append, reduce_max=lambda values: values.copy())
    return planner, ckpt, restorer, lines


def _save(planner, ckpt, step, seconds, write=0.05):
    ckpt.save_seconds.append(seconds)
    ckpt.write_seconds.append(write)
    planner.after_save(step)


def test_young_interval_from_the_measured_save_cost_and_replanned_after_each_save(tmp_path):
    planner, ckpt, _, lines = _planner(tmp_path)
    assert planner.plans_interval
    _save(planner, ckpt, 10, 0.2)  # O_save 2 steps, T_fail 400: sqrt(2 x 2 x 400) = 40
    assert ckpt.schedule.interval == 40 and ckpt.schedule.next == 50
    assert planner.history[-1]["costs"]["save"] == pytest.approx(2.0)
    assert planner.history[-1]["interval"] == pytest.approx(math.sqrt(2 * 2.0 * 400))
    _save(planner, ckpt, 50, 0.2)
    _save(planner, ckpt, 90, 0.2)
    for step in (130, 170):  # slow saves of 0.8 s: the median of the last five stays 0.2 s ...
        _save(planner, ckpt, step, 0.8)
        assert ckpt.schedule.interval == 40 and ckpt.schedule.next == step + 40
    _save(planner, ckpt, 210, 0.8)  # ... until 0.8 s is the median: O_save 8, sqrt(2 x 8 x 400)
    assert ckpt.schedule.interval == 80 and ckpt.schedule.next == 290
    # a measured slower step makes the same save cheaper in steps: 0.8 s / 0.2 s = 4 steps
    planner.clock.seconds_per_step = 0.2
    _save(planner, ckpt, 290, 0.8)
    assert ckpt.schedule.interval == round(math.sqrt(2 * 4.0 * 400))  # 57


def test_cpr_eq4_sets_the_partial_recovery_interval(tmp_path):
    # T_save = 2 PLS N_emb T_fail with N_emb = 1 / lost share = 4: 2 x 0.1 x 4 x 400 = 320
    planner, ckpt, _, lines = _planner(tmp_path, mode="partial", interval=None, target_pls=0.1)
    assert planner.first_interval(1000) == 320  # needs no measurement: T_fail is in steps
    _save(planner, ckpt, 10, 5.0)  # whatever a save costs
    assert ckpt.schedule.interval == 320
    assert "CPR eq. 4: 2 x PLS 0.1 x T_fail 400.0 / lost share 0.250" in lines[-1]
    # one failure loses 1/8 of the shards: N_emb = 8, T_save = 2 x 0.1 x 8 x 400 = 640
    planner, ckpt, _, _ = _planner(tmp_path, mode="partial", interval=None, target_pls=0.1,
                                   lost_share=1 / 8)
    _save(planner, ckpt, 10, 0.2)
    assert ckpt.schedule.interval == 640


def test_prioritized_saves_are_planned_share_times_the_interval(tmp_path):
    planner, ckpt, _, lines = _planner(tmp_path, mode="partial", interval=None, target_pls=0.1,
                                       share=0.125)
    assert planner.first_interval(1000) == 40  # 320 x 1/8
    _save(planner, ckpt, 10, 0.2)
    assert ckpt.schedule.interval == 40 and planner.history[-1]["interval"] == 320
    assert "x 0.125 for saves of that share of the rows" in lines[-1]
    young, yckpt, _, _ = _planner(tmp_path, share=0.25)
    _save(young, yckpt, 10, 0.2)
    assert yckpt.schedule.interval == 10  # Young's 40 x 1/4


def test_first_interval(tmp_path):
    # nothing measured yet: a fiftieth of the run (O_save is measured early), at most the default
    planner, _, _, _ = _planner(tmp_path, total=1000)
    assert planner.first_interval(100) == 20 and planner.first_interval(7) == 7
    assert _planner(tmp_path, total=30)[0].first_interval(100) == 1
    # CPR's interval from an MTBF in emulated hours: 14 h at 0.5 h per step = 28 steps
    emulated = StepClock(hours_per_step=0.5)
    planner, _, _, _ = _planner(tmp_path, mode="partial", interval=None, target_pls=0.1,
                                mtbf=Duration(14.0, "hours"), clock=emulated)
    assert planner.first_interval(1000) == round(2 * 0.1 * 28 / 0.25)  # 22
    # an MTBF in real hours cannot be counted in steps before a step is measured
    planner, _, _, _ = _planner(tmp_path, mode="partial", interval=None, target_pls=0.1,
                                mtbf=Duration(1.0, "hours"), clock=StepClock())
    assert planner.first_interval(1000) == 20


def test_nothing_is_planned_before_a_step_is_measured_nor_with_a_fixed_interval(tmp_path):
    planner, ckpt, _, lines = _planner(tmp_path, clock=StepClock())
    _save(planner, ckpt, 10, 0.2)
    assert ckpt.schedule.interval == 10 and planner.history == [] and lines == []
    fixed, fckpt, _, _ = _planner(tmp_path, mode="auto", interval=25, start=25)
    assert not fixed.plans_interval and fixed.watches_saves  # FaultTolerance hooks it then
    _save(fixed, fckpt, 25, 0.2)
    assert fckpt.schedule.interval == 25 and fixed.decision is not None  # decided, not re-planned
    assert fixed.decision.fixed and fixed.decision.interval == 25


def test_auto_decides_on_the_measured_costs_and_logs_the_inputs(tmp_path):
    planner, ckpt, restorer, lines = _planner(tmp_path, mode="auto", interval=None,
                                              target_pls=0.1)
    restorer.seconds.append(0.5)  # a measured restore: O_load 5 steps
    _save(planner, ckpt, 10, 0.2)
    want = benefit_check(Costs(save=2.0, load=5.0, reschedule=0.0, mtbf=400.0, total=1000.0,
                               partial_load=5.0 * 0.25), 0.1, 0.25)
    assert planner.decision == want and want.mode == "partial"
    assert ckpt.schedule.interval == round(want.interval) == 320
    assert planner.mode_for_loss() == "partial"
    assert lines[0] == want.explain()
    assert "O_save 2.000" in lines[1] and "O_load 5.000 (partial 1.250)" in lines[1]
    assert "T_fail 400.0" in lines[1] and "step 0.1000 s" in lines[1]
    # a partial restore measured at 100 s (1000 steps): partial recovery no longer pays
    restorer.partial_seconds.append(100.0)
    _save(planner, ckpt, 330, 0.2)
    assert planner.decision.mode == "full" and planner.mode_for_loss() == "full"
    assert planner.decision.costs.partial_load == pytest.approx(1000.0)
    assert ckpt.schedule.interval == 40  # Young's sqrt(2 x 2 x 400)
    assert any(line.startswith("recovery auto: full recovery (") for line in lines)


def test_plan_lines_carry_their_inputs_and_small_moves_are_logged_at_the_end(tmp_path):
    planner, ckpt, _, lines = _planner(tmp_path)
    _save(planner, ckpt, 10, 0.2)
    assert lines == ["checkpoint interval: 40 steps (Young: sqrt(2 x O_save 2.000 x T_fail "
                     "400.0) in steps; step 0.1000 s)"]
    _save(planner, ckpt, 50, 0.24)  # median 0.22 s: 42 steps, under a quarter: not logged
    _save(planner, ckpt, 92, 0.24)  # median 0.24 s: 44 steps
    assert len(lines) == 1 and ckpt.schedule.interval == 44
    assert [h["planned"] for h in planner.history] == [40, 42, 44]  # every plan, with its inputs
    assert planner.history[-1]["why"].startswith("Young: sqrt(2 x O_save 2.400")
    _save(planner, ckpt, 136, 0.5)
    _save(planner, ckpt, 186, 0.5)  # median 0.24 s still
    _save(planner, ckpt, 230, 0.5)  # median 0.5 s: O_save 5, 63 steps: a move of 43 %
    assert len(lines) == 2 and lines[-1].startswith("checkpoint interval: 63 steps (Young: "
                                                    "sqrt(2 x O_save 5.000 x T_fail 400.0)")
    summary, = planner.summary()
    m = re.fullmatch(r"checkpoint planning: 6 re-plans, interval 40\.\.63 steps; last at step "
                     r"230: 63 steps \(Young: sqrt\(2 x O_save 5\.000 x T_fail 400\.0\) in "
                     r"steps; step 0\.1000 s\)", summary)
    assert m, summary
