"""The recompute-heavy micro-chunk backward (lightning_edu.numpy_la3) against Algorithm 2, on odd shapes.

Algorithm 2 (numpy_blockwise.algorithm2, itself checked against autograd in tests/test_backward.py) is the
reference for the whole backward; the intra-chunk helpers are checked against a dense C x C masked product
written out here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_edu import numpy_la3 as la3
from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_backward

TOL = 1e-12
NAMES = ("dq", "dk", "dv", "d_initial_state")
DECAY = np.array([1.0, 1e-3, 0.9, 0.999])


def inputs(batch, heads, n, d_k, d_v, seed=0):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, batch, heads, n, d_k))
    v, do = rng.standard_normal((2, batch, heads, n, d_v))
    s0, dsn = rng.standard_normal((2, batch, heads, d_k, d_v))
    return q, k, v, do, s0, dsn


def assert_matches_algorithm2(q, k, v, do, decay, chunk, micro, s0=None, dsn=None, block=None):
    got = la3.la3_backward(q, k, v, do, decay, chunk, micro, initial_state=s0, d_final_state=dsn)
    want = blockwise_backward(q, k, v, do, decay, block or chunk, initial_state=s0, d_final_state=dsn)
    for name, mine, ref in zip(NAMES, got, want):
        assert np.all(np.isfinite(mine)), name
        assert relative_error(mine, ref) <= TOL, f"{name}: relative error {relative_error(mine, ref):.2e}"


# n, chunk size C, micro size c: n a multiple of neither, c not always dividing C, c = C, n = 1.
SHAPES = [(37, 32, 16), (130, 64, 8), (201, 32, 5), (201, 64, 24), (1, 64, 16), (130, 32, 32), (37, 1, 1)]


@pytest.mark.parametrize("states", [False, True], ids=["zero-states", "with-states"])
@pytest.mark.parametrize("n, chunk, micro", SHAPES, ids=lambda x: str(x))
def test_equals_algorithm2_on_odd_shapes(n, chunk, micro, states):
    q, k, v, do, s0, dsn = inputs(2, 4, n, 16, 24)
    if not states:
        s0 = dsn = None
    assert_matches_algorithm2(q, k, v, do, DECAY, chunk, micro, s0, dsn)
    # The reference's block size plays no part: the same answer with Algorithm 2 on other blocks.
    assert_matches_algorithm2(q, k, v, do, DECAY, chunk, micro, s0, dsn, block=17)


def test_only_the_initial_state_or_only_its_gradient():
    q, k, v, do, s0, dsn = inputs(1, 4, 50, 8, 8, seed=1)
    assert_matches_algorithm2(q, k, v, do, DECAY, 16, 5, s0=s0)
    assert_matches_algorithm2(q, k, v, do, DECAY, 16, 5, dsn=dsn)


def test_defaults_are_chunk_64_micro_16():
    q, k, v, do, s0, dsn = inputs(1, 4, 150, 8, 8, seed=2)
    got = la3.la3_backward(q, k, v, do, DECAY, initial_state=s0, d_final_state=dsn)
    want = la3.la3_backward(q, k, v, do, DECAY, la3.DEFAULT_CHUNK, la3.DEFAULT_MICRO, s0, dsn)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    # A chunk smaller than DEFAULT_MICRO, with no micro size given, is one tile per chunk.
    assert_matches_algorithm2(q, k, v, do, DECAY, 8, None, s0, dsn)


@pytest.mark.parametrize("decay", [0.9999, 0.5])
def test_a_long_sequence(decay):
    q, k, v, do, s0, dsn = inputs(1, 2, 2000, 16, 24, seed=3)
    assert_matches_algorithm2(q, k, v, do, decay, 64, 16, s0, dsn)


@pytest.mark.parametrize("micro", [64, 48, 128, 256])
def test_small_decay_and_large_chunks_do_not_overflow(micro):
    # A tile factor split as lambda^(r+1) * lambda^(-s-1) needs lambda^-c: 1e384 for lambda = 1e-3 and c = 128,
    # 20^256 = 1e333 for lambda = 0.05 and c = 256, past float64; inf times an underflowed zero gives NaN.
    q, k, v, do, s0, dsn = inputs(1, 2, 600, 8, 8, seed=4)
    assert_matches_algorithm2(q, k, v, do, np.array([1e-3, 0.05]), 256, micro, s0, dsn)


def test_tile_decay_uses_non_negative_powers_only():
    lam = np.array([1e-3, 0.5, 1.0])
    factor, keep = la3.tile_decay(lam, 256, 64, 0, 64)  # far off the diagonal: every entry kept
    assert keep.all() and factor.shape == (3, 64, 64) and np.all(np.isfinite(factor)) and np.all(factor <= 1)
    assert factor[1, 0, 63] == 0.5**193 and factor[1, 63, 0] == 0.5**319
    factor, keep = la3.tile_decay(lam, 128, 128, 128, 128)  # a diagonal tile: only r >= s exists
    assert np.array_equal(keep, np.tril(np.ones((128, 128), dtype=bool)))
    assert np.all(np.isfinite(factor)) and np.all(factor <= 1)
    assert factor[0, 5, 2] == 1e-3**3 and factor[2, 5, 2] == 1.0


def test_no_product_is_larger_than_a_micro_tile(monkeypatch):
    shapes = []
    real = la3.masked_product
    monkeypatch.setattr(la3, "masked_product", lambda w, keep, x: shapes.append(w.shape[-2:]) or real(w, keep, x))
    q, k, v, do, s0, dsn = inputs(1, 4, 100, 8, 8, seed=5)
    la3.la3_backward(q, k, v, do, DECAY, 64, 16, s0, dsn)
    assert shapes and max(max(s) for s in shapes) == 16


@st.composite
def problems(draw):
    """A small problem and two (chunk, micro) schedules, micro <= chunk."""
    heads = draw(st.integers(1, 3))
    n = draw(st.integers(1, 60))
    d_k, d_v = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    decay = np.array(draw(st.lists(st.sampled_from([1.0, 0.999, 0.9, 0.5, 1e-3]), min_size=heads, max_size=heads)))
    schedules = []
    for _ in range(2):
        chunk = draw(st.integers(1, 40))
        schedules.append((chunk, draw(st.integers(1, chunk))))
    return inputs(2, heads, n, d_k, d_v, seed=draw(st.integers(0, 2**32 - 1))), decay, schedules


@settings(max_examples=25, deadline=None)
@given(problems())
def test_chunk_and_micro_size_do_not_change_the_answer(problem):
    (q, k, v, do, s0, dsn), decay, ((c1, m1), (c2, m2)) = problem
    first = la3.la3_backward(q, k, v, do, decay, c1, m1, s0, dsn)
    second = la3.la3_backward(q, k, v, do, decay, c2, m2, s0, dsn)
    for name, a, b in zip(NAMES, first, second):
        assert relative_error(a, b) <= TOL, name


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("where", ["q", "k", "v", "do"])
@pytest.mark.parametrize("token", [0, 21, 40, 69])
def test_a_nan_reaches_the_same_gradients_as_in_algorithm2(where, token):
    # NaN x 0 = NaN: multiplying by a mask (or forming a full tile product) would spread a later NaN to
    # earlier rows; selecting the causal entries keeps it where the algebra puts it.
    arrays = dict(zip(("q", "k", "v", "do", "s0", "dsn"), inputs(1, 2, 70, 6, 5, seed=6)))
    arrays[where][0, 1, token, 2] = np.nan
    q, k, v, do, s0, dsn = arrays.values()
    decay = np.array([0.9, 1e-3])
    want = blockwise_backward(q, k, v, do, decay, 32, initial_state=s0, d_final_state=dsn)
    for chunk, micro in [(32, 8), (32, 5), (16, 16), (64, 7)]:
        got = la3.la3_backward(q, k, v, do, decay, chunk, micro, initial_state=s0, d_final_state=dsn)
        for name, mine, ref in zip(NAMES, got, want):
            assert np.array_equal(np.isnan(mine), np.isnan(ref)), f"{name}, chunk {chunk}, micro {micro}"
            finite = np.isfinite(ref)
            assert relative_error(mine[finite], ref[finite]) <= TOL, name
    # Not vacuous: the NaN reached some gradients and left others (the other head at least) finite.
    assert any(np.isnan(g).any() for g in want) and all(np.isfinite(g[:, 0]).all() for g in want)


@pytest.mark.parametrize("micro, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError), ("16", TypeError),
                                          (True, TypeError), (33, ValueError)])
def test_bad_micro_size_is_refused_by_name(micro, error):
    q, k, v, do, _, _ = inputs(1, 1, 40, 4, 4)
    with pytest.raises(error, match="micro_size"):
        la3.la3_backward(q, k, v, do, 0.9, 32, micro)


def test_micro_size_above_the_default_chunk_and_bad_arguments_are_refused():
    q, k, v, do, _, _ = inputs(1, 1, 40, 4, 4)
    with pytest.raises(ValueError, match=r"micro_size must be <= the chunk size 64.*got 65"):
        la3.la3_backward(q, k, v, do, 0.9, None, 65)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        la3.la3_backward(q, k, v, do, 0.9, 0, 1)
    with pytest.raises(ValueError, match=r"q must be 4-D \(batch, heads, seq_len, d_k\), got 3-D"):
        la3.la3_backward(q[0], k, v, do)
    with pytest.raises(TypeError, match="do .* is required"):
        la3.la3_backward(q, k, v, None)
    with pytest.raises(ValueError, match="decay must lie in"):
        la3.la3_backward(q, k, v, do, 1.5)


def dense_intra(a, b, x, lam):
    """[(A B^T) * M] X with M[r, s] = lam^(r - s) for r >= s, else 0: a whole C x C matrix at once."""
    r = np.arange(a.shape[0])
    gap = r[:, None] - r[None, :]
    return ((a @ b.T) * np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0)) @ x


@pytest.mark.parametrize("lam", [1.0, 0.9, 1e-3])
@pytest.mark.parametrize("rows, micro", [(37, 8), (64, 16), (20, 7), (5, 16)])
def test_intra_helpers_equal_the_dense_chunk(rows, micro, lam):
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((2, rows, 6))
    v, do = rng.standard_normal((2, rows, 5))
    dq = la3.intra_dq(do, v, k, lam, micro)
    dv = la3.intra_dv(q, k, do, lam, micro)
    assert dq.shape == (rows, 6) and dv.shape == (rows, 5)
    assert relative_error(dq, dense_intra(do, v, k, lam)) <= TOL
    # dV = [(Q K^T) * M]^T dO: the transposed tile, summed over the later queries.
    r = np.arange(rows)
    mask = np.where(r[:, None] >= r[None, :], lam ** np.maximum(r[:, None] - r[None, :], 0), 0.0)
    assert relative_error(dv, ((q @ k.T) * mask).T @ do) <= TOL


def test_intra_helpers_refuse_bad_arguments_by_name():
    x = np.ones((8, 4))
    with pytest.raises(ValueError, match="do must be 2-D"):
        la3.intra_dq(np.ones((1, 8, 4)), x, x)
    with pytest.raises(ValueError, match="k must have as many rows as q: expected 8, got 7"):
        la3.intra_dv(x, np.ones((7, 4)), x)
    with pytest.raises(ValueError, match=r"v must have the same width as do \(axis 1\): expected 4, got 3"):
        la3.intra_dq(x, np.ones((8, 3)), x)
    with pytest.raises(TypeError, match="q must be a numpy.ndarray"):
        la3.intra_dv([[1.0]], x, x)
    with pytest.raises(ValueError, match="micro_size must be a positive integer"):
        la3.intra_dv(x, x, x, 0.9, 0)
    with pytest.raises(ValueError, match="decay must lie in"):
        la3.intra_dq(x, x, x, 0.0)
