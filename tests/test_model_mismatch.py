"""A checkpoint of another model's shape is refused naming what differs (in-process)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mpickpt.checkpoint.load import check_compatible
from mpickpt.model.dense_state import dense_mismatch, load_dense_state_into
from mpickpt.store.errors import CheckpointError


def test_a_dense_mismatch_names_parameters_and_state():
    model = {"param/a.weight": torch.zeros(4, 3), "param/a.bias": torch.zeros(4),
             "opt/0/sum": torch.zeros(4, 3), "opt/0/step": torch.zeros(())}
    same = {k: np.zeros(tuple(v.shape), np.float32) for k, v in model.items()}
    assert dense_mismatch(model, same) is None
    wider = {**same, "param/a.weight": np.zeros((5, 3)), "param/b.bias": np.zeros(2)}
    assert dense_mismatch(model, wider) == ("a.weight saved 5x3, the model's 4x3; b.bias saved "
                                            "2, the model's nothing")
    del wider["param/a.bias"]
    assert dense_mismatch(model, wider).startswith("a.bias saved nothing, the model's 4; ")
    assert dense_mismatch(model, {**same, "opt/0/step": np.zeros(2)}) == \
        "optimizer state 0/step saved 2, the model's a scalar"
    assert dense_mismatch(model, {k: v for k, v in same.items() if k != "opt/0/sum"}) is None


def test_loading_dense_state_of_other_shapes_names_them_and_changes_nothing():
    layer = torch.nn.Linear(3, 4)
    before = layer.weight.detach().clone()
    arrays = {"param/weight": np.ones((5, 3), np.float32), "param/bias": np.ones(4, np.float32)}
    with pytest.raises(ValueError, match=r"^dense state of other shapes: weight saved 5x3, "
                                         r"the model's 4x3$"):
        load_dense_state_into(layer.named_parameters(), None, arrays)
    assert torch.equal(layer.weight, before)
    with pytest.raises(ValueError, match=r"bias saved nothing, the model's 4"):
        load_dense_state_into(layer.named_parameters(), None,
                              {"param/weight": arrays["param/bias"]})


def test_row_arrays_of_another_model_or_optimizer_are_named():
    manifest = SimpleNamespace(step=7, plan={"table_sizes": [10, 20]}, dim=4, optimizer="adagrad",
                               stats={"row_arrays": ["state/adagrad_sum", "weight"]})
    plan = SimpleNamespace(table_sizes=(10, 20))
    check_compatible(manifest, plan, 4, ["weight", "state/adagrad_sum"])
    with pytest.raises(CheckpointError, match=r"^checkpoint step 7 saved \['state/adagrad_sum', "
                                              r"'weight'\] per row \(optimizer adagrad\); this "
                                              r"model keeps \['state/momentum1', 'weight'\]: a "
                                              r"checkpoint of another --model or --optimizer$"):
        check_compatible(manifest, plan, 4, ["weight", "state/momentum1"])
