"""mpickpt as a library in a user's script (one rank, MPI as a singleton): the README's loop runs
and checkpoints; the same script without an `if __name__ == "__main__":` guard fails at once with
an error that names the guard, instead of training on with dead writers."""
import os
import subprocess
import sys
import textwrap

from mpickpt.store.manifest import list_manifests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BODY = """
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.manager import CheckpointManager
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.topology import Topology


def main(directory):
    topo = Topology.from_mpi()
    arch = DenseArch(num_dense=13, num_tables=2, dim=8, bottom=(13, 8), top=(8, 1))
    model = HybridDLRM(topo, arch, (300, 200), OptimizerConfig(kind="adagrad", lr=0.05), 0)
    ckpt = CheckpointManager(topo, CheckpointConfig(directory=directory, interval=1), model)
    ckpt.save(1, {"kind": "synthetic", "sample_index": 0})
    ckpt.close()
    print("saved")
"""


def _run(tmp_path, guarded: bool) -> subprocess.CompletedProcess:
    ckpt = str(tmp_path / "ckpt")
    tail = (f"\nif __name__ == '__main__':\n    main({ckpt!r})\n" if guarded
            else f"\nmain({ckpt!r})\n")
    script = tmp_path / "user_script.py"
    script.write_text(textwrap.dedent(BODY) + tail)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=tmp_path)


def test_a_guarded_script_checkpoints(tmp_path):
    proc = _run(tmp_path, guarded=True)
    assert proc.returncode == 0 and "saved" in proc.stdout, proc.stderr[-3000:]
    assert [m.step for m in list_manifests(str(tmp_path / "ckpt"))] == [1]


def test_a_script_without_the_main_guard_gets_an_error_naming_it(tmp_path):
    proc = _run(tmp_path, guarded=False)
    assert proc.returncode != 0, proc.stdout
    assert "WorkerStartError" in proc.stderr, proc.stderr[-3000:]
    assert "if __name__ == '__main__':" in proc.stderr and "user_script.py" in proc.stderr
    assert "saved" not in proc.stdout
    assert list_manifests(str(tmp_path / "ckpt")) == []
