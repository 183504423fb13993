"""What an export says about the model it holds, so that it can be used without mpickpt's code.

`mpickpt.model.dense.DLRMDense` is DLRM's dense part: a bottom MLP on the dense features (ReLU
after every layer), the dot interaction of the bottom output with the pooled embeddings (the strict
lower triangle of their Gram matrix, row by row), the bottom output concatenated with those dots
into a top MLP (ReLU after every layer but the last) whose single output is a logit. Embedding
bags are pooled by sum. `describe` turns the architecture a manifest records (or, for checkpoints
written before manifests recorded it, what the dense parameters' shapes imply) into export
attributes. Pure Python and numpy: the CLI needs neither torch nor MPI. Local.
"""
from __future__ import annotations

import json

import numpy as np

SPEC_VERSION = 1

CRITEO = (13, 26)
"""(dense features, categorical features) of Criteo's click logs (I1..I13, C1..C26)."""


def inputs(num_dense: int, num_tables: int) -> dict:
    """The preprocessing of a model of `num_dense` dense features and `num_tables` tables, as the
    export's ``inputs`` attribute describes it; Criteo's column names when the model has
    Criteo's shape. Local."""
    if (num_dense, num_tables) == CRITEO:
        order = "dense features I1..I13 and tables C1..C26 in Criteo's column order"
    else:
        order = (f"dense features 0..{num_dense - 1} and tables 0..{num_tables - 1} in the order "
                 f"the data source gives them (mpickpt's synthetic data; Criteo's files have "
                 f"{CRITEO[0]} and {CRITEO[1]})")
    return {
        "dense": f"{num_dense} features per sample, each log(1 + max(x, 0)) of an integer "
                 f"feature x (missing: 0), Criteo's preprocessing; mpickpt's synthetic data is "
                 f"generated in that form",
        "sparse": f"{num_tables} categorical features; feature t selects row int(hex id, 16) mod "
                  f"table_sizes[t] of table t (missing: row 0); a bag of several rows is pooled "
                  f"by sum",
        "order": order,
    }


def architecture(params: dict[str, tuple], dim: int, num_tables: int,
                 recorded: dict | None = None) -> dict | None:
    """The dense architecture: `recorded` (a manifest's stats['model']) when present, else read
    off the shapes of the dense parameters (name without 'dense/' -> shape); None when they are
    not DLRM's (a model of a library user's own). Local."""
    if recorded:
        return dict(recorded)
    try:
        bottom = _widths(params, "bottom")
        top = _widths(params, "top")
    except ValueError:
        return None
    return {"num_dense": bottom[0], "num_tables": num_tables, "dim": dim, "bottom": bottom,
            "top": top[1:]}


def _widths(params: dict[str, tuple], mlp: str) -> list[int]:
    layers = sorted((int(name.split(".")[1]), shape) for name, shape in params.items()
                    if name.startswith(f"{mlp}.") and name.endswith(".weight"))
    if not layers:
        raise ValueError(f"the dense parameters have no {mlp} MLP ({mlp}.<k>.weight)")
    return [layers[0][1][1]] + [shape[0] for _, shape in layers]


def interaction_pairs(num_tables: int) -> np.ndarray:
    """(i, j) with i > j over z = [bottom output, table 0 .. table T-1], row by row: the order of
    the dots in the top MLP's input (torch.tril_indices(T+1, T+1, -1)). Local."""
    n = num_tables + 1
    return np.array([(i, j) for i in range(n) for j in range(i)], dtype=np.int64).reshape(-1, 2)


def layer_names(mlp: str, widths: list[int]) -> list[str]:
    """Parameter prefixes of an MLP's linear layers in order (nn.Sequential with a ReLU after
    each Linear but the last of the top MLP: indices 0, 2, 4, ...). Local."""
    return [f"{mlp}.{2 * k}" for k in range(len(widths) - 1)]


def describe(arch: dict | None) -> dict:
    """Export attributes for `arch` (num_dense, num_tables, dim, bottom with its input width, top
    without); for None, only that the dense part is not a known architecture. Local."""
    if arch is None:
        return {"model": "unknown: no architecture recorded and the dense parameters are not "
                         "DLRM's bottom.<k> / top.<k> layers", "model_spec_version": SPEC_VERSION}
    pairs = interaction_pairs(int(arch["num_tables"]))
    bottom = [int(w) for w in arch["bottom"]]
    top = [int(arch["dim"]) + len(pairs)] + [int(w) for w in arch["top"]]
    return {
        "model": "dlrm",
        "model_spec_version": SPEC_VERSION,
        "num_dense": int(arch["num_dense"]),
        "mlp_bottom": np.asarray(bottom, dtype=np.int64),
        "mlp_top": np.asarray(top, dtype=np.int64),
        "mlp_bottom_layers": json.dumps(layer_names("dense/bottom", bottom)),
        "mlp_top_layers": json.dumps(layer_names("dense/top", top)),
        "mlp_bottom_activation": "relu after every layer, the last included",
        "mlp_top_activation": "relu after every layer but the last",
        "linear": "y = x @ weight.T + bias (weight: out x in)",
        "pooling": "sum",
        "interaction": "dot",
        "interaction_input": "z = [bottom MLP output, pooled table 0, ..., pooled table T-1] "
                             "(T + 1 vectors of dim)",
        "interaction_pairs": pairs,
        "interaction_self": "no (the diagonal z_i . z_i is not used)",
        "top_input": "concat(bottom MLP output, z_i . z_j for (i, j) in interaction_pairs)",
        "output": "logit: click probability = sigmoid(output)",
        "inputs": json.dumps(inputs(int(arch["num_dense"]), int(arch["num_tables"])),
                             sort_keys=True),
    }
