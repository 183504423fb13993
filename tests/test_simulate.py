"""The failure simulator against closed forms: no failures, no overhead but the saves; full
recovery with exponential failures matches the renewal-reward expectation; partial recovery's PLS
matches CPR eq. 4; the simulated 4-rank job agrees with the partial-recovery benchmark's emulated
runs; Young's interval is the simulated optimum; the same seed gives the same result;
parity covers what ECRM covers."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from mpickpt.parity.guard import ParityConfig
from mpickpt.simulate.costs import EventCosts
from mpickpt.simulate.crosscheck import crosscheck
from mpickpt.simulate.engine import Segment, simulate_run
from mpickpt.simulate.montecarlo import run_many, simulate
from mpickpt.simulate.scenario import HOUR, Scenario
from mpickpt.simulate.strategies import REBUILD_BUDGET, Parity, Strategy, build
from mpickpt.simulate.plot import crossovers
from mpickpt.simulate.__main__ import main as simulate_main

PARTIAL_4RANKS = Path(__file__).resolve().parents[1] / "bench" / "results" / \
    "partial_recovery_4ranks.json"

COSTS = EventCosts(stall=30.0, write=0.0, load=300.0, load_node=20.0, rebuild_node=10.0,
                   reschedule=120.0, relaunch=180.0, full_bytes=1e12)


def _exponential(**kw) -> Scenario:
    base = dict(ranks=64, train_seconds=200 * HOUR, ranks_per_node=8, node_mtbf=80 * HOUR,
                shape=1.0, multi_prob=0.0, time_limit=0.0)
    return Scenario(**{**base, **kw})


def _with_interval(strategy: Strategy, interval: float) -> Strategy:
    strategy.plan = strategy.plan.with_(interval=interval)
    return strategy


def _runs(strategy, sc, n, seed=1):
    return run_many(strategy, sc, n, seed)


def test_a_failure_free_job_pays_exactly_its_checkpoint_stalls():
    sc = _exponential(node_mtbf=1e18)
    for stall in (0.0, 30.0):
        s = _with_interval(Strategy(sc, COSTS.with_(stall=stall)), 3600.0)
        r = simulate_run(s, sc, np.random.default_rng(0))
        taken = math.ceil(sc.train_seconds / 3600.0) - 1  # none at the very end
        assert r.failures == 0 and r.checkpoints == taken
        assert r.wall - sc.train_seconds == pytest.approx(taken * stall, abs=1e-6)


def test_full_recovery_matches_the_renewal_reward_expectation():
    """Exponential failures at rate l, work per interval tau = T + stall, restart cost R:
    E[time of one interval] = (e^(l tau) - 1)(1/l + R); the last interval has no stall, and in
    the first there is no checkpoint to load yet (R = the reschedule alone)."""
    sc = _exponential()
    interval = 2 * HOUR
    s = _with_interval(Strategy(sc, COSTS), interval)
    lam = 1.0 / sc.job_mtbf
    restart = COSTS.reschedule + COSTS.load
    m = round(sc.train_seconds / interval)

    def segment(tau, restart=restart):
        return (math.exp(lam * tau) - 1) * (1 / lam + restart)
    expected = (segment(interval + COSTS.stall, COSTS.reschedule)
                + (m - 2) * segment(interval + COSTS.stall) + segment(interval)) \
        / sc.train_seconds - 1
    overheads = [(r.wall - sc.train_seconds) / sc.train_seconds for r in _runs(s, sc, 400)]
    mean, se = np.mean(overheads), np.std(overheads, ddof=1) / math.sqrt(len(overheads))
    assert sum(r.failures for r in _runs(s, sc, 5)) > 0
    assert abs(mean - expected) < 3 * se, (mean, expected, se)
    assert 0.1 < expected < 1.0  # a regime where failures matter


def test_partial_recovery_pls_matches_cpr_eq4():
    sc = _exponential()
    ec = COSTS.with_(stall=0.0, load_node=0.0, reschedule=0.0)
    s = _with_interval(build("cpr", sc, ec), 4 * HOUR)
    runs = _runs(s, sc, 400)
    assert all(r.kinds["rollback"] == 0 for r in runs) and sum(r.failures for r in runs) > 100
    pls = [r.pls for r in runs]
    # eq. 4: E[PLS] = 0.5 T_save L / T_fail (L = one node's share of the rows)
    expected = 0.5 * 4 * HOUR * sc.node_share / sc.job_mtbf
    assert abs(np.mean(pls) - expected) < 3 * np.std(pls, ddof=1) / math.sqrt(len(pls))


def test_youngs_interval_minimises_simulated_full_recovery_overhead():
    sc = _exponential(node_mtbf=400 * HOUR)
    base = Strategy(sc, COSTS)
    young = base.plan.interval
    means = {}
    for factor in (0.35, 1.0, 3.0):
        s = _with_interval(Strategy(sc, COSTS), young * factor)
        means[factor] = np.mean([(r.wall - sc.train_seconds) / sc.train_seconds
                                 for r in _runs(s, sc, 300, seed=4)])
    assert means[1.0] < means[0.35] and means[1.0] < means[3.0], means


def test_the_same_seed_gives_the_same_result_and_another_seed_another():
    sc = Scenario(ranks=512)
    a, b = simulate("cpr", sc, COSTS, 20, seed=7), simulate("cpr", sc, COSTS, 20, seed=7)
    c = simulate("cpr", sc, COSTS, 20, seed=8)
    assert a["overhead"] == b["overhead"] and a["pls"] == b["pls"]
    assert a["overhead"] != c["overhead"]


def test_parity_covers_r_nodes_per_group_and_not_during_a_rebuild():
    sc = Scenario(ranks=80)  # 10 nodes: groups of k + r = 5 nodes
    p = Parity(sc, COSTS, k=4, r=1)
    assert p.covers([3], False) and p.covers([0, 5], False)
    assert not p.covers([3, 4], False) and not p.covers([3], True)
    assert p.react([3], False).kind == "rebuild" and p.react([3, 4], False).kind == "rollback"
    assert p.react([3], False).window == pytest.approx(COSTS.rebuild_node / REBUILD_BUDGET)
    assert REBUILD_BUDGET == ParityConfig(k=1).budget  # the simulator follows the default


def test_hot_spares_replace_failed_nodes_in_place_instead_of_a_reschedule():
    """With spare nodes a failure of up to that many nodes costs the spares' join (growing with
    the ranks) instead of --reschedule; a larger one still waits for a node; the job's
    recovery time drops by the difference per covered failure."""
    costs = COSTS.with_(spare_join=0.5, rendezvous_per_rank=1e-4)
    sc = Scenario(ranks=80, spare_nodes=1)
    p = Parity(sc, costs, k=4, r=1)
    assert p.replace([3]) == pytest.approx(0.5 + 80e-4)
    assert p.react([3], False).wall == pytest.approx(0.5 + 80e-4 + COSTS.rebuild_node)
    assert p.react([0, 5], False).wall == pytest.approx(120.0 + 2 * COSTS.rebuild_node)
    assert Parity(sc.with_(spare_nodes=0), costs).replace([3]) == 120.0
    assert costs.in_place(16384) == pytest.approx(0.5 + 1.6384)
    exp = _exponential(failure_clock="work")  # failures in training time: the same in both
    without = _runs(build("cpr", exp, costs), exp, 20)
    spared = _runs(build("cpr", exp.with_(spare_nodes=1), costs), exp.with_(spare_nodes=1), 20)
    fails = sum(r.failures for r in without)
    assert fails == sum(r.failures for r in spared) > 20  # seed for seed
    saved = sum(r.recovery for r in without) - sum(r.recovery for r in spared)
    assert saved == pytest.approx(fails * (120.0 - costs.in_place(64)), rel=1e-6)
    with pytest.raises(ValueError, match="spare_nodes must be >= 0"):
        Scenario(ranks=8, spare_nodes=-1)


def test_segment_counts_commits_only_after_the_write():
    seg = Segment(p=0.0, origin=0.0, interval=100.0, rate=1.0, stall=10.0, write=50.0)
    progress, committed, taken, n, spent = seg.at(150.0)  # stall at 100..110, commit at 150
    assert (progress, committed, taken, n, spent) == (140.0, 100.0, 100.0, 1, 10.0)
    assert seg.at(149.0)[1] is None
    assert seg.finish(250.0) == pytest.approx(270.0)  # two stalls before 250 of progress


def test_simulate_cli_names_a_best_strategy_and_auto_ratio(tmp_path, capsys):
    doc = simulate_main(["--ranks", "64,4096", "--mtbf", "cpr", "--runs", "20",
                         "--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")])
    table = doc["tables"][0]
    assert table["best"] in table["rows"] and table["auto_over_best"] >= 1.0 - 1e-9
    out = capsys.readouterr().out
    assert "auto / best overhead" in out
    assert ("crossover at" in out) == bool(doc["crossovers"])
    assert (tmp_path / "s.json").exists()
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_crossovers_are_where_the_best_strategy_changes():
    tables = [{"mtbf": m, "ranks": n, "best": b} for m, n, b in (
        ("cpr", 8, "full"), ("cpr", 64, "full"), ("cpr", 512, "cpr"), ("cpr", 4096, "cpr-mfu"),
        ("llama3", 8, "full"), ("llama3", 64, "full"))]
    assert crossovers(tables) == [
        {"mtbf": "cpr", "from_ranks": 64, "to_ranks": 512, "from": "full", "to": "cpr"},
        {"mtbf": "cpr", "from_ranks": 512, "to_ranks": 4096, "from": "cpr", "to": "cpr-mfu"}]


def test_a_fixed_lost_share_sets_the_pls_of_every_failure():
    sc = _exponential(ranks=8, lost_share=0.25)  # one node, but a failure loses a quarter
    assert sc.nodes == 1 and sc.failure_share(1) == 0.25 and sc.expected_lost_share() == 0.25
    ec = COSTS.with_(stall=0.0, load_node=0.0, reschedule=0.0)
    s = _with_interval(build("cpr", sc, ec), 4 * HOUR)
    pls = [r.pls for r in _runs(s, sc, 400)]
    expected = 0.5 * 4 * HOUR * 0.25 / sc.job_mtbf
    assert abs(np.mean(pls) - expected) < 3 * np.std(pls, ddof=1) / math.sqrt(len(pls))
    with pytest.raises(ValueError, match="lost_share"):
        _exponential(lost_share=1.5)


def test_tracker_upkeep_slows_only_the_prioritized_strategies():
    sc = Scenario(ranks=64)
    ec = COSTS.with_(priority_upkeep={"mfu": 0.02})
    assert build("cpr-mfu", sc, ec).plan.upkeep == 0.02
    assert build("cpr-ssu", sc, ec).plan.upkeep == 0.0 and build("cpr", sc, ec).plan.upkeep == 0


def test_simulator_agrees_with_the_emulated_4_rank_runs():
    """Issue 16's cross-check on the committed benchmark: overhead and PLS of full recovery and
    CPR-vanilla at 4 ranks lie within the benchmark's 95 % intervals."""
    result = crosscheck(PARTIAL_4RANKS, runs=2000)
    assert {r["config"] for r in result["rows"]} == {"full", "vanilla@0.1"}
    for r in result["rows"]:
        assert r["sim"]["failures"] > 1.0 and r["agree"] == {"overhead": True, "pls": True}, r
    assert result["all_agree"]
    full = next(r for r in result["rows"] if r["config"] == "full")
    assert full["sim"]["pls"] == 0.0 and full["sim"]["overhead"] > 0.01


def test_the_crosscheck_can_disagree(tmp_path):
    doc = json.loads(PARTIAL_4RANKS.read_text())
    for row in doc["rows"]:
        row["overhead"]["total"] *= 3  # a benchmark three times as costly
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    result = crosscheck(bad, runs=500)
    assert not result["all_agree"]
    assert not any(r["agree"]["overhead"] for r in result["rows"])
    bad.write_text("{}")
    with pytest.raises(ValueError, match="expected bench/partial_recovery.py's JSON"):
        crosscheck(bad)


def test_bad_input_is_named():
    with pytest.raises(SystemExit, match="unknown strategy 'nope'"):
        simulate_main(["--strategies", "nope"])
    with pytest.raises(SystemExit, match="--mtbf 'x'"):
        simulate_main(["--ranks", "8", "--mtbf", "x", "--runs", "2"])
    with pytest.raises(ValueError, match="ranks"):
        Scenario(ranks=0)


def test_the_work_clock_skips_stalls_and_downtime():
    seg = Segment(p=0.0, origin=0.0, interval=100.0, rate=1.0, stall=10.0, write=0.0)
    assert seg.wall_for_work(50.0) == 50.0 and seg.wall_for_work(100.0) == 100.0  # before a stall
    assert seg.wall_for_work(150.0) == 160.0 and seg.wall_for_work(250.0) == 270.0
    # the same failure draws: on the work clock a job with long stalls sees fewer failures
    sc = _exponential(ranks=8, node_mtbf=20 * HOUR)
    ec = COSTS.with_(stall=1800.0)
    wall = [r.failures for r in _runs(_with_interval(Strategy(sc, ec), 2 * HOUR), sc, 200)]
    work_sc = sc.with_(failure_clock="work")
    work = [r.failures for r in _runs(_with_interval(Strategy(work_sc, ec), 2 * HOUR), work_sc,
                                      200)]
    assert np.mean(work) < 0.9 * np.mean(wall)
    with pytest.raises(ValueError, match="failure_clock"):
        sc.with_(failure_clock="cpu")


def test_an_emulated_failure_rolls_back_to_the_checkpoint_in_flight():
    """A write as long as the interval: a real failure goes back to the one before; an emulated
    one (writers survive) to the one being written, so it loses less."""
    sc = _exponential(ranks=8, node_mtbf=30 * HOUR)
    ec = COSTS.with_(stall=0.0, write=2 * HOUR - 1.0)
    lost = {}
    for inflight in (False, True):
        run_sc = sc.with_(inflight_commits=inflight)
        runs = _runs(_with_interval(Strategy(run_sc, ec), 2 * HOUR), run_sc, 200)
        lost[inflight] = np.mean([r.lost / max(r.failures, 1) for r in runs if r.failures])
    assert lost[True] < 0.7 * lost[False]


def test_youngs_interval_counts_the_wait_for_a_long_write():
    from mpickpt.simulate.strategies import young_with_writes

    mtbf = 10 * HOUR
    assert young_with_writes(30.0, 0.0, mtbf) == pytest.approx(math.sqrt(2 * 30.0 * mtbf))

    def cost(t, stall, write):
        return (stall + max(0.0, write - t)) / t + t / (2 * mtbf)
    for write in (600.0, 3000.0, 20000.0):  # shorter, about as long and longer than Young's
        best = min(np.linspace(10.0, 40000.0, 40000), key=lambda t: cost(t, 30.0, write))
        t = young_with_writes(30.0, write, mtbf)
        assert cost(t, 30.0, write) <= cost(best, 30.0, write) + 1e-6, (write, t, best)
