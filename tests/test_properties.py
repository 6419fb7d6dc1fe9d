"""Properties that must hold for every shape and decay (hypothesis; profile in tests/conftest.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import assume, given
from hypothesis import strategies as st

from lightning_edu import lightning_attention
from lightning_edu import numpy_reference as nr

TOL = 1e-12

lam_values = st.one_of(st.just(1.0), st.just(0.05), st.floats(min_value=0.05, max_value=1.0))


@st.composite
def problems(draw, min_n=1):
    """Small random problems: (q, k, v, initial_state, decay), odd shapes, per-head decay."""
    batch = draw(st.integers(1, 2))
    heads = draw(st.integers(1, 3))
    n = draw(st.integers(min_n, 40))
    d_k = draw(st.integers(1, 6))
    d_v = draw(st.integers(1, 6))
    decay = np.array(draw(st.lists(lam_values, min_size=heads, max_size=heads)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((batch, heads, n, d_k))
    k = rng.standard_normal((batch, heads, n, d_k))
    v = rng.standard_normal((batch, heads, n, d_v))
    s0 = rng.standard_normal((batch, heads, d_k, d_v))
    return q, k, v, s0, decay


def rel(mine, ref, scale=None) -> float:
    scale = np.linalg.norm(ref) if scale is None else scale
    return float(np.linalg.norm(np.asarray(mine) - np.asarray(ref)) / max(scale, 1e-300))


@given(problems(), st.integers(1, 45), st.integers(1, 45))
def test_block_size_does_not_change_the_answer(problem, b1, b2):
    q, k, v, s0, decay = problem
    o1, kv1 = lightning_attention(q, k, v, decay, backend="numpy", block_size=b1, initial_state=s0, return_state=True)
    o2, kv2 = lightning_attention(q, k, v, decay, backend="numpy", block_size=b2, initial_state=s0, return_state=True)
    assert rel(o1, o2) <= TOL and rel(kv1, kv2) <= TOL


@given(problems(), st.integers(1, 45))
def test_decay_one_is_plain_causal_linear_attention(problem, block_size):
    q, k, v, _, _ = problem
    # o = tril(Q K^T) V: the causal mask with every weight 1, written without the package.
    expected = np.tril(q @ k.swapaxes(-1, -2)) @ v
    for out in (
        lightning_attention(q, k, v, 1.0, backend="numpy", block_size=block_size),
        nr.causal_linear_recurrent(q, k, v, 1.0),
        nr.causal_linear_masked(q, k, v, 1.0),
        nr.causal_linear_cumsum(q, k, v, 1.0),
    ):
        assert rel(out, expected) <= TOL


@given(problems(min_n=2), st.data())
def test_split_and_carry_the_state_equals_one_pass(problem, data):
    q, k, v, s0, decay = problem
    n = q.shape[2]
    cut = data.draw(st.integers(1, n - 1), label="cut")
    block_size = data.draw(st.integers(1, 45), label="block_size")
    whole, kv_whole = lightning_attention(q, k, v, decay, block_size=block_size, initial_state=s0, return_state=True)
    first, kv_cut = lightning_attention(
        q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], decay, block_size=block_size, initial_state=s0, return_state=True
    )
    second, kv_end = lightning_attention(
        q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], decay, block_size=block_size, initial_state=kv_cut, return_state=True
    )
    assert rel(np.concatenate([first, second], axis=2), whole) <= TOL
    assert rel(kv_end, kv_whole) <= TOL
    # The same through the recurrent scan.
    r_first, r_cut = nr.causal_linear_recurrent(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], decay, initial_state=s0, return_state=True)
    r_second = nr.causal_linear_recurrent(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], decay, initial_state=r_cut)
    assert rel(np.concatenate([r_first, r_second], axis=2), whole) <= TOL


@given(problems(), st.floats(-3, 3), st.floats(-3, 3), st.integers(0, 2**32 - 1))
def test_output_is_linear_in_v(problem, a, b, seed):
    q, k, v1, _, decay = problem
    v2 = np.random.default_rng(seed).standard_normal(v1.shape)
    o1 = lightning_attention(q, k, v1, decay, block_size=8)
    o2 = lightning_attention(q, k, v2, decay, block_size=8)
    o_mix = lightning_attention(q, k, a * v1 + b * v2, decay, block_size=8)
    # Relative to the size of the terms, since a*o1 + b*o2 may cancel.
    scale = abs(a) * np.linalg.norm(o1) + abs(b) * np.linalg.norm(o2)
    assume(scale > 0)
    assert rel(o_mix, a * o1 + b * o2, scale) <= TOL


@given(problems(), st.one_of(st.floats(-100, 100), st.sampled_from([0.0, -1.0, 1e-8, 1e8])))
def test_scaling_q_scales_o(problem, c):
    q, k, v, _, decay = problem
    o = lightning_attention(q, k, v, decay, block_size=8)
    o_c = lightning_attention(c * q, k, v, decay, block_size=8)
    assert rel(o_c, c * o, abs(c) * np.linalg.norm(o)) <= TOL  # c = 0: o_c must be exactly 0
