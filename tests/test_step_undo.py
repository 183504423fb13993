"""StepUndo on one rank (a real 1-rank topology in a child process): a step that a death
interrupted after its backward is taken back whole, its dense gradients included, so doing the step
again gives exactly the state an uninterrupted step gives (a left-over `.grad` doubled the dense
gradient of the step done again: a wrong digest in in-place trials under load)."""
import subprocess
import sys
import textwrap

from tests.launch import REPO

SCRIPT = textwrap.dedent("""
    import torch

    from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
    from mpickpt.model.dense import DenseArch
    from mpickpt.model.hybrid import HybridDLRM
    from mpickpt.model.optimizers import OptimizerConfig
    from mpickpt.survivors.undo import StepUndo
    from mpickpt.topology import Topology

    SIZES, B = (300, 200, 50), 64
    topo = Topology.from_mpi()
    arch = DenseArch(num_dense=13, num_tables=3, dim=8, bottom=(13, 16, 8), top=(12, 6, 1))
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=3))

    def model():
        return HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.1), 3)

    def state(m):
        out = {k: v.clone() for k, v in m.dense_state().items()}
        out["rows"] = m.embeddings.weight.clone()
        return out

    clean, interrupted = model(), model()
    undo = StepUndo(interrupted)
    for step in range(3):
        clean.train_step(stream.batch(step * B, B))
        undo.begin(step + 1, {})
        interrupted.train_step(stream.batch(step * B, B))
        undo.complete()
    batch = stream.batch(3 * B, B)
    # step 4, interrupted after its backward and sparse update, before its dense update
    undo.begin(4, {})
    pooled, ctx = interrupted.embeddings.lookup(batch.sparse, update=True)
    leaf = pooled.detach().requires_grad_()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        interrupted.dense(batch.dense, leaf), batch.labels, reduction="sum")
    loss.backward()
    interrupted.embeddings.apply_gradients(leaf.grad, ctx)
    assert any(p.grad is not None for p in interrupted.dense.parameters())
    undo.undo_current()
    assert all(p.grad is None for p in interrupted.dense.parameters())
    undo.begin(4, {})
    interrupted.train_step(batch)
    undo.complete()
    clean.train_step(batch)
    a, b = state(clean), state(interrupted)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ
    print("same state")
""")


def test_a_step_done_again_after_an_interruption_equals_the_uninterrupted_step():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "same state" in proc.stdout, proc.stdout + proc.stderr
