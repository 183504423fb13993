"""mpickpt's dense optimizers against torch.optim: the same bytes after every step, the same
state names, and a state handed over either way continues identically."""
import pytest
import torch

from mpickpt.model.dense import DenseArch, DLRMDense
from mpickpt.model.dense_state import dense_state_of, load_dense_state_into
from mpickpt.model.optimizers import OptimizerConfig, make_dense_optimizer
from tests.reference_dlrm import torch_dense_optimizer

ARCH = DenseArch(num_dense=13, num_tables=3, dim=4, bottom=(13, 8, 4), top=(8, 1))


def _dense(seed=0):
    torch.manual_seed(seed)
    return DLRMDense(ARCH)


def _steps(model, opt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        dense = torch.randn(8, 13, generator=gen)
        pooled = torch.randn(8, 3, 4, generator=gen)
        labels = torch.randint(0, 2, (8,), generator=gen).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, pooled), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _bytes(model, opt):
    return {k: v.clone() for k, v in dense_state_of(model.named_parameters(), opt).items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


CONFIGS = [OptimizerConfig(kind="adagrad", lr=0.05), OptimizerConfig(kind="sgd", lr=0.1),
           OptimizerConfig(kind="momentum", lr=0.05, momentum=0.9)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.kind)
def test_every_step_is_bit_identical_to_torch_optim(config):
    ours_model, theirs_model = _dense(), _dense()
    ours = make_dense_optimizer(config, ours_model.parameters())
    theirs = torch_dense_optimizer(config, theirs_model.parameters())
    assert not isinstance(ours, torch.optim.Optimizer)
    _assert_same(_bytes(ours_model, ours), _bytes(theirs_model, theirs))  # eager Adagrad state
    for k in range(4):
        _steps(ours_model, ours, 3, seed=k)
        _steps(theirs_model, theirs, 3, seed=k)
        _assert_same(_bytes(ours_model, ours), _bytes(theirs_model, theirs))
    assert all(p.grad is None for p in ours_model.parameters())
    keys = {k.split("/")[-1] for k in _bytes(ours_model, ours) if k.startswith("opt/")}
    assert keys == {"adagrad": {"step", "sum"}, "sgd": set(),
                    "momentum": {"momentum_buffer"}}[config.kind]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.kind)
def test_state_moves_between_torch_optim_and_ours(config):
    """A checkpoint written by a run on torch.optim resumes on ours and the other way round."""
    src_model = _dense()
    src = torch_dense_optimizer(config, src_model.parameters())
    _steps(src_model, src, 5, seed=1)
    saved = _bytes(src_model, src)
    ours_model = _dense(seed=7)
    ours = make_dense_optimizer(config, ours_model.parameters())
    load_dense_state_into(ours_model.named_parameters(), ours, saved)
    _steps(src_model, src, 4, seed=2)
    _steps(ours_model, ours, 4, seed=2)
    _assert_same(_bytes(ours_model, ours), _bytes(src_model, src))
    back_model = _dense(seed=9)
    back = torch_dense_optimizer(config, back_model.parameters())
    load_dense_state_into(back_model.named_parameters(), back, _bytes(ours_model, ours))
    _steps(back_model, back, 2, seed=3)
    _steps(ours_model, ours, 2, seed=3)
    _assert_same(_bytes(ours_model, ours), _bytes(back_model, back))


def test_no_parameters_is_refused():
    with pytest.raises(ValueError, match="at least one parameter"):
        make_dense_optimizer(OptimizerConfig(), [])
