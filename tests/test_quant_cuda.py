"""The CUDA range search (kernels/quant_rows.cu) against the compiled CPU kernel. Needs CuPy and a
CUDA GPU; skipped otherwise."""
import numpy as np
import pytest

from tests.gpu import cupy_with_gpu

cupy = cupy_with_gpu("the CUDA range search")

from mpickpt.quant import cuda_kernels, search as rs  # noqa: E402

if rs.c_kernel() is None:
    pytest.skip("the CPU kernel mpickpt._quant_cpu (the reference) is not built",
                allow_module_level=True)


def _rows(dim, n=20000, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32) * np.float32(0.05)
    x[:50] = 0.25  # constant rows
    x[50:60] = 0.0
    x[60:300] += 100.0  # rows far from zero
    x[300:400] *= 1e-4  # tiny ranges (float16 subnormal scales)
    x[400:500] = rng.integers(-2, 3, (100, dim)) * 0.125  # repeated values, ties in the codes
    return x


def _bits(a):
    return np.asarray(a, np.float16).view(np.uint16)


def _same(a, b):
    """Rows whose float16 (scale, offset) are identical, bit for bit."""
    return (_bits(a[0]) == _bits(b[0])) & (_bits(a[1]) == _bits(b[1]))


@pytest.mark.parametrize("dim", [64, 37])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("search", ["greedy", "refined"])
def test_cuda_search_matches_the_cpu_kernel(dim, bits, search):
    x = _rows(dim)
    cpu = rs.search(x, bits, search, backend="c")
    gpu = cuda_kernels.search_rows_cuda(x, bits, search)
    assert gpu[0].dtype == gpu[1].dtype == np.float16 and gpu[0].shape == (len(x),)
    same = _same(cpu, gpu)
    assert same.mean() >= 0.999, \
        f"{(~same).sum()} of {len(x)} rows differ, first {np.nonzero(~same)[0][:5]}"
    lc, lg = rs.row_loss(x, *cpu, bits), rs.row_loss(x, *gpu, bits)
    worse = lg > lc * (1 + 1e-4) + 1e-9
    assert not worse.any(), \
        f"{worse.sum()} rows lose more on the GPU, first {np.nonzero(worse)[0][:5]}"


@pytest.mark.parametrize("dim", [1, 5, 8, 9, 512])
def test_cuda_search_matches_on_short_and_wide_rows(dim):
    # no full lane block (1, 5), no tail (8), one of each (9), many lane blocks (512)
    x = _rows(dim, n=3000, seed=dim)
    for bits, search, bins, ratio in [(4, "refined", None, None), (2, "greedy", None, None),
                                      (8, "refined", 45, 0.2), (3, "refined", 7, 1.0)]:
        cpu = rs.search(x, bits, search, bins, ratio, backend="c")
        gpu = cuda_kernels.search_rows_cuda(x, bits, search, bins, ratio)
        same = _same(cpu, gpu)
        assert same.mean() >= 0.999, (bits, search, f"{(~same).sum()} rows differ")


def test_cupy_inputs_conversions_and_empty():
    x = _rows(64, n=5000)
    want = cuda_kernels.search_rows_cuda(x, 4)
    assert _same(cuda_kernels.search_rows_cuda(cupy.asarray(x), 4), want).all()
    # float64 and non-contiguous inputs are converted to contiguous float32 first
    wide = np.zeros((5000, 128), np.float64)
    wide[:, ::2] = x
    assert _same(cuda_kernels.search_rows_cuda(cupy.asarray(wide)[:, ::2], 4), want).all()
    for empty in (np.zeros((0, 8), np.float32), cupy.zeros((0, 8), cupy.float32)):
        s, o = cuda_kernels.search_rows_cuda(empty, 4)
        assert s.shape == o.shape == (0,) and s.dtype == np.float16
    with pytest.raises(ValueError, match="2-D"):
        cuda_kernels.search_rows_cuda(np.zeros(8, np.float32), 4)
    with pytest.raises(ValueError, match="range search"):
        cuda_kernels.search_rows_cuda(x, 4, "nope")


def test_torch_cuda_tensors_are_searched_in_place():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA build of torch")
    x = _rows(37, n=5000)
    want = cuda_kernels.search_rows_cuda(x, 3, "greedy")
    assert _same(want, rs.search(x, 3, "greedy", backend="c")).mean() >= 0.999
    on_gpu = torch.from_numpy(x).cuda().requires_grad_()
    assert _same(cuda_kernels.search_rows_cuda(on_gpu, 3, "greedy"), want).all()
    # produced on a side stream: the search runs on that stream, after the producer
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        produced = torch.from_numpy(x).cuda(non_blocking=True) * 1.0
        got = cuda_kernels.search_rows_cuda(produced, 3, "greedy")
    assert _same(got, want).all()
    # a CPU tensor is searched from host memory
    assert _same(cuda_kernels.search_rows_cuda(torch.from_numpy(x), 3, "greedy"), want).all()
