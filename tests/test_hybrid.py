"""hybrid_attention: causal softmax in each block, linear attention before it, one joint normaliser."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lightning_edu import hybrid_attention
from lightning_edu import feature_maps as fm
from lightning_edu import numpy_reference as nr

B, H, N, D_K, D_V = 2, 3, 37, 5, 3
DECAY = [1.0, 0.9, 1e-3]


def inputs(seed=0, n=N, d_k=D_K, d_v=D_V, batch=B, heads=H):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, batch, heads, n, d_k))
    return q, k, rng.standard_normal((batch, heads, n, d_v))


def rel(a, b):
    a, b = (x.detach().double().numpy() if torch.is_tensor(x) else np.asarray(x, dtype=np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("block_size", [N, 64])
@pytest.mark.parametrize("feature_map", ["elu+1", "identity"])
def test_one_block_is_causal_softmax(block_size, feature_map):
    q, k, v = inputs()
    want = nr.softmax_attention(q, k, v, causal=True)
    assert rel(hybrid_attention(q, k, v, block_size=block_size, feature_map=feature_map), want) < 1e-12
    got = hybrid_attention(*(torch.from_numpy(x) for x in (q, k, v)), block_size=block_size, feature_map=feature_map)
    assert got.dtype == torch.float64 and rel(got, want) < 1e-12
    assert rel(hybrid_attention(q, k, v, block_size=block_size, scale=0.3),
               nr.softmax_attention(q, k, v, causal=True, scale=0.3)) < 1e-12


@pytest.mark.parametrize("block_size", [1, 5, 16, 36])
def test_torch_matches_numpy_for_blocks_that_do_not_divide_n(block_size):
    q, k, v = inputs(1)
    want = hybrid_attention(q, k, v, DECAY, block_size=block_size, feature_map="relu2")
    got = hybrid_attention(*(torch.from_numpy(x) for x in (q, k, v)), DECAY, block_size=block_size, feature_map="relu2")
    assert rel(got, want) < 1e-12
    got32 = hybrid_attention(*(torch.from_numpy(x).float() for x in (q, k, v)), DECAY, block_size=block_size, feature_map="relu2")
    assert got32.dtype == torch.float32 and rel(got32, want) < 1e-5


@pytest.mark.parametrize("feature_map", ["elu+1", "relu2", fm.ReLU2Projection(np.random.default_rng(5).standard_normal((D_K, 8)))])
@pytest.mark.parametrize("decay", [1.0, 0.8])
def test_joint_weights_sum_to_one_and_give_the_output(feature_map, decay):
    q, k, v = inputs(2, batch=1, heads=1)
    block = 8
    W = fm.attention_weights(q[0, 0], k[0, 0], "hybrid", feature_map=feature_map, decay=decay, block_size=block)
    assert np.allclose(W.sum(axis=1), 1.0, rtol=0, atol=1e-14)
    assert np.all(np.triu(W, 1) == 0) and np.all(W >= 0)
    o = hybrid_attention(q, k, v, decay, block_size=block, feature_map=feature_map)
    assert rel(o[0, 0], W @ v[0, 0]) < 1e-12
    separate = fm.attention_weights(q[0, 0], k[0, 0], "hybrid_separate", feature_map=feature_map, decay=decay, block_size=block)
    sums = separate.sum(axis=1)
    linear = fm.attention_weights(q[0, 0], k[0, 0], "linear", feature_map=feature_map, decay=decay)
    t = np.arange(N)
    mass = np.where(t[None, :] < (t[:, None] // block) * block, linear, 0.0).sum(axis=1)  # the earlier blocks' weight
    assert np.allclose(sums[:block], 1.0, atol=1e-14)
    # 2 wherever the linear part has any weight (>= the clamp 1e-6); ReLU^2 gives phi(q) = 0 when q < 0: then 1
    assert np.allclose(sums[block:], 1.0 + np.minimum(mass[block:] / 1e-6, 1.0), atol=1e-14)
    assert np.mean(np.abs(sums[block:] - 2.0) < 1e-14) > 0.9


def test_decay_enters_the_softmax_as_a_bias():
    q, k, v = inputs(3, batch=1, heads=1, n=12)
    lam = 0.7
    W = fm.attention_weights(q[0, 0], k[0, 0], "softmax", decay=lam)
    t = np.arange(12)
    scores = q[0, 0] @ k[0, 0].T / np.sqrt(D_K) + (t[:, None] - t[None, :]) * np.log(lam)
    want = np.where(t[:, None] >= t[None, :], np.exp(scores), 0.0)
    assert np.allclose(W, want / want.sum(axis=1, keepdims=True), rtol=1e-13, atol=0)
    # one block: the decayed softmax; the weights of the earlier blocks carry lambda^(t-s) too
    assert rel(hybrid_attention(q, k, v, lam, block_size=12)[0, 0], W @ v[0, 0]) < 1e-12


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_no_overflow_with_large_scores(backend):
    q, k, v = inputs(4)
    q, k = 100 * q, 100 * k
    conv = (lambda x: x) if backend == "numpy" else torch.from_numpy
    for block in (1, 6, 64):
        o = hybrid_attention(conv(q), conv(k), conv(v), DECAY, block_size=block)
        assert np.all(np.isfinite(np.asarray(o)))
    # a first row whose only score is very negative (q = -k): its output is exactly its own value
    q0 = np.zeros((1, 1, 3, 2))
    q0[..., 0] = -100.0
    k0 = -q0
    v0 = np.arange(6.0).reshape(1, 1, 3, 2)
    o = hybrid_attention(conv(q0), conv(k0), conv(v0), block_size=1)
    assert np.allclose(np.asarray(o)[0, 0, 0], v0[0, 0, 0], rtol=0, atol=0)
    assert np.all(np.isfinite(np.asarray(o)))
    # the same extreme inputs, numpy and torch agree
    big = hybrid_attention(*(torch.from_numpy(x) for x in (q, k, v)), DECAY, block_size=6)
    assert rel(big, hybrid_attention(q, k, v, DECAY, block_size=6)) < 1e-12


def test_gradcheck_with_a_learned_decay_and_map():
    rng = np.random.default_rng(6)
    q, k = (torch.tensor(rng.standard_normal((1, 2, 7, 3)), requires_grad=True) for _ in range(2))
    v = torch.tensor(rng.standard_normal((1, 2, 7, 2)), requires_grad=True)
    lam = torch.tensor([0.8, 0.6], dtype=torch.float64, requires_grad=True)
    W = torch.tensor(rng.standard_normal((3, 4)), requires_grad=True)

    def f(q, k, v, lam, W):
        return hybrid_attention(q, k, v, lam, block_size=3, feature_map=lambda x: F.relu(x @ W) ** 2 + 0.1)

    assert torch.autograd.gradcheck(f, (q, k, v, lam, W))


def test_gradients_flow_to_a_learned_relu2():
    torch.manual_seed(0)
    phi = fm.LearnedReLU2(D_K, 9)
    q, k, v = (torch.randn(B, H, N, d, requires_grad=True) for d in (D_K, D_K, D_V))
    hybrid_attention(q, k, v, DECAY, block_size=8, feature_map=phi).square().sum().backward()
    for x in (q, k, v, phi.W):
        assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


def test_bfloat16_runs_in_float32_and_returns_bfloat16():
    q, k, v = inputs(7)
    want = hybrid_attention(q, k, v, block_size=8)
    got = hybrid_attention(*(torch.from_numpy(x).bfloat16() for x in (q, k, v)), block_size=8)
    assert got.dtype == torch.bfloat16 and rel(got, want) < 2e-2


def test_bad_arguments_are_refused():
    q, k, v = inputs(n=4)
    qt, kt, vt = (torch.from_numpy(x).float() for x in (q, k, v))
    with pytest.raises(ValueError, match="backend='triton' is not supported by hybrid_attention.*use backend='torch'"):
        hybrid_attention(qt, kt, vt, block_size=16, backend="triton")
    with pytest.raises(TypeError, match="^block_size must be a positive integer, got NoneType None$"):
        hybrid_attention(q, k, v, block_size=None)
    with pytest.raises(TypeError, match="^block_size must be a positive integer, got float 8.0$"):
        hybrid_attention(q, k, v, block_size=8.0)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        hybrid_attention(q, k, v, block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        hybrid_attention(q, k, v)  # keyword-only and required
    with pytest.raises(ValueError, match="scale must be a finite real number, got nan"):
        hybrid_attention(q, k, v, block_size=2, scale=float("nan"))
    with pytest.raises(ValueError, match="feature_map must be one of"):
        hybrid_attention(q, k, v, block_size=2, feature_map="exp")
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\]"):
        hybrid_attention(q, k, v, 1.5, block_size=2)
    with pytest.raises(TypeError, match="backend='numpy' takes numpy arrays"):
        hybrid_attention(qt, kt, vt, block_size=2, backend="numpy")
