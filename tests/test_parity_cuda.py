"""The CUDA parity fold (kernels/parity_fold.cu) against the CPU path. Needs CuPy and a CUDA GPU;
skipped otherwise."""
import numpy as np
import pytest
import torch

from tests.gpu import cupy_with_gpu

cupy = cupy_with_gpu("the CUDA parity fold")

from mpickpt.parity import cuda_kernels  # noqa: E402
from mpickpt.parity.stripe_code import StripeCode  # noqa: E402


@pytest.mark.parametrize("words", [1, 17, 65])
def test_cuda_fold_matches_the_cpu_fold(words):
    rng = np.random.default_rng(words)
    code = StripeCode(4, 3, "cpu")
    parity = torch.from_numpy(rng.integers(-2**31, 2**31, (500, words)).astype(np.int32))
    n = 3000
    prow = torch.from_numpy(rng.integers(0, 500, n))  # repeats: several members per stripe
    coef = torch.from_numpy(code.matrix.reshape(-1)[rng.integers(0, code.matrix.size, n)])
    delta = torch.from_numpy(rng.integers(-2**31, 2**31, (n, words)).astype(np.int32))
    want = parity.clone()
    for i in range(n):  # one row at a time: repeated rows fold in sequence on the CPU
        code.fold(want, prow[i:i + 1], coef[i:i + 1], delta[i:i + 1])
    got = cupy.asarray(parity.numpy())
    cuda_kernels.fold_cuda(got, cupy.asarray(prow.numpy()), cupy.asarray(coef.numpy()),
                           cupy.asarray(delta.numpy()))
    assert np.array_equal(cupy.asnumpy(got), want.numpy())
