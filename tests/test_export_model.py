"""A self-describing export: a DLRM written here in numpy from nothing but the export's attributes
and datasets reproduces `HybridDLRM.predict` of the trained model on the same inputs (bags of two
rows, so sum pooling is exercised)."""
import json
import os
import subprocess
import sys
import textwrap

import h5py
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys

import numpy as np
import torch

from mpickpt.data.synthetic import SyntheticConfig, SyntheticStream
from mpickpt.engine.config import CheckpointConfig
from mpickpt.engine.manager import CheckpointManager
from mpickpt.model.dense import DenseArch
from mpickpt.model.hybrid import HybridDLRM
from mpickpt.model.optimizers import OptimizerConfig
from mpickpt.topology import Topology

SIZES, B = (300, 200, 50), 64


def main(directory, out):
    topo = Topology.from_mpi()
    arch = DenseArch(num_dense=13, num_tables=3, dim=8, bottom=(13, 16, 8), top=(12, 6, 1))
    model = HybridDLRM(topo, arch, SIZES, OptimizerConfig(kind="adagrad", lr=0.1), 3)
    stream = SyntheticStream(SyntheticConfig(table_sizes=SIZES, pooling=2, seed=3))
    for step in range(6):
        model.train_step(stream.batch(step * B, B))
    ckpt = CheckpointManager(topo, CheckpointConfig(directory=directory, interval=1), model)
    ckpt.save(6, {"kind": "synthetic", "sample_index": 6 * B})
    ckpt.close()
    batch = stream.batch(10_000, B)
    pred = model.predict(batch).numpy()
    np.savez(out, dense=batch.dense.numpy(), sparse=batch.sparse.numpy(), pred=pred)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
"""

RELU_AFTER = {"relu after every layer, the last included": True,
              "relu after every layer but the last": False}


def numpy_dlrm(path: str, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """Click probabilities computed from the export alone."""
    with h5py.File(path, "r") as f:
        a = f.attrs
        assert a["model"] == "dlrm" and a["pooling"] == "sum" and a["interaction"] == "dot"
        assert str(a["output"]).startswith("logit")
        tables = [f[f"embeddings/table_{t}"][()] for t in range(len(a["table_sizes"]))]
        pooled = [tables[t][sparse[:, t, :]].sum(axis=1) for t in range(len(tables))]

        def mlp(x, layers, relu_last):
            for k, name in enumerate(layers):
                x = x @ f[f"{name}.weight"][()].T + f[f"{name}.bias"][()]
                if k < len(layers) - 1 or relu_last:
                    x = np.maximum(x, 0.0)
            return x

        x = mlp(dense.astype(np.float64), json.loads(a["mlp_bottom_layers"]),
                RELU_AFTER[a["mlp_bottom_activation"]])
        z = np.stack([x, *pooled], axis=1)
        dots = np.stack([(z[:, i] * z[:, j]).sum(axis=1) for i, j in a["interaction_pairs"]], 1)
        top_in = np.concatenate([x, dots], axis=1)
        assert top_in.shape[1] == a["mlp_top"][0]
        logit = mlp(top_in, json.loads(a["mlp_top_layers"]), RELU_AFTER[a["mlp_top_activation"]])
    return 1.0 / (1.0 + np.exp(-logit[:, 0]))


def test_export_rebuilds_the_model_from_its_attributes(tmp_path):
    script = tmp_path / "train_and_predict.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    ckpt, out = tmp_path / "ckpt", tmp_path / "pred.npz"
    proc = subprocess.run([sys.executable, str(script), str(ckpt), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = tmp_path / "model.h5"
    proc = subprocess.run([sys.executable, "-m", "mpickpt.cli", "export", str(ckpt), "-o",
                           str(export)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = np.load(out)
    mine = numpy_dlrm(str(export), got["dense"], got["sparse"])
    assert got["sparse"].shape[2] == 2  # bags of two rows
    np.testing.assert_allclose(mine, got["pred"], rtol=1e-5, atol=1e-6)
    assert np.ptp(got["pred"]) > 1e-3  # not a constant prediction
    with h5py.File(export, "r") as f:
        assert f.attrs["format"] == "mpickpt-export-2"
        assert list(f.attrs["mlp_bottom"]) == [13, 16, 8] and list(f.attrs["mlp_top"]) == [14, 12, 6, 1]
        described = json.loads(f.attrs["inputs"])
        assert "log(1 + max(x, 0))" in described["dense"]
        # the model's own counts (13 dense features, 3 tables), not Criteo's 26
        assert described["dense"].startswith("13 features per sample")
        assert described["sparse"].startswith("3 categorical features")
        assert "tables 0..2" in described["order"] and "C1..C26" not in described["order"]


def test_inputs_follow_the_model_shape():
    from mpickpt.checkpoint.model_spec import describe

    def inputs(num_dense, num_tables):
        arch = {"num_dense": num_dense, "num_tables": num_tables, "dim": 4,
                "bottom": [num_dense, 4], "top": [1]}
        return json.loads(describe(arch)["inputs"])

    criteo = inputs(13, 26)
    assert criteo["dense"].startswith("13 features") and criteo["sparse"].startswith("26 ")
    assert "I1..I13" in criteo["order"] and "C1..C26" in criteo["order"]
    small = inputs(5, 2)
    assert small["dense"].startswith("5 features") and small["sparse"].startswith("2 ")
    assert "dense features 0..4 and tables 0..1" in small["order"]
