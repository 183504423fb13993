"""The extractor times a restore of a checkpoint's increments (IncrCP's R_i) only when the chain's
rectangle has grown by the probe's factor since the last timing, scales that timing otherwise, and
times nothing when no cost model reads it (`--incrcp-reset never`)."""
import numpy as np
import pytest

from mpickpt.incrcp import extractor_process
from mpickpt.incrcp.extraction import Extractor
from mpickpt.incrcp.restore_probe import RestoreProbe
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.store.chunk_index import load_index
from tests.local_chain import LocalChain


def test_the_probe_times_on_growth_and_scales_between():
    probe, timings = RestoreProbe(1.25), iter([0.5, 0.8, 1.0, 0.1])
    got = [probe.restore_seconds("c", rows, lambda: next(timings))
           for rows in (100, 110, 124, 125, 150, 160)]
    assert got == [(0.5, True), (0.55, False), (pytest.approx(0.62), False), (0.8, True),
                   (pytest.approx(0.96), False), (1.0, True)]
    assert probe.restore_seconds("other", 10, lambda: next(timings)) == (0.1, True)  # new chain
    with pytest.raises(ValueError, match="growth must exceed 1"):
        RestoreProbe(1.0)


def _run_chain(tmp_path, ingest):
    """A 12-step never-reset incrcp chain whose increments go through `ingest(chain, step)`, as
    the extractor process gets them."""
    plan = ShardPlan.build((400, 300, 200), 2)
    chain = LocalChain(str(tmp_path), plan, dim=3, policy="incrcp", seed=2, incrcp_reset="never")
    chain._ingest = lambda step, save: ingest(chain, step, save.chain) or 0.0
    rng = np.random.default_rng(2)
    for step in range(1, 13):
        for r in range(plan.world_size):
            chain.touch(r, rng.integers(0, plan.local_rows(r), 25), rng)
        chain.save(step)
    return chain


@pytest.mark.parametrize("wanted", [True, False])
def test_the_extractor_times_a_growing_chain_only_on_growth(tmp_path, monkeypatch, wanted):
    timed, answers, rows_of = [], [], {}
    monkeypatch.setattr(extractor_process, "time_restore",
                        lambda root, index, step, names: timed.append(step) or 0.01 * step)
    state = {"extractor": Extractor(str(tmp_path)), "indexes": {}, "probe": RestoreProbe()}
    hold = 0 if wanted else 3 << 20  # each job carries --incrcp-hold to the extractor

    def ingest(chain, step, name):
        job = {"root": chain.root, "chain": name, "rank": 0, "step": step, "parts": 1,
               "row_names": ["state/sum", "weight"], "time_restore": wanted, "hold": hold}
        answers.append(extractor_process.run_ingest(job, state))
        rows_of[step] = sum(r.rows for r in load_index(chain.root, name, 0).rectangle(step))

    _run_chain(tmp_path, ingest)
    assert all(a["ok"] for a in answers) and len(answers) == 11, answers  # 1: the baseline
    assert state["extractor"].hold_bytes == hold
    assert (state["extractor"].held is None) == (hold == 0)
    if not wanted:
        assert timed == [] and all(a["restore_seconds"] is None for a in answers)
        return
    expected, last = [], None
    for a in answers:
        rows = rows_of[a["step"]]
        if last is None or rows >= 1.25 * last[0]:
            expected.append(a["step"])
            last = (rows, 0.01 * a["step"])
        else:
            assert a["restore_seconds"] == pytest.approx(last[1] * rows / last[0])
        assert a["restore_timed"] == (a["step"] == expected[-1])
    assert timed == expected and 1 < len(timed) < len(answers), (timed, rows_of)
