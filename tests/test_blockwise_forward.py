"""Algorithm 1 in numpy (numpy_blockwise.blockwise_forward, the "numpy" backend) against the recurrent scan."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_edu import lightning_attention
from lightning_edu.checks import random_qkv, relative_error
from lightning_edu.numpy_blockwise import block_factors, blockwise_forward
from lightning_edu.numpy_reference import causal_linear_masked, causal_linear_recurrent

BLOCK_SIZES = [1, 3, 16, 37, 64, 100, 1024]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("n", [1, 7, 130, 1031])
def test_matches_recurrent_scan(block_size, n):
    q, k, v = random_qkv(batch=2, heads=2, n=n, d_k=5, d_v=3, seed=n + block_size)
    decay = np.array([0.9, 1.0])
    ref, ref_state = causal_linear_recurrent(q, k, v, decay, return_state=True)
    out, state = blockwise_forward(q, k, v, decay, block_size)
    assert out.shape == (2, 2, n, 3) and state.shape == (2, 2, 5, 3)
    assert relative_error(out, ref) < 1e-12
    assert relative_error(state, ref_state) < 1e-12


@pytest.mark.parametrize("block_size", [4, 37])
def test_per_head_decay_each_head_matches_its_own_scan(block_size):
    decays = np.array([1.0, 0.99, 0.5, 0.05])
    q, k, v = random_qkv(batch=1, heads=4, n=130, d_k=8, d_v=6, seed=3)
    out = lightning_attention(q, k, v, decays, backend="numpy", block_size=block_size)
    for h, lam in enumerate(decays):
        ref = causal_linear_recurrent(q[:, h : h + 1], k[:, h : h + 1], v[:, h : h + 1], float(lam))
        assert relative_error(out[:, h : h + 1], ref) < 1e-12, f"head {h}, lambda {lam}"
    # and the heads really differ: a shared decay would give another answer
    shared = lightning_attention(q, k, v, 0.99, backend="numpy", block_size=block_size)
    assert relative_error(shared, out) > 1e-3


def test_initial_state_and_return_state():
    q, k, v, s0 = random_qkv(batch=2, heads=3, n=37, d_k=4, d_v=7, seed=11, state=True)
    decay = [0.3, 0.9, 1.0]
    ref, ref_state = causal_linear_recurrent(q, k, v, decay, initial_state=s0, return_state=True)
    out, state = lightning_attention(q, k, v, decay, backend="numpy", block_size=16, initial_state=s0, return_state=True)
    assert relative_error(out, ref) < 1e-12 and relative_error(state, ref_state) < 1e-12
    # the initial state matters: dropping it changes the answer
    assert relative_error(lightning_attention(q, k, v, decay, backend="numpy", block_size=16), ref) > 1e-3
    only_out = lightning_attention(q, k, v, decay, backend="numpy", block_size=16, initial_state=s0)
    assert isinstance(only_out, np.ndarray) and np.array_equal(only_out, out)


def test_matches_the_masked_product_too():
    q, k, v = random_qkv(batch=1, heads=2, n=130, d_k=3, d_v=9, seed=5)
    out = lightning_attention(q, k, v, [0.8, 0.999], backend="numpy", block_size=37)
    assert relative_error(out, causal_linear_masked(q, k, v, [0.8, 0.999])) < 1e-12


@pytest.mark.parametrize("decay", [1e-3, 0.05])
def test_small_decay_with_block_1024_never_overflows(decay):
    # n = 1024 + 37: one full block and a partial one. The literal lambda^B Lambda^-1 would form
    # lambda^-1024 = 1e3072 (inf) here; the package forms lambda^(b-1-r) directly.
    n = 1024 + 37
    q, k, v = random_qkv(batch=1, heads=1, n=n, d_k=4, d_v=3, seed=1)
    with np.errstate(over="raise", invalid="raise"):  # any overflow or inf - inf raises
        out, state = blockwise_forward(q, k, v, decay, 1024)
    assert np.isfinite(out).all() and np.isfinite(state).all()
    ref = causal_linear_recurrent(q, k, v, decay)
    assert relative_error(out, ref) < 1e-12


def test_block_factors_are_the_decay_powers():
    mask, q_scale, k_scale, block_decay = block_factors(5, np.array([0.5]))
    r = np.arange(5)
    assert np.array_equal(q_scale[0, :, 0], 0.5 ** (r + 1))  # Lambda of Algorithm 1
    assert np.array_equal(k_scale[0, :, 0], 0.5 ** (4 - r))  # lambda^B Lambda^-1, formed directly
    assert block_decay[0, 0, 0] == 0.5**5
    assert mask[0, 3, 1] == 0.25 and mask[0, 1, 3] == 0.0
    with np.errstate(over="raise", under="ignore"):
        _, q_scale, k_scale, _ = block_factors(1024, np.array([1e-3]))
    assert np.isfinite(q_scale).all() and np.isfinite(k_scale).all() and k_scale[0, -1, 0] == 1.0


# ---------------------------------------------------------------- properties
shapes = st.tuples(st.integers(1, 80), st.integers(1, 6), st.integers(1, 5))
decays = st.one_of(st.just(1.0), st.floats(0.05, 1.0))


@given(shape=shapes, decay=decays, b1=st.integers(1, 90), b2=st.integers(1, 90), seed=st.integers(0, 2**16))
def test_property_block_size_does_not_change_the_answer(shape, decay, b1, b2, seed):
    n, d_k, d_v = shape
    q, k, v = random_qkv(batch=1, heads=2, n=n, d_k=d_k, d_v=d_v, seed=seed)
    o1, s1 = lightning_attention(q, k, v, decay, backend="numpy", block_size=b1, return_state=True)
    o2, s2 = lightning_attention(q, k, v, decay, backend="numpy", block_size=b2, return_state=True)
    assert relative_error(o1, o2) < 1e-12 and relative_error(s1, s2) < 1e-12
