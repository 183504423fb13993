"""bench/time_lost.py's paired estimate on hand-made run reports (the benchmark itself takes
minutes): the half interval after each checkpoint against the next, the run without checkpoints
taking out what the windows differ by anyway, the bootstrap interval and the verdict."""
import time

import numpy as np
import pytest

from tests.bench_module import load_bench

INTERVAL, STEPS = 10, 200


@pytest.fixture(scope="module")
def bench():
    return load_bench("time_lost")


def _report(step_s, writes=None) -> dict:
    """A run report whose step s took step_s(s) seconds of loop time (ends accumulate)."""
    ends = np.cumsum([step_s(s) for s in range(1, STEPS + 1)])
    doc = {"steps": [[s, 1.0, 0.01, float(ends[s - 1])] for s in range(1, STEPS + 1)]}
    if writes is not None:
        doc["write_seconds"] = writes
    return doc


def _after_checkpoint(s: int) -> bool:
    """Step s lies in the first half interval after a checkpoint (its save call is in the first
    step's time)."""
    return s > INTERVAL and (s - 1) % INTERVAL < INTERVAL // 2


def test_the_windows_find_the_time_after_each_checkpoint_net_of_the_run_without(bench):
    rng = np.random.default_rng(1)
    jitter = {s: float(rng.normal(0, 0.001)) for s in range(1, STEPS + 1)}
    # the same periodic pattern in both runs (a slower step right after every 10th), which the
    # run without checkpoints must take out; 3 ms more per step for 5 steps after a checkpoint
    base_s = {s: 0.05 + (0.01 if s % INTERVAL == 1 else 0.0) + jitter[s] for s in jitter}
    ckpt_s = {s: base_s[s] + (0.003 if _after_checkpoint(s) else 0.0) for s in jitter}
    base, ckpt = _report(base_s.get), _report(ckpt_s.get, writes=[0.01] * 19 + [0.5])
    mine = {"window_diffs_s": bench.window_differences(ckpt, INTERVAL),
            "base_window_diffs_s": bench.window_differences(base, INTERVAL)}
    # checkpoints at 20, 30, ..., 190 (the first interval is warm-up, 200 has no windows after)
    assert len(mine["window_diffs_s"]) == STEPS // INTERVAL - bench.WARM_INTERVALS
    mean, low, high = bench.paired([mine])
    assert mean == pytest.approx(0.015, abs=0.003)
    assert low < mean < high and high - low < 0.01
    assert bench.verdict(low, high, 0.05) == "met"
    assert bench.verdict(low, high, 0.005) == "missed"
    assert bench.verdict(low, high, mean) == "not separated"
    # the 18 paired checkpoints' writes all fit in their 5-step half (the last, 0.5 s, is the
    # save at 200, which has no windows)
    assert bench.committed_within(ckpt, INTERVAL) == 1.0
    slow = _report(ckpt_s.get, writes=[0.01] * 9 + [0.5] * 11)
    assert bench.committed_within(slow, INTERVAL) == pytest.approx(8 / 18)


def test_reports_without_step_ends_give_no_paired_estimate(bench):
    old = {"steps": [[s, 1.0, 0.01] for s in range(1, STEPS + 1)]}
    mine = {"window_diffs_s": bench.window_differences(old, INTERVAL),
            "base_window_diffs_s": []}
    assert mine["window_diffs_s"] == []
    mean, low, high = bench.paired([mine])
    assert mean != mean and bench.verdict(low, high, 0.01) == "-"


def _row(cpu_s, diffs, **extra) -> dict:
    return {"ranks": 1, "kind": "full", "background": "idle", "snapshot": "copy-on-update",
            "io": "direct", "lost_s": 0.01, "stall_s": 0.001, "cpu_s": cpu_s,
            "background_cpu_per_gb": 0.3, "jobs_cpu_per_gb": 0.25, "within": 1.0,
            "window_diffs_s": diffs, "base_window_diffs_s": [0.0, 0.0, 0.001, -0.001],
            **extra}


def test_the_bounds_count_all_background_cpu_and_the_machine_floor_its_interference(bench):
    """The issue's bound counts the background's CPU: the writers', the extractor's and the
    copier's; the machine floor weighs the copier's by the probe's copy share and the rest by
    its write share; a row recorded before the extractor's and the copier's CPU counts the
    writers."""
    diffs = [0.0095, 0.0105, 0.010, 0.010]  # ~10 ms lost per checkpoint, tight
    rows = [_row(0.014, diffs, companion_cpu_s=0.002, copy_cpu_s=0.010),
            _row(0.014, diffs, companion_cpu_s=0.002, copy_cpu_s=0.010)]
    (s,) = bench.summarize(rows, {"full": 0.3}, {1: {"copy": 0.2, "write": 0.8}})
    assert (s["kind"], s["background"], s["core_split"]) == ("full", "idle", "shared")
    assert s["background_ms"] == pytest.approx(26.0)
    assert s["bound_ms"] == pytest.approx(2 * 1.0 + 0.1 * 26.0)
    assert s["machine_floor_ms"] == pytest.approx(2 * 1.0 + 0.2 * 10.0 + 0.8 * 16.0)
    if bench.free_core(1):  # a 2-core machine or more
        assert s["paired_verdict"] == "missed" and s["machine_verdict"] == "met"
    (old,) = bench.summarize([_row(0.014, diffs)], {"full": 0.3})
    assert old["background_ms"] == pytest.approx(14.0) and old["machine_floor_ms"] != \
        old["machine_floor_ms"]  # no probe: no machine floor, and no verdict against it
    assert old["machine_verdict"] == "-"
    assert bench.verdict(0.001, 0.002, float("nan")) == "-"


def test_with_no_core_free_the_cpu_per_gb_counts_the_extractor_s_bytes_too(bench, monkeypatch):
    """The jobs' CPU per GB over the writers' bytes, and over all the background wrote (the
    extractor's bundles too), each against 1.5 × the floor; a row recorded before the
    extractor's bytes has no verdict on the second."""
    monkeypatch.setattr(bench, "free_core", lambda ranks: False)  # as 2 ranks on 2 cores
    rows = [_row(0.014, [], ranks=2, kind="incrcp", jobs_cpu_per_gb=r * 2.0,
                 jobs_cpu_per_gb_all=r * 0.7) for r in (1.0, 1.2, 0.9)]
    (s,) = bench.summarize(rows, {"incrcp": 0.5})
    assert s["jobs_cpu_s_per_gb"] == pytest.approx(2.0) and s["jobs_over_floor"] == \
        pytest.approx(4.0) and s["jobs_met"] is False
    assert s["jobs_cpu_s_per_gb_all"] == pytest.approx(0.7)
    assert s["jobs_all_over_floor"] == pytest.approx(1.4) and s["jobs_all_met"] is True
    (old,) = bench.summarize([_row(0.014, [], ranks=2)], {"full": 0.5})
    assert old["jobs_all_met"] is None and old["jobs_met"] is True


def test_the_interference_share_is_the_median_of_the_rounds_per_kind(bench):
    probes = [{"ranks": 1, "share_copy": c, "share_write": w}
              for c, w in ((0.2, 0.9), (0.3, 0.8), (0.25, 1.0))]
    probes.append({"ranks": 3, "share_copy": 0.5, "share_write": 0.6})
    assert bench.interference_share(probes) == {1: {"copy": 0.25, "write": 0.9},
                                                3: {"copy": 0.5, "write": 0.6}}


def test_the_probe_runs_each_hog_beside_one_run_and_counts_its_cpu(bench, monkeypatch, tmp_path):
    """The interference probe's hogs (real idle-priority processes; the write hog writes to the
    run's directory) each run beside one run only, end cleanly, and their CPU from their set-up
    on is what each share divides by."""
    loops = {"probe-alone": 0.40, "probe-copy": 0.46, "probe-write": 0.50}

    def fake_run(ranks, args, workdir, name, extra):  # the training runs take minutes
        hogs = [p for p in tmp_path.glob("hog-*")]
        seen.append((name, len(hogs)))
        time.sleep(0.4)
        return {"loop_seconds": loops[name]}
    seen = []
    monkeypatch.setattr(bench, "run", fake_run)
    p = bench.probe_round(1, None, tmp_path, 1)
    assert [n for n, _ in seen] == ["probe-copy", "probe-write", "probe-alone"]  # rotated
    assert dict(seen) == {"probe-copy": 1, "probe-write": 1, "probe-alone": 0}
    for kind, added in (("copy", 0.06), ("write", 0.10)):
        assert 0.05 < p[f"{kind}_cpu_s"] <= loops[f"probe-{kind}"] * 1.2
        assert p[f"share_{kind}"] == pytest.approx(added / p[f"{kind}_cpu_s"])
    assert not list(tmp_path.glob("hog-*"))  # their files went with them


def test_the_loaded_floor_is_the_floor_s_work_measured_beside_a_run(bench, monkeypatch, tmp_path):
    """The loaded floor's hog (a real idle-priority process) does the floor's work (a copy, a
    CRC and a write + fsync of one checkpoint's bytes to a new file) only while the run without
    checkpoints goes on, counts the CPU of its completed passes from its set-up on, and leaves
    no file; the summary judges the jobs' CPU per GB against it too, where no core is free."""
    def fake_run(ranks, args, workdir, name, extra):  # the training runs take minutes
        seen.append((name, ranks))
        time.sleep(0.6)
        return {"loop_seconds": 0.6}
    seen = []
    monkeypatch.setattr(bench, "run", fake_run)
    f = bench.loaded_floor(2, 4 << 20, None, tmp_path)
    assert seen == [("floor-beside", 2)]
    assert f["hog_bytes"] >= 4 << 20 and f["hog_bytes"] % (4 << 20) == 0, f
    assert 0 < f["hog_cpu_s"] <= 0.6 * 1.5
    assert f["cpu_s_per_gb"] == pytest.approx(f["hog_cpu_s"] / (f["hog_bytes"] / 1e9))
    assert not list(tmp_path.iterdir())  # its files went with it
    monkeypatch.setattr(bench, "free_core", lambda ranks: ranks == 1)
    rows = [_row(0.014, [], ranks=2, kind="incrcp", jobs_cpu_per_gb=3.0,
                 jobs_cpu_per_gb_all=1.2), _row(0.014, [], ranks=1, kind="incrcp")]
    loaded = bench.loaded_floor_of([{"ranks": 2, "kind": "incrcp", "cpu_s_per_gb": v}
                                    for v in (0.9, 1.0, 2.0)])
    assert loaded == {(2, "incrcp"): 1.0}
    one, two = sorted(bench.summarize(rows, {"incrcp": 0.5}, None, loaded),
                      key=lambda s: s["ranks"])
    assert "loaded_floor_cpu_s_per_gb" not in one
    assert two["jobs_over_floor"] == pytest.approx(6.0) and two["jobs_met"] is False
    assert two["jobs_over_loaded"] == pytest.approx(3.0)
    assert two["jobs_all_over_loaded"] == pytest.approx(1.2) and two["jobs_all_met_loaded"]
