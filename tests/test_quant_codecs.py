"""Row codecs of issue 5 (partial): bit packing and uniform/adaptive quantization."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpickpt.quant import uniform as u
from mpickpt.quant.packing import WIDTHS, pack, packed_bytes, unpack


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(WIDTHS), n=st.integers(0, 7), dim=st.integers(1, 37), seed=st.integers(0, 9))
def test_packing_round_trips_every_width_and_dimension(bits, n, dim, seed):
    codes = np.random.default_rng(seed).integers(0, 1 << bits, (n, dim)).astype(np.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (n, -(-dim * bits // 8)) == (n, packed_bytes(dim, bits))
    assert np.array_equal(unpack(packed, bits, dim), codes)


def test_packing_refuses_bad_input():
    with pytest.raises(ValueError, match="bit width"):
        pack(np.zeros((1, 4), np.uint8), 5)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 4\)"):
        pack(np.full((1, 4), 4, np.uint8), 2)
    with pytest.raises(ValueError, match="expected 2"):
        unpack(np.zeros((1, 3), np.uint8), 4, 4)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), seed=st.integers(0, 2**31 - 1),
       scale=st.floats(1e-3, 1e3), dim=st.integers(1, 40))
def test_error_bounds_and_adaptive_never_worse(bits, seed, scale, dim):
    x = (np.random.default_rng(seed).standard_normal((64, dim)) * scale).astype(np.float32)
    asym = u.asymmetric(x, bits)
    err = np.abs(asym.dequantize() - x)
    step = asym.scale.astype(np.float32)
    levels = (1 << bits) - 1

    def fp16_slack(q):  # float16 rounding of the offset, and of the scale times the top code
        s, o = np.abs(q.scale.astype(np.float32)), np.abs(q.offset.astype(np.float32))
        return levels * np.maximum(s * 2**-11, 2**-25) + np.maximum(o * 2**-11, 2**-25)

    assert (err.max(axis=1) <= step / 2 + fp16_slack(asym) + 1e-7).all()
    base = np.einsum("ij,ij->i", asym.dequantize() - x, asym.dequantize() - x)
    if bits in (2, 3, 4):
        for codec in (u.greedy, u.refined):
            q = codec(x, bits)
            loss = np.einsum("ij,ij->i", q.dequantize() - x, q.dequantize() - x)
            assert (loss <= base * (1 + 1e-6) + 1e-12).all(), codec.__name__
    sym = u.symmetric(x, bits)
    assert (np.abs(sym.dequantize() - x).max(axis=1)
            <= sym.scale.astype(np.float32) / 2 + fp16_slack(sym) + 1e-7).all()


def test_refined_beats_greedy_on_random_rows():
    x = np.random.default_rng(1).standard_normal((4000, 64)).astype(np.float32)
    for bits in (2, 4):
        g, r = u.greedy(x, bits), u.refined(x, bits)
        lg = np.linalg.norm(g.dequantize() - x, axis=1).mean()
        lr = np.linalg.norm(r.dequantize() - x, axis=1).mean()
        la = np.linalg.norm(u.asymmetric(x, bits).dequantize() - x, axis=1).mean()
        assert lr <= lg < la
