"""The pure parts of partial recovery: CPR's equations and benefit check, PLS accounting (eq. 3),
the failure process and its emulator, and the priority trackers on hand-made access streams."""
import math

import numpy as np
import pytest
import torch

from mpickpt.durations import Duration, StepClock
from mpickpt.faults.emulator import FailureEmulator, servers_per_rank
from mpickpt.faults.process import CPR_GAMMA_SHAPE, FailureModel
from mpickpt.recovery.cpr_model import (Costs, benefit_check, expected_pls, full_overhead,
                                        partial_overhead, pls_interval, young_interval)
from mpickpt.recovery.pls import PLSAccount
from mpickpt.track.priority import (LargestChange, MostFrequentlyUsed, SubsampledUsed, budget,
                                    make_tracker)


# ---- CPR's equations -----------------------------------------------------------------------
def test_young_and_cpr_intervals_and_overheads():
    assert young_interval(2.0, 400.0) == pytest.approx(40.0)  # sqrt(2 * 2 * 400)
    assert pls_interval(0.1, 400.0, 0.25) == pytest.approx(320.0)  # 2 * 0.1 * 400 / 0.25
    assert pls_interval(0.1, 400.0, 1 / 8) == pytest.approx(2 * 0.1 * 8 * 400)  # T = 2 PLS N T_f
    assert expected_pls(320.0, 400.0, 0.25) == pytest.approx(0.1)  # eq. 4 inverts the interval
    c = Costs(save=2.0, load=5.0, reschedule=3.0, mtbf=400.0, total=4000.0)
    # eq. 1: O_save/T + (O_load + T/2 + O_res)/T_fail; eq. 2 without the lost half interval
    assert full_overhead(c, 40.0) == pytest.approx(2 / 40 + (5 + 20 + 3) / 400)
    assert partial_overhead(c, 320.0) == pytest.approx(2 / 320 + (5 + 3) / 400)
    # Young's interval minimises eq. 1
    grid = np.linspace(5, 200, 400)
    best = grid[np.argmin([full_overhead(c, t) for t in grid])]
    assert best == pytest.approx(young_interval(c.save, c.mtbf), rel=0.02)


def test_benefit_check_picks_partial_when_it_pays_and_full_otherwise():
    c = Costs(save=2.0, load=5.0, reschedule=3.0, mtbf=400.0, total=4000.0)
    d = benefit_check(c, target_pls=0.1, lost_share=0.25)
    assert d.mode == "partial" and d.interval == pytest.approx(320.0)
    assert d.partial_overhead < 0.9 * d.full_overhead
    assert "O_save 2.000" in d.explain() and "T_fail 400.0" in d.explain()
    tiny = benefit_check(c, target_pls=0.0005, lost_share=0.25)  # interval 1.6: saves too often
    assert tiny.mode == "full" and tiny.interval == pytest.approx(young_interval(2.0, 400.0))
    # a small gain is not enough: partial must save at least MIN_BENEFIT of full's overhead
    cheap = Costs(save=0.0, load=100.0, reschedule=0.0, mtbf=400.0, total=4000.0)
    assert benefit_check(cheap, 0.1, 0.25).mode == "full"  # 25.1% vs 25.0%: no benefit



def test_under_a_fixed_interval_both_modes_are_weighed_there_and_partial_meets_the_pls_target():
    """`--ckpt-interval N` with `--recovery auto`: the interval is the user's, so the check
    weighs both modes at it; partial recovery pays there, but only where its E[PLS] at that
    interval (eq. 4) meets the target."""
    c = Costs(save=2.0, load=5.0, reschedule=3.0, mtbf=400.0, total=4000.0)
    d = benefit_check(c, target_pls=0.1, lost_share=0.25, fixed=100)
    assert (d.mode, d.interval, d.fixed) == ("partial", 100, True)
    assert d.full_overhead == pytest.approx(full_overhead(c, 100))
    assert d.expected_pls == pytest.approx(0.5 * 100 * 0.25 / 400)
    assert "at the fixed interval 100 steps" in d.explain() and "Young" not in d.explain()
    loose = benefit_check(c, target_pls=0.1, lost_share=0.25, fixed=400)  # E[PLS] 0.125
    assert loose.mode == "full" and "E[PLS] 0.1250 against the target 0.1000" in loose.inputs()


# ---- PLS --------------------------------------------------------------------------------------
def test_pls_follows_eq3_over_a_scripted_sequence_of_failures():
    acct = PLSAccount(total_samples=1000 * 64)
    acct.partial_recovery(150, 64, [(0.25, 100)])  # one of four shards, 50 steps since its save
    acct.partial_recovery(420, 64, [(0.25, 400), (0.125, 400)])
    acct.partial_recovery(421, 64, [(0.5, 0)])  # nothing committed: back to the initial model
    by_hand = (0.25 * 50 * 64 + 0.375 * 20 * 64 + 0.5 * 421 * 64) / (1000 * 64)
    assert acct.value == pytest.approx(by_hand) and acct.recoveries == 3
    # CPR's form for one node of N_emb = 8: (S_i - S_last) / (S_total N_emb)
    one = PLSAccount(total_samples=500)
    one.partial_recovery(10, 5, [(1 / 8, 4)])
    assert one.value == pytest.approx((50 - 20) / (500 * 8))
    resumed = PLSAccount.resumed(64000, acct.to_stats())
    assert resumed.value == pytest.approx(by_hand) and resumed.recoveries == 3



def test_a_full_rollback_returns_the_pls_to_the_checkpoint_it_restores():
    acct = PLSAccount(total_samples=1000 * 64)
    acct.partial_recovery(150, 64, [(0.25, 100)])
    at_400 = acct.to_stats()  # what the checkpoint of step 400 records
    acct.partial_recovery(420, 64, [(0.5, 400)])
    assert acct.recoveries == 2
    change = acct.rolled_back(400, at_400)  # replays 401..420: the second recovery is undone
    assert change == pytest.approx(-0.5 * 20 * 64 / 64000)
    assert acct.value == at_400["value"] == pytest.approx(0.25 * 50 / 1000)
    assert acct.recoveries == 1 and acct.to_stats() == at_400
    assert acct.rolled_back(0, None) == pytest.approx(-at_400["value"])  # nothing committed
    assert acct.value == 0.0 and acct.recoveries == 0
    assert [e.get("rolled_back", False) for e in acct.events] == [False, False, True, True]

# ---- durations, failure processes, the emulator -------------------------------------------------
def test_durations_parse_and_convert():
    assert Duration.parse("300") == Duration(300.0, "steps") == Duration.parse("300steps")
    assert Duration.parse("14h") == Duration(14.0, "hours")
    with pytest.raises(ValueError, match="--mtbf must be a positive number"):
        Duration.parse("-3h", "--mtbf")
    emulated = StepClock(hours_per_step=0.5)
    assert emulated.steps(Duration(14.0, "hours")) == pytest.approx(28.0)
    real = StepClock()
    assert real.steps(Duration(60.0, "seconds")) is None  # no step measured yet
    real.note_step(0.5)
    assert real.steps(Duration(1.0, "minutes")) == pytest.approx(120.0)


@pytest.mark.parametrize("spec, mean", [("exponential:50", 50.0), ("gamma:0.5,40", 20.0),
                                         ("cpr:30", 30.0)])
def test_failure_model_draws_match_its_mean(spec, mean):
    model = FailureModel.parse(spec)
    assert model.mean.value == pytest.approx(mean)
    gaps = model.gaps(np.random.default_rng(1), 40_000)
    se = gaps.std() / math.sqrt(len(gaps))
    assert abs(gaps.mean() - mean) < 4 * se, (gaps.mean(), mean, se)


def test_cpr_gamma_shape_reproduces_cprs_median_to_mtbf_ratio():
    gaps = FailureModel.parse("cpr:14h").gaps(np.random.default_rng(2), 200_000)
    assert np.median(gaps) / gaps.mean() == pytest.approx(8 / 14, abs=0.01)  # CPR: 8 h / 14 h
    assert CPR_GAMMA_SHAPE == 0.68


def test_bad_failure_models_are_refused():
    for bad in ("weibull:3", "exponential:", "gamma:2", "gamma:-1,3", "exponential:5x"):
        with pytest.raises(ValueError, match="--failure-model"):
            FailureModel.parse(bad)


def test_emulator_is_reproducible_and_loses_the_asked_fraction():
    rows = [1000, 1000, 1000, 1000]
    model = FailureModel.parse("exponential:40")
    a = FailureEmulator(model, 1.0, 0.125, rows, seed=7).draw(50)
    b = FailureEmulator(model, 1.0, 0.125, rows, seed=7).draw(50)
    c = FailureEmulator(model, 1.0, 0.125, rows, seed=8).draw(50)
    assert a == b and a != c
    assert all(len(f.shards) == 1 and f.shards[0].rows == 500 for f in a)  # half a rank = 1/8
    assert servers_per_rank(0.125, 4, False) == 2 and servers_per_rank(0.5, 4, False) == 1
    half = FailureEmulator(model, 1.0, 0.5, rows, seed=7)
    assert half.lost_share == 0.5 and all(len(f.shards) == 2 for f in half.draw(20))
    whole = FailureEmulator(model, 1.0, 0.125, rows, seed=7, whole_ranks=True)
    assert whole.lost_share == 0.25 and all(f.shards[0].whole for f in whole.draw(20))
    steps = [f.executed for f in a]
    assert steps == sorted(steps) and abs(np.diff([0] + steps).mean() - 40) < 15


def test_emulator_feeds_losses_as_steps_execute():
    emu = FailureEmulator(FailureModel.parse("exponential:10"), 1.0, 0.25, [100] * 4, seed=3)
    due = [f.executed for f in FailureEmulator(FailureModel.parse("exponential:10"), 1.0, 0.25,
                                               [100] * 4, seed=3).draw(5)]
    fired = [executed for executed in range(1, due[-1] + 1)
             if emu.step_done(step=executed) is not None]
    assert fired == sorted(set(due)) and len(emu.fired) == len(fired)


# ---- priority trackers on hand-made access streams -------------------------------------------
def _feed(tracker, stream):
    for rows, counts in stream:
        tracker.observe(torch.tensor(rows), torch.tensor(counts))


def test_mfu_selects_the_most_used_rows_per_table_and_clears_them():
    t = MostFrequentlyUsed(10, [(0, 6), (6, 10)], "cpu")
    _feed(t, [([0, 1, 2, 7], [3, 1, 1, 2]), ([1, 2, 8], [1, 4, 1]), ([5, 9], [9, 1])])
    # table 0 counts: row0 3, row1 2, row2 5, row5 9 -> budget ceil(0.34 * 6) = 3: rows 5, 2, 0
    # table 1 counts: row7 2, row8 1, row9 1 -> budget ceil(0.34 * 4) = 2: row 7, then row 8 (tie
    # with 9 broken by the lower row)
    assert t.select(0.34).tolist() == [0, 2, 5, 7, 8]
    t.saved(np.array([0, 2, 5, 7, 8]))
    assert t.select(0.34).tolist() == [1, 9]  # what is left, with counts > 0
    assert budget(6, 0.34) == 3 and t.nbytes == 40


def test_ssu_keeps_a_bounded_list_with_random_eviction():
    t = SubsampledUsed(20, [(0, 10), (10, 20)], "cpu", fraction=0.3, seed=1, period=1)
    _feed(t, [([0, 1], [1, 1]), ([1, 11], [1, 1])])  # period 1: every lookup is sampled
    assert t.select(0.3).tolist() == [0, 1, 11]  # capacity 3 per table, no duplicates
    _feed(t, [([4, 5, 6, 7], [1, 1, 1, 1])])  # overflow: 6 candidates, 3 survive at random
    kept = t.select(0.3)
    table0 = [r for r in kept.tolist() if r < 10]
    assert len(table0) == 3 and set(table0) <= {0, 1, 4, 5, 6, 7} and 11 in kept
    picks = set()
    for seed in range(20):
        s = SubsampledUsed(20, [(0, 10)], "cpu", 0.3, seed, 1)
        _feed(s, [([0, 1, 4, 5, 6, 7], [1] * 6)])
        picks.add(tuple(s.select(0.3).tolist()))
    assert len(picks) > 3  # eviction is random, not "keep the first"
    t.saved(kept)
    assert t.select(0.3).tolist() == []
    sampled = SubsampledUsed(1000, [(0, 1000)], "cpu", fraction=1.0, seed=2, period=2)
    _feed(sampled, [(list(range(1000)), [1] * 1000)])
    assert 400 < len(sampled.select(1.0)) < 600  # each single lookup kept with probability 1/2
    # r x N row ids (int32) and a membership bit per row (in int64 words of 32)
    assert sampled.nbytes == 1000 * 4 + 32 * 8 and t.nbytes == 6 * 4 + 8


def test_scar_selects_the_largest_changes_since_the_last_save():
    w = torch.zeros(12, 2)
    t = LargestChange(12, [(0, 8), (8, 12)], "cpu", weight=w)
    moved = {1: 1.0, 3: 4.0, 4: 2.0, 6: 3.0}  # looked up and moved: distinct L2 changes
    for row, by in moved.items():
        w[row, 0] += by
    w[7] += 10.0  # moved furthest but never looked up: not a candidate
    w[9, 1] += 0.5  # table 1: one moved row
    _feed(t, [([1, 2, 3], [1, 1, 1]), ([4, 6, 9, 10], [1, 1, 1, 1])])  # 2 and 10 did not move
    assert budget(8, 0.25) == 2 and budget(4, 0.25) == 1
    # the budget binds in table 0 (4 candidates, 2 slots): exactly the two largest, 3 and 6
    assert t.select(0.25).tolist() == [3, 6, 9]
    # with room for every row, only rows both looked up and moved are chosen
    assert t.select(1.0).tolist() == [1, 3, 4, 6, 9]
    t.saved(np.array([3, 6, 9]))
    for row in (3, 6, 9):  # the last-saved values are now the current ones
        assert torch.equal(t.last_saved[row], w[row]) and not t.dirty[row]
    assert torch.equal(t.last_saved[[1, 4, 7]], torch.zeros(3, 2))  # unsaved rows keep theirs
    w[3, 0] += 0.5  # 4.5 from the start, but 0.5 since its save: below rows 4 (2) and 1 (1)
    _feed(t, [([3], [1])])
    assert t.select(0.25).tolist() == [1, 4]
    w[3, 0] += 2.0  # now 2.5 since its save: the largest change again
    assert t.select(0.25).tolist() == [3, 4]
    t.reset()  # a baseline wrote every row
    assert t.select(1.0).tolist() == [] and torch.equal(t.last_saved, w)


def test_tracker_memory_follows_cpr_table_1_and_is_what_the_tensors_hold():
    ranges, n, dim, r = [(0, 300), (300, 500), (500, 537)], 537, 16, 0.125
    weight = torch.zeros(n, dim)
    caps = [budget(hi - lo, r) for lo, hi in ranges]
    assert caps == [38, 25, 5]
    expected = {"mfu": 4 * n,  # a 4-byte counter per row
                "ssu": 4 * sum(caps) + 8 * math.ceil(n / 32),  # r x n int32 ids + a bit per row
                "scar": n * dim * 4 + n}  # the last-saved weights + a dirty byte per row
    for rule, want in expected.items():
        t = make_tracker(rule, n, ranges, "cpu", r, weight)
        assert t.nbytes == want, rule
        held = [v for v in vars(t).values() if isinstance(v, torch.Tensor) and v is not weight]
        if rule == "ssu":  # the id list grows up to its bound; the bits are allocated up front
            held = [t.members.words]
            want -= 4 * sum(caps)
            _feed(t, [(list(range(n)), [100] * n)])  # period 2, 100 lookups: all sampled
            assert len(t.ids) == sum(caps) and t.ids.dtype == torch.int32
        assert sum(x.untyped_storage().nbytes() for x in held) == want, rule
