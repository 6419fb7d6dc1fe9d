"""The float64 numpy ladder: every rung against the recurrent scan, and the scan against the math.

The recurrent scan ``causal_linear_recurrent`` is the ground truth of the book, so it is itself checked
here against values computed by hand or by an independent formula (never by another function under test).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_edu import lightning_attention
from lightning_edu import numpy_blockwise as nb
from lightning_edu import numpy_reference as nr

BATCH, HEADS, D_K, D_V = 2, 3, 5, 3  # d_k != d_v on purpose
SEQ_LENS = [1, 7, 37, 130]
DECAYS = {
    "decay=1": 1.0,
    "decay=0.05": 0.05,
    "per-head": np.array([1.0, 0.9, 0.05]),
}
TOL = 1e-12


def rel(mine, ref) -> float:
    # Written here, not imported from lightning_edu.checks: the comparison must not be code under test.
    mine, ref = np.asarray(mine), np.asarray(ref)
    assert mine.shape == ref.shape, (mine.shape, ref.shape)
    return float(np.linalg.norm(mine - ref) / max(np.linalg.norm(ref), 1e-300))


def inputs(n, seed=0, dtype=np.float64, state=False):
    rng = np.random.default_rng(seed + 1000 * n)
    q = rng.standard_normal((BATCH, HEADS, n, D_K)).astype(dtype)
    k = rng.standard_normal((BATCH, HEADS, n, D_K)).astype(dtype)
    v = rng.standard_normal((BATCH, HEADS, n, D_V)).astype(dtype)
    if state:
        return q, k, v, rng.standard_normal((BATCH, HEADS, D_K, D_V)).astype(dtype)
    return q, k, v


# ---------------------------------------------------------------- every rung vs the recurrent scan

RUNGS = {
    "masked": lambda q, k, v, lam: nr.causal_linear_masked(q, k, v, lam),
    "cumsum": lambda q, k, v, lam: nr.causal_linear_cumsum(q, k, v, lam),
    "blockwise B=1": lambda q, k, v, lam: nb.blockwise_forward(q, k, v, lam, block_size=1)[0],
    "blockwise B=16": lambda q, k, v, lam: nb.blockwise_forward(q, k, v, lam, block_size=16)[0],
    "blockwise default": lambda q, k, v, lam: nb.blockwise_forward(q, k, v, lam)[0],
    "blockwise B=13": lambda q, k, v, lam: nb.blockwise_forward(q, k, v, lam, block_size=13)[0],
    "api numpy B=32": lambda q, k, v, lam: lightning_attention(q, k, v, lam, backend="numpy", block_size=32),
    "api auto B=200": lambda q, k, v, lam: lightning_attention(q, k, v, lam, block_size=200),
    "api default": lambda q, k, v, lam: lightning_attention(q, k, v, lam),
}


@pytest.mark.parametrize("decay_name", sorted(DECAYS))
@pytest.mark.parametrize("n", SEQ_LENS)
@pytest.mark.parametrize("rung", list(RUNGS))
def test_rung_matches_recurrent_scan(rung, n, decay_name):
    lam = DECAYS[decay_name]
    q, k, v = inputs(n)
    ref = nr.causal_linear_recurrent(q, k, v, lam)
    out = RUNGS[rung](q, k, v, lam)
    assert out.dtype == np.float64 and out.shape == (BATCH, HEADS, n, D_V)
    assert rel(out, ref) <= TOL


@pytest.mark.parametrize("decay_name", sorted(DECAYS))
@pytest.mark.parametrize("n", SEQ_LENS)
@pytest.mark.parametrize("block_size", [1, 16, None, 200])
def test_blockwise_state_and_initial_state_match_recurrent_scan(n, decay_name, block_size):
    lam = DECAYS[decay_name]
    q, k, v, s0 = inputs(n, seed=1, state=True)
    ref_o, ref_s = nr.causal_linear_recurrent(q, k, v, lam, initial_state=s0, return_state=True)
    o, s = nb.blockwise_forward(q, k, v, lam, block_size=block_size, initial_state=s0)
    assert rel(o, ref_o) <= TOL and rel(s, ref_s) <= TOL
    o2, s2 = lightning_attention(q, k, v, lam, backend="numpy", block_size=block_size, initial_state=s0, return_state=True)
    assert s2.shape == (BATCH, HEADS, D_K, D_V)
    assert rel(o2, ref_o) <= TOL and rel(s2, ref_s) <= TOL


def test_return_state_switch():
    q, k, v = inputs(7)
    o = lightning_attention(q, k, v, 0.5)
    assert isinstance(o, np.ndarray)
    pair = lightning_attention(q, k, v, 0.5, return_state=True)
    assert isinstance(pair, tuple) and len(pair) == 2 and np.array_equal(pair[0], o)
    o_r = nr.causal_linear_recurrent(q, k, v, 0.5)
    assert isinstance(o_r, np.ndarray)
    assert np.array_equal(nr.causal_linear_recurrent(q, k, v, 0.5, return_state=True)[0], o_r)


# ---------------------------------------------------------------- the recurrent scan against hand-computed values


def test_recurrent_two_token_example_by_hand():
    # d_k = 2, d_v = 2, lambda = 0.5:
    #   KV_1 = k_1^T v_1 = [1, 2]^T [3, -1] = [[3, -1], [6, -2]];         o_1 = [1, 0] KV_1 = [3, -1]
    #   KV_2 = 0.5 KV_1 + [1, 1]^T [1, 2] = [[2.5, 1.5], [4, 1]];          o_2 = [0, 1] KV_2 = [4, 1]
    q = np.array([[1.0, 0.0], [0.0, 1.0]])[None, None]
    k = np.array([[1.0, 2.0], [1.0, 1.0]])[None, None]
    v = np.array([[3.0, -1.0], [1.0, 2.0]])[None, None]
    o, state = nr.causal_linear_recurrent(q, k, v, 0.5, return_state=True)
    assert np.array_equal(o[0, 0], np.array([[3.0, -1.0], [4.0, 1.0]]))
    assert np.array_equal(state[0, 0], np.array([[2.5, 1.5], [4.0, 1.0]]))
    # With lambda = 1 the first state is not forgotten: KV_2 = [[4, 1], [7, 0]], o_2 = [7, 0].
    o1, state1 = nr.causal_linear_recurrent(q, k, v, 1.0, return_state=True)
    assert np.array_equal(o1[0, 0], np.array([[3.0, -1.0], [7.0, 0.0]]))
    assert np.array_equal(state1[0, 0], np.array([[4.0, 1.0], [7.0, 0.0]]))
    # The same example through the blockwise algorithm (one block of 2, and two blocks of 1).
    for block_size in (1, 2):
        ob, sb = nb.blockwise_forward(q, k, v, 0.5, block_size=block_size)
        assert np.allclose(ob[0, 0], [[3.0, -1.0], [4.0, 1.0]], rtol=0, atol=1e-15)
        assert np.allclose(sb[0, 0], [[2.5, 1.5], [4.0, 1.0]], rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", [1, 7, 37])
def test_state_after_n_steps_is_the_decayed_sum(n):
    # KV_n = sum_s lambda^(n-s) k_s^T v_s + lambda^n S_0 (1-based s), built with explicit loops and np.outer.
    lam = np.array([1.0, 0.7, 0.05])
    q, k, v, s0 = inputs(n, seed=2, state=True)
    o, state = nr.causal_linear_recurrent(q, k, v, lam, initial_state=s0, return_state=True)
    for b in range(BATCH):
        for h in range(HEADS):
            kv = lam[h] ** n * s0[b, h]
            for s in range(1, n + 1):
                kv = kv + lam[h] ** (n - s) * np.outer(k[b, h, s - 1], v[b, h, s - 1])
            assert rel(state[b, h], kv) <= TOL
            # and every output row o_t = q_t KV_t with KV_t built the same way
            for t in range(1, n + 1):
                kv_t = lam[h] ** t * s0[b, h] + sum(
                    lam[h] ** (t - s) * np.outer(k[b, h, s - 1], v[b, h, s - 1]) for s in range(1, t + 1)
                )
                assert rel(o[b, h, t - 1], q[b, h, t - 1] @ kv_t) <= TOL


def test_initial_state_is_not_modified_and_zero_state_is_the_default():
    q, k, v, s0 = inputs(7, seed=3, state=True)
    keep = [x.copy() for x in (q, k, v, s0)]
    nr.causal_linear_recurrent(q, k, v, 0.5, initial_state=s0, return_state=True)
    nb.blockwise_forward(q, k, v, 0.5, block_size=3, initial_state=s0)
    nr.causal_linear_cumsum(q, k, v, 0.5)
    for x, y in zip((q, k, v, s0), keep):
        assert np.array_equal(x, y)
    zero = np.zeros((BATCH, HEADS, D_K, D_V))
    assert np.array_equal(
        nr.causal_linear_recurrent(q, k, v, 0.5, initial_state=zero), nr.causal_linear_recurrent(q, k, v, 0.5)
    )


@pytest.mark.parametrize(
    "fn",
    [
        lambda q, k, v: nr.causal_linear_recurrent(q, k, v, 0.3),
        lambda q, k, v: nr.causal_linear_masked(q, k, v, 0.3),
        lambda q, k, v: nr.causal_linear_cumsum(q, k, v, 0.3),
        lambda q, k, v: nb.blockwise_forward(q, k, v, 0.3, block_size=4)[0],
        lambda q, k, v: lightning_attention(q, k, v, 0.3, block_size=4),
        lambda q, k, v: nr.linear_attention_left(q, k, v),
        lambda q, k, v: nr.linear_attention_right(q, k, v),
        lambda q, k, v: nr.softmax_attention(q, k, v, causal=True),
    ],
    ids=["recurrent", "masked", "cumsum", "blockwise", "api", "left", "right", "softmax"],
)
def test_float32_inputs_are_computed_in_float64(fn):
    q, k, v = inputs(37, seed=4, dtype=np.float32)
    out = fn(q, k, v)
    assert out.dtype == np.float64
    # Same float32 values promoted first: a float32 computation would differ by ~1e-7, float64 by ~1e-16.
    ref = fn(*(x.astype(np.float64) for x in (q, k, v)))
    assert rel(out, ref) <= 1e-14


# ---------------------------------------------------------------- the other rungs against independent formulas


def _torch64(*xs):
    return tuple(torch.from_numpy(np.asarray(x, dtype=np.float64)) for x in xs)


@pytest.mark.parametrize("n", [1, 7, 37])
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_attention_matches_torch(n, causal):
    q, k, v = inputs(n, seed=5)
    tq, tk, tv = _torch64(q, k, v)
    scores = tq @ tk.transpose(-1, -2) / math.sqrt(D_K)
    if causal:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    ref = (torch.softmax(scores, dim=-1) @ tv).numpy()
    assert rel(nr.softmax_attention(q, k, v, causal=causal), ref) <= TOL
    # An explicit scale replaces 1/sqrt(d_k).
    ref2 = (torch.softmax(tq @ tk.transpose(-1, -2) * 0.3, dim=-1) @ tv).numpy()
    assert rel(nr.softmax_attention(q, k, v, scale=0.3), ref2) <= TOL


def test_softmax_attention_does_not_overflow_on_large_scores():
    # Scores of ~1e4 overflow exp() unless the max is subtracted first.
    q, k, v = inputs(7, seed=6)
    out = nr.softmax_attention(100 * q, 100 * k, v, causal=True)
    assert np.isfinite(out).all()
    tq, tk, tv = _torch64(100 * q, 100 * k, v)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    ref = torch.softmax((tq @ tk.transpose(-1, -2) / math.sqrt(D_K)).masked_fill(~mask, float("-inf")), -1) @ tv
    assert rel(out, ref.numpy()) <= TOL
    # Causal row 0 sees only token 0: its output is v_0 exactly.
    assert np.allclose(out[:, :, 0], v[:, :, 0], rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", [1, 7, 130])
def test_noncausal_left_equals_right_and_direct_formula(n):
    q, k, v = inputs(n, seed=7)
    left, right = nr.linear_attention_left(q, k, v), nr.linear_attention_right(q, k, v)
    assert rel(left, right) <= TOL
    # o_t = sum over ALL s of (q_t . k_s) v_s, written as an einsum over explicit indices.
    direct = np.einsum("bhtd,bhsd,bhse->bhte", q, k, v)
    assert rel(left, direct) <= TOL


def test_decay_mask_4x4_by_hand():
    half = nr.decay_mask(4, 0.5)
    expected = np.array(
        [
            [1.0, 0.0, 0.0, 0.0],
            [0.5, 1.0, 0.0, 0.0],
            [0.25, 0.5, 1.0, 0.0],
            [0.125, 0.25, 0.5, 1.0],
        ]
    )
    assert half.shape == (4, 4) and np.array_equal(half, expected)
    assert np.array_equal(nr.decay_mask(4, 1.0), np.tril(np.ones((4, 4))))
    per_head = nr.decay_mask(4, [0.5, 1.0, 0.1])
    assert per_head.shape == (3, 4, 4)
    assert np.array_equal(per_head[0], expected)
    assert np.array_equal(per_head[1], np.tril(np.ones((4, 4))))
    assert np.allclose(per_head[2][3], [1e-3, 1e-2, 1e-1, 1.0], rtol=1e-15, atol=0) and np.all(np.triu(per_head[2], 1) == 0)
    assert nr.decay_mask(1, 0.05).shape == (1, 1) and nr.decay_mask(1, 0.05)[0, 0] == 1.0


def test_decay_mask_never_overflows():
    # lambda^-(n-1) would be 0.05^-399 = inf; only non-negative powers may be formed.
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):  # underflow to 0 is fine
        mask = nr.decay_mask(400, 0.05)
    assert np.isfinite(mask).all() and mask.max() == 1.0 and mask.min() == 0.0


def test_causal_masked_is_tril_of_left_product_for_decay_one():
    q, k, v = inputs(37, seed=8)
    # Independent: (Q K^T) with the upper triangle zeroed, built by explicit loops over t and s <= t.
    expected = np.zeros((BATCH, HEADS, 37, D_V))
    for t in range(37):
        for s in range(t + 1):
            expected[:, :, t] += np.einsum("bhd,bhd->bh", q[:, :, t], k[:, :, s])[..., None] * v[:, :, s]
    assert rel(nr.causal_linear_masked(q, k, v), expected) <= TOL


def test_elu_plus_one_values_and_positivity():
    x = np.array([-2.0, -1.0, -1e-3, 0.0, 1e-3, 0.5, 3.0])
    expected = np.array([math.exp(-2.0), math.exp(-1.0), math.exp(-1e-3), 1.0, 1.001, 1.5, 4.0])
    out = nr.elu_plus_one(x)
    assert out.dtype == np.float64 and out.shape == x.shape
    assert np.allclose(out, expected, rtol=1e-15, atol=0)
    grid = np.linspace(-30.0, 30.0, 6001)
    assert (nr.elu_plus_one(grid) > 0).all()
    # exp only ever sees non-positive arguments: huge inputs neither overflow nor warn.
    with np.errstate(over="raise", invalid="raise"):
        big = nr.elu_plus_one(np.array([1e300, 800.0, -800.0]))
    assert big[0] == 1e300 + 1.0 and big[1] == 801.0 and 0.0 <= big[2] < 1e-300
    # Continuous at 0 and monotone.
    assert np.all(np.diff(nr.elu_plus_one(grid)) > 0)
    # Works on integers and on any shape.
    assert np.array_equal(nr.elu_plus_one(np.array([[0, 1], [2, 3]])), np.array([[1.0, 2.0], [3.0, 4.0]]))
