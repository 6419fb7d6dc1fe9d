"""Algorithm 2 (lightning_attention_backward, backend "numpy") against truths computed here.

Truth 1: torch float64 autograd through the token-by-token recurrence KV_t = lambda KV_{t-1} + k_t^T v_t.
Truth 2: central finite differences of L = <o, do> + <KV_n, d_final_state> with a numpy recurrent loop.
Neither uses lightning_edu code. L is linear in each input separately, so central differences have no
truncation error: their error is rounding only, far below the 1e-6 tolerance.
"""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_edu import lightning_attention, lightning_attention_backward


def inputs(batch, heads, n, d_k, d_v, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, batch, heads, n, d_k))
    v, do = rng.standard_normal((2, batch, heads, n, d_v))
    s0, g = rng.standard_normal((2, batch, heads, d_k, d_v))
    return q, k, v, do, s0, g


def autograd_truth(q, k, v, do, decay, s0, g):
    lam = torch.tensor(np.broadcast_to(np.asarray(decay, dtype=np.float64), (q.shape[1],)).copy())[None, :, None, None]
    qt, kt, vt, st0 = (torch.tensor(x, requires_grad=True) for x in (q, k, v, s0))
    kv, outs = st0, []
    for t in range(q.shape[2]):
        kv = lam * kv + kt[:, :, t, :, None] * vt[:, :, t, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qt[:, :, t], kv))
    loss = (torch.stack(outs, dim=2) * torch.tensor(do)).sum() + (kv * torch.tensor(g)).sum()
    loss.backward()
    return [x.grad.numpy() for x in (qt, kt, vt, st0)]


def fd_truth(q, k, v, do, decay, s0, g, h=1e-3):
    lam = np.broadcast_to(np.asarray(decay, dtype=np.float64), (q.shape[1],))[None, :, None, None]

    def loss(q, k, v, s0):
        kv, total = s0.copy(), 0.0
        for t in range(q.shape[2]):
            kv = lam * kv + k[:, :, t, :, None] * v[:, :, t, None, :]
            total += float(np.sum(np.einsum("bhk,bhkv->bhv", q[:, :, t], kv) * do[:, :, t]))
        return total + float(np.sum(kv * g))

    xs = [np.array(x) for x in (q, k, v, s0)]
    grads = []
    for x in xs:
        grad = np.empty_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + h
            plus = loss(*xs)
            x[idx] = keep - h
            minus = loss(*xs)
            x[idx] = keep
            grad[idx] = (plus - minus) / (2 * h)
        grads.append(grad)
    return grads


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


CASES = [  # (n, d_k, d_v, block_size, decay); two heads each, so a list is a per-head decay
    (1, 4, 3, 1, [0.9, 0.5]),
    (1, 3, 5, 64, 1.0),
    (7, 4, 3, 1, [1.0, 0.05]),
    (7, 5, 2, 5, 0.05),
    (37, 6, 4, 5, [0.99, 0.8]),
    (37, 3, 7, 16, 1.0),
    (37, 4, 3, 64, 0.05),
    (130, 5, 3, 16, [1.0, 0.9]),
    (130, 4, 6, 64, 0.05),
    (130, 3, 4, 1024, [0.05, 1.0]),
    (130, 4, 3, None, 0.97),
    (1030, 3, 2, 1024, 1e-3),
    (1030, 2, 3, 1024, 0.05),
    (1030, 2, 2, 1024, [1.0, 1e-3]),
]


@pytest.mark.parametrize("n, d_k, d_v, block_size, decay", CASES)
def test_matches_autograd(n, d_k, d_v, block_size, decay):
    q, k, v, do, s0, g = inputs(2, 2, n, d_k, d_v, seed=n + d_k)
    got = lightning_attention_backward(
        q, k, v, do, decay, backend="numpy", block_size=block_size, initial_state=s0, d_final_state=g, return_state_grad=True
    )
    truth = autograd_truth(q, k, v, do, decay, s0, g)
    for name, mine, ref in zip(("dq", "dk", "dv", "d_initial_state"), got, truth):
        assert mine.shape == ref.shape, name
        assert np.all(np.isfinite(mine)), name
        assert rel(mine, ref) < 1e-10, f"{name}: relative error {rel(mine, ref):.2e}"


@pytest.mark.parametrize("n, d_k, d_v, block_size, decay", [(1, 3, 2, 1, 0.5), (7, 3, 2, 5, [1.0, 0.05]), (37, 2, 3, 16, [0.9, 0.3])])
def test_matches_finite_differences(n, d_k, d_v, block_size, decay):
    q, k, v, do, s0, g = inputs(1, 2, n, d_k, d_v, seed=100 + n)
    got = lightning_attention_backward(
        q, k, v, do, decay, block_size=block_size, initial_state=s0, d_final_state=g, return_state_grad=True
    )
    for name, mine, ref in zip(("dq", "dk", "dv", "d_initial_state"), got, fd_truth(q, k, v, do, decay, s0, g)):
        assert rel(mine, ref) < 1e-6, f"{name}: relative error {rel(mine, ref):.2e}"


def test_without_state_arguments_matches_autograd_with_zeros():
    q, k, v, do, s0, g = inputs(1, 2, 37, 4, 3, seed=9)
    dq, dk, dv = lightning_attention_backward(q, k, v, do, [0.9, 1.0], block_size=8)
    truth = autograd_truth(q, k, v, do, [0.9, 1.0], np.zeros_like(s0), np.zeros_like(g))
    for mine, ref in zip((dq, dk, dv), truth):
        assert rel(mine, ref) < 1e-10


def test_no_overflow_for_tiny_decay_and_big_blocks():
    q, k, v, do, s0, g = inputs(1, 1, 2100, 2, 2, seed=11)
    got = lightning_attention_backward(q, k, v, do, 1e-3, block_size=1024, initial_state=s0, d_final_state=g, return_state_grad=True)
    assert all(np.all(np.isfinite(x)) for x in got)
    # lambda^2100 underflows to 0: the initial state's gradient is the first token's q^T do times lambda
    expected = 1e-3 * np.einsum("bhk,bhv->bhkv", q[:, :, 0], do[:, :, 0])
    assert rel(got[3], expected) < 1e-2  # next token adds lambda^2 terms: relative size ~1e-3


def test_rejects_a_badly_shaped_d_final_state():
    q, k, v, do, s0, g = inputs(1, 2, 7, 4, 3, seed=0)
    with pytest.raises(ValueError, match="d_final_state"):
        lightning_attention_backward(q, k, v, do, 0.9, d_final_state=g[..., :2])


@given(
    n=st.integers(1, 70),
    block_a=st.integers(1, 80),
    block_b=st.integers(1, 80),
    decay=st.lists(st.floats(0.01, 1.0), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_block_size_does_not_change_the_gradients(n, block_a, block_b, decay, seed):
    q, k, v, do, s0, g = inputs(1, 2, n, 3, 2, seed)
    a = lightning_attention_backward(q, k, v, do, decay, block_size=block_a, initial_state=s0, d_final_state=g, return_state_grad=True)
    b = lightning_attention_backward(q, k, v, do, decay, block_size=block_b, initial_state=s0, d_final_state=g, return_state_grad=True)
    for x, y in zip(a, b):
        assert rel(x, y) < 1e-12 or np.max(np.abs(x - y)) < 1e-12


@given(n=st.integers(2, 60), cut=st.integers(1, 59), block=st.integers(1, 20), decay=st.floats(0.05, 1.0), seed=st.integers(0, 2**16))
def test_split_the_sequence_carry_the_state_gradient(n, cut, block, decay, seed):
    # Backward of the second half, started from the first half's final state, hands its d_initial_state
    # to the first half as d_final_state: the two halves then give the gradients of the whole.
    cut = min(cut, n - 1)
    q, k, v, do, s0, g = inputs(1, 2, n, 3, 2, seed)
    whole = lightning_attention_backward(q, k, v, do, decay, block_size=block, initial_state=s0, d_final_state=g, return_state_grad=True)
    first, second = slice(0, cut), slice(cut, n)
    _, mid = lightning_attention(q[:, :, first], k[:, :, first], v[:, :, first], decay, block_size=block, initial_state=s0, return_state=True)
    dq2, dk2, dv2, d_mid = lightning_attention_backward(
        q[:, :, second], k[:, :, second], v[:, :, second], do[:, :, second], decay, block_size=block,
        initial_state=mid, d_final_state=g, return_state_grad=True,
    )
    dq1, dk1, dv1, d_s0 = lightning_attention_backward(
        q[:, :, first], k[:, :, first], v[:, :, first], do[:, :, first], decay, block_size=block,
        initial_state=s0, d_final_state=d_mid, return_state_grad=True,
    )
    for part, full in zip(
        (np.concatenate([dq1, dq2], axis=2), np.concatenate([dk1, dk2], axis=2), np.concatenate([dv1, dv2], axis=2), d_s0), whole
    ):
        assert rel(part, full) < 1e-12 or np.max(np.abs(part - full)) < 1e-12
