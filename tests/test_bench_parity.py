"""bench/parity.py's rebuild figures on a hand-made log (the benchmark itself takes minutes):
the window ends with the step the rebuild's line names, not where the line arrived (a step
later: its report is reduced beside training), and the wall time is the line's."""
from types import SimpleNamespace

import pytest

from tests.bench_module import load_bench

LINE = ("parity: rebuilt ranks [1] (283334 units, 2276 rows by degraded reads, 55.7 MB received, "
        "459 MB/s) in 2 rounds reading the group's memory, 0.121 s while training went on, "
        "whole from step 12 on (0.03 s of round work, slowest rank)")


def test_the_window_ends_with_the_step_the_line_names():
    parity = load_bench("parity")
    step = lambda s, t: (t, f"step {s}/20  loss 0.5  50,000 samples/s")  # noqa: E731
    lines = [step(s, 0.1 * s) for s in range(1, 11)]
    lines.append((1.0, "parity: ranks [1] lost their shards after step 10; rebuilding ..."))
    lines += [step(11, 1.13), step(12, 1.24), (1.245, LINE), step(13, 1.34), step(14, 1.44)]
    got = parity.rebuild_figures({"lines": lines}, 0.1, SimpleNamespace())
    assert got["wall_s"] == pytest.approx(0.121) and got["steps"] == 2 and got["rounds"] == 2
    assert got["lost_s"] == pytest.approx(0.04)  # steps 11 and 12: 0.24 s for 2 of 0.1 s
    assert got["throughput_ratio"] == pytest.approx(0.2 / 0.24) and got["memory"]


def test_rebuild_loss_takes_one_sample_per_failure(capsys):
    """bench/rebuild_loss.py: each failure's window runs from its step to the one its rebuild's
    line names, against the median of the steps before it; a missing rebuild line is an error."""
    bench = load_bench("rebuild_loss")
    a = bench.parse_args(["--variant", "x=", "--fail-steps", "20,30", "--steps", "40"])
    times, t = {}, 0.0
    for s in range(1, 41):
        t += 0.13 if s in (21, 22) else 0.12 if s == 31 else 0.1
        times[s] = t
    lines = [(times[s], f"step {s}/40  loss 0.5  50,000 samples/s") for s in range(1, 41)]
    lines.append((times[22] + 0.001, LINE.replace("step 12", "step 22")))
    lines.append((times[31] + 0.001, LINE.replace("step 12", "step 31")))
    first, second = bench.failures(a, sorted(lines))
    assert (first["steps"], second["steps"]) == (2, 1)
    assert first["lost_s"] == pytest.approx(0.06) and second["lost_s"] == pytest.approx(0.02)
    assert first["throughput"] == pytest.approx(0.2 / 0.26)
    with pytest.raises(SystemExit, match="2 failures, 1 rebuilds"):
        bench.failures(a, sorted(lines[:-1]))
    with pytest.raises(SystemExit):  # argparse's error: status 2, the reason on stderr
        bench.parse_args(["--variant", "x=", "--fail-steps", "10", "--steps", "40"])
    assert "--fail-steps must lie in (14, 37), got 10" in capsys.readouterr().err
