"""`mpickpt inspect`'s staleness of a checkpoint's rows (checkpoint/describe.py `staleness`) on a
real prioritized checkpoint directory: per checkpoint, the min / median / max step at which its
rows were last written, how many are as of its own step, equal to what was written."""
import numpy as np

from mpickpt.checkpoint.describe import describe, format_text, staleness
from mpickpt.model.shard_plan import ShardPlan
from mpickpt.store.manifest import list_manifests
from tests.local_chain import LocalChain

PLAN = ShardPlan.build((300, 200, 150, 40), 2)


def test_staleness_of_a_prioritized_chain_is_what_each_save_wrote(tmp_path):
    root = str(tmp_path)
    chain = LocalChain(root, PLAN, dim=3, policy="full", seed=5, priority="mfu",
                       save_fraction=0.2)
    rng = np.random.default_rng(5)
    written = np.full(int(sum(PLAN.table_sizes)), -1)  # per global row: the step it was written
    expected = {}
    for step in range(1, 7):
        for r in range(PLAN.world_size):  # a narrow hot set per step: saves keep up with part
            chain.touch(r, rng.integers(0, PLAN.local_rows(r), 40 * step), rng)
        chain.save(step)
        for state, save in zip(chain.ranks, chain.last_plans):
            rows = slice(None) if save.rows is None else save.rows
            written[state.gids[rows]] = step
        assert (written >= 0).all()
        expected[step] = {"min": int(written.min()), "median": int(np.median(written)),
                          "max": int(written.max()), "current": int((written == step).sum()),
                          "rows": len(written)}
    manifests = list_manifests(root)
    assert [m.kind for m in manifests] == ["full"] + ["priority"] * 5
    for m in manifests:
        got = staleness(root, m)
        assert got == {"exact": False, **expected[m.step]} if m.kind == "priority" else \
            got == {"exact": True, **expected[m.step]}, (m.step, got)
    last = expected[6]
    assert last["min"] < last["median"] < last["max"] == 6  # the test means something
    text = "\n".join(format_text(describe(root, manifests[-1])))
    assert (f"rows as of   step min {last['min']} / median {last['median']} / max 6; "
            f"{last['current']} of {last['rows']} rows written at step 6") in text, text
