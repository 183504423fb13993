"""Parity codes and layout: exact encode/decode for r = 1 (XOR) and r >= 2 (Reed-Solomon over
GF(2^8)) under random erasures, difference folding, and the rotating placement's bookkeeping."""
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mpickpt.parity import gf256
from mpickpt.parity.layout import GroupLayout, check_parity_shape, group_layouts
from mpickpt.parity.stripe_code import StripeCode


def _units(rng, k, n, w):
    return [torch.from_numpy(rng.integers(-2**31, 2**31, (n, w), dtype=np.int64)
                             .astype(np.int32)) for _ in range(k)]


def test_field_tables():
    for a in range(1, 256):
        assert gf256.mul(a, gf256.inv(a)) == 1
    # distributive over XOR on random triples
    rng = np.random.default_rng(0)
    a, b, c = rng.integers(0, 256, (3, 1000))
    assert (gf256.MUL[a, b ^ c] == gf256.MUL[a, b] ^ gf256.MUL[a, c]).all()
    m = rng.integers(0, 256, (4, 4)).astype(np.uint8)
    try:
        mi = gf256.mat_inv(m)
    except ValueError:
        return
    prod = np.zeros((4, 4), np.uint8)
    for i, j, t in itertools.product(range(4), range(4), range(4)):
        prod[i, j] ^= gf256.MUL[m[i, t], mi[t, j]]
    assert (prod == np.eye(4, dtype=np.uint8)).all()


@pytest.mark.parametrize("k,r", [(1, 1), (3, 1), (4, 2), (5, 3), (10, 4)])
def test_code_is_mds_and_r1_is_xor(k, r):
    c = gf256.cauchy(r, k)
    assert (c[0] == 1).all() and (c[:, 0] == 1).all()
    full = np.concatenate([np.eye(k, dtype=np.uint8), c])
    for rows in itertools.islice(itertools.combinations(range(k + r), k), 300):
        gf256.mat_inv(full[list(rows)])  # raises if singular


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 8), r=st.integers(1, 3), n=st.integers(1, 20), w=st.integers(1, 9),
       seed=st.integers(0, 2**32 - 1), data=st.data())
def test_decode_recovers_any_r_erasures_exactly(k, r, n, w, seed, data):
    rng = np.random.default_rng(seed)
    code = StripeCode(k, r, "cpu")
    units = _units(rng, k, n, w)
    parity = {q: code.encode(q, units) for q in range(r)}
    # erase up to r of the k + r units: data and parity alike
    lost = data.draw(st.lists(st.integers(0, k + r - 1), min_size=1, max_size=r, unique=True))
    erased = [u for u in lost if u < k]
    alive_parity = {q: p for q, p in parity.items() if k + q not in lost}
    got = code.decode({j: d for j, d in enumerate(units) if j not in erased}, alive_parity, erased)
    for j in erased:
        assert torch.equal(got[j], units[j])
    full = [got.get(j, units[j]) for j in range(k)]
    for q in range(r):  # lost parity is re-encoded from the recovered data
        assert torch.equal(code.encode(q, full), parity[q])


def test_r1_parity_is_the_xor_and_nan_patterns_survive():
    rng = np.random.default_rng(1)
    units = _units(rng, 3, 50, 5)
    units[1][0] = torch.tensor(np.array([np.nan, -0.0, np.inf, 1e-45, -np.nan], np.float32)
                               .view(np.int32))
    code = StripeCode(3, 1, "cpu")
    p = code.encode(0, units)
    assert torch.equal(p, units[0] ^ units[1] ^ units[2])
    back = code.decode({0: units[0], 2: units[2]}, {0: p}, [1])[1]
    assert torch.equal(back, units[1])  # bit patterns, not float values: NaN payloads included
    # the rebuild's one-pass form: any one lost unit, data or parity, is the XOR of the others
    assert torch.equal(code.recover_one([units[0], p, units[2]]), units[1])
    assert torch.equal(code.recover_one(units), p)
    with pytest.raises(ValueError, match="needs r = 1"):
        StripeCode(3, 2, "cpu").recover_one(units)


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 6), r=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_folding_differences_equals_reencoding(k, r, seed):
    rng = np.random.default_rng(seed)
    code = StripeCode(k, r, "cpu")
    units = _units(rng, k, 30, 4)
    parity = {q: code.encode(q, units) for q in range(r)}
    for _ in range(5):  # several updates of random rows of random members
        j = int(rng.integers(k))
        rows = torch.as_tensor(np.unique(rng.integers(0, 30, 7)))
        new = units[j].clone()
        new[rows] = torch.from_numpy(rng.integers(-2**31, 2**31, (len(rows), 4))
                                     .astype(np.int32))
        for q in range(r):
            code.fold(parity[q], rows, int(code.matrix[q, j]), units[j][rows] ^ new[rows])
        units[j] = new
    for q in range(r):
        assert torch.equal(parity[q], code.encode(q, units))


@pytest.mark.parametrize("path", ["compiled", "torch"])
@settings(max_examples=30, deadline=None)
@given(k=st.integers(2, 6), r=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_one_fold_of_several_members_with_repeated_rows(path, k, r, seed):
    """Deltas of several members for the same stripes, folded in ONE call (rows repeat): equal to
    re-encoding, on the compiled CPU kernel and on the torch fallback."""
    from mpickpt.parity import stripe_code

    if path == "compiled" and stripe_code._cpu_fold() is None:
        pytest.skip("mpickpt._parity_cpu was not built")
    saved = stripe_code._CPU_FOLD
    stripe_code._CPU_FOLD = None if path == "torch" else saved
    try:
        rng = np.random.default_rng(seed)
        code = StripeCode(k, r, "cpu")
        units = _units(rng, k, 25, 5)
        for q in range(r):
            parity = code.encode(q, units)
            prows, coefs, deltas, new = [], [], [], [u.clone() for u in units]
            for j in range(k):
                rows = np.unique(rng.integers(0, 25, 9))
                new[j][rows] = torch.from_numpy(rng.integers(-2**31, 2**31, (len(rows), 5))
                                                .astype(np.int32))
                prows.append(rows)
                coefs.append(np.full(len(rows), code.matrix[q, j], dtype=np.uint8))
                deltas.append(units[j][rows] ^ new[j][rows])
            code.fold(parity, torch.as_tensor(np.concatenate(prows)),
                      torch.as_tensor(np.concatenate(coefs)), torch.cat(deltas))
            assert torch.equal(parity, code.encode(q, new))
    finally:
        stripe_code._CPU_FOLD = saved


def test_compiled_fold_refuses_rows_outside_the_store():
    from mpickpt.parity import stripe_code

    fold = stripe_code._cpu_fold()
    if fold is None:
        pytest.skip("mpickpt._parity_cpu was not built")
    parity = np.zeros((4, 3), dtype=np.int32)
    with pytest.raises(IndexError, match="parity row 4 of delta 1"):
        fold(parity, 3, np.array([0, 4], dtype=np.int64), np.ones(2, np.uint8),
             np.ones((2, 3), np.int32), gf256.MUL.astype(np.uint8))
    with pytest.raises(ValueError, match="inconsistent buffers"):
        fold(parity, 3, np.array([0], dtype=np.int64), np.ones(2, np.uint8),
             np.ones((1, 3), np.int32), gf256.MUL.astype(np.uint8))


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 6), r=st.integers(1, 3), data=st.data())
def test_layout_maps_every_unit_once_and_spreads_parity(k, r, data):
    rows = tuple(data.draw(st.lists(st.integers(0, 60), min_size=k + r, max_size=k + r)))
    L = GroupLayout(k, r, 0, rows)
    owners = {}
    for p in range(L.g):
        local = np.arange(rows[p])
        s = L.stripe_of_row(p, local)
        assert (L.row_of_stripe(p, s) == local).all()
        assert (L.role(p, s) == -1).all()
        slots = L.slot_table[p]  # row i is the unit at offset o of its period where slot o is i % k
        assert [slots[o] for o in (s % L.g).tolist()] == (local % k).tolist()
        assert sorted(slots).count(-1) == r
        j = L.data_index(p, local)
        for stripe, jj in zip(s.tolist(), j.tolist()):
            assert (stripe, jj) not in owners
            owners[(stripe, jj)] = p
            assert L.data_positions(stripe % L.g)[jj] == p
        prow = np.arange(L.parity_rows)
        ps = L.stripe_of_parity(p, prow)
        assert (L.parity_row(p, ps) == prow).all()
        assert all(p in L.parity_positions(o).tolist() for o in (ps % L.g).tolist())
    # every member holds the same number of parity rows: about r / k of the largest shard
    if max(rows):
        assert L.parity_rows == -(-max(rows) // k) * r


def test_bad_group_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        check_parity_shape(3, 1, 6)
    with pytest.raises(ValueError, match=">= 1"):
        check_parity_shape(0, 1, 4)
    assert [g.base for g in group_layouts(1, 1, [5, 6, 7, 8])] == [0, 2]


@pytest.mark.parametrize("k,r,rows", [(3, 1, (50, 41, 50, 7)), (2, 2, (9, 30, 30, 1))])
def test_own_stripes_are_every_stripe_a_member_holds_a_unit_of(k, r, rows):
    """`ParityStore.own_stripes` (made once, at encode: what a rebuild of this member decodes)
    is exactly the stripes where it holds a data row or a parity row, read-only."""
    from types import SimpleNamespace

    from mpickpt.parity.upkeep import ParityStore

    L = GroupLayout(k, r, 0, rows)
    for p in range(L.g):
        store = SimpleNamespace(layout=L, pos=p, _own=None)
        own = ParityStore.own_stripes(store)
        every = np.arange(L.stripes)
        holds = (L.row_of_stripe(p, every) >= 0) | (L.parity_row(p, every) >= 0)
        assert own.dtype == bool and np.array_equal(own, holds), p
        assert ParityStore.own_stripes(store) is own and not own.flags.writeable
