"""Loading TorchRec: the pinned pair loads; another version or a missing one is a clear error
naming what was found and the install command (issue 22, point 5)."""
import pytest

from mpickpt.model.torchrec_support import (TorchRecUnavailable, check_versions,
                                            installed_version, load_torchrec)


@pytest.mark.parametrize("versions,found", [
    ({"torchrec": "1.9.0", "fbgemm-gpu": "1.8.0"}, r"torchrec 1.9.0 \(expected 1.8.x\)"),
    ({"torchrec": "1.8.0", "fbgemm-gpu": None}, r"fbgemm-gpu not installed \(expected 1.8.x\)"),
])
def test_versions_outside_the_pin_are_refused_with_the_install_command(versions, found):
    with pytest.raises(TorchRecUnavailable, match=found + r".*pip install --no-deps -r "
                                                          r"requirements-torchrec.txt"):
        check_versions(versions)


def test_the_pinned_pair_loads():
    if installed_version("torchrec") is None:
        pytest.skip("torchrec is not installed (.ci/run installs it)")
    torchrec = load_torchrec()
    assert installed_version("torchrec").startswith("1.8.")
    assert hasattr(torchrec, "EmbeddingBagCollection")


@pytest.mark.parametrize("argv,message", [
    (["--optimizer", "momentum"], r"--model torchrec trains its rows with fbgemm's fused "
                                  r"optimizers: --optimizer must be one of adagrad, sgd, got "
                                  r"'momentum'"),
    (["--arch-embedding-size", "10"], None),
])
def test_the_trainer_refuses_what_the_torchrec_model_cannot_take(argv, message):
    """Before any MPI work: the flags (momentum), then the world (one table on two ranks)."""
    from mpickpt.train_flags import TrainConfig

    if message:
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_args(["--model", "torchrec", *argv])
        return
    config = TrainConfig.from_args(["--model", "torchrec", *argv])
    with pytest.raises(ValueError, match=r"--torchrec-sharding table_wise leaves ranks without "
                                         r"a table: 1 tables on 2 ranks; use row_wise"):
        config.check_world(2)
    config.check_world(1)


def test_table_wise_placement_balances_rows_largest_first():
    from mpickpt.model.torchrec_dlrm import table_wise_ranks

    assert table_wise_ranks([300, 200, 100, 50], 2) == [0, 1, 1, 0]
    assert table_wise_ranks([5, 5, 5], 3) == [0, 1, 2]


def test_replace_references_reaches_attributes_lists_and_dicts():
    """What `TorchRecModel.regroup` uses to point a DMP at a new generation's group."""
    import torch

    from mpickpt.model.torchrec import replace_references

    old, new = object(), object()
    inner = torch.nn.Module()
    inner._pg = old
    outer = torch.nn.Sequential(inner)
    outer.envs = [{"pg": old, "other": 1}]
    outer.shared = inner  # reached twice, replaced once
    assert replace_references(outer, old, new) == 2
    assert inner._pg is new and outer.envs[0]["pg"] is new and outer.envs[0]["other"] == 1


def test_dcp_flags_are_refused_without_torchrec_or_a_dcp_directory(tmp_path):
    from mpickpt.train_flags import TrainConfig

    with pytest.raises(ValueError, match=r"--export-dcp needs --model torchrec \(a DMP's state "
                                         r"dict\), got --model dlrm"):
        TrainConfig.from_args(["--export-dcp", str(tmp_path)])
    with pytest.raises(ValueError, match=rf"--import-dcp {tmp_path}: not a DCP checkpoint "
                                         rf"directory \(no .metadata file\)"):
        TrainConfig.from_args(["--model", "torchrec", "--import-dcp", str(tmp_path)])
