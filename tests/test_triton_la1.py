"""Lightning Attention-1 Triton kernels (lightning_edu.triton_kernels.la1) under the CPU interpreter.

References are the float64 numpy rungs: the masked left product (forward) and Algorithm 2 in numpy
(backward), neither of which shares code with the kernels. Bound 1e-5 relative: the kernels run in fp32
with IEEE fp32 dots (the interpreter has no tf32; on a GPU the wrapper asks for "ieee" too), so the only
error is fp32 rounding over sums of at most ~100 * 32 terms, measured near 2e-7.
"""

import os

import numpy as np
import pytest
import torch

from lightning_edu.checks import random_qkv, relative_error
from lightning_edu.numpy_blockwise import blockwise_backward
from lightning_edu.numpy_reference import causal_linear_masked
from lightning_edu.triton_kernels.la1 import la1_attention, la1_backward, la1_forward

assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RTOL = 1e-5


def _t(x):
    return torch.tensor(x, dtype=torch.float32, device=DEVICE)


CASES = [  # (batch, n, d_k, d_v, decays): every n ends in a partial block of 16 except n = 1 (a single row)
    (1, 1, 16, 32, [1.0, 0.05]),
    (2, 17, 32, 16, [0.9, 1.0]),
    (1, 37, 16, 16, [0.05, 0.5]),
    (1, 100, 32, 32, [1.0, 0.99]),
]


@pytest.mark.parametrize("batch,n,d_k,d_v,decay", CASES)
def test_forward_and_backward_match_float64(batch, n, d_k, d_v, decay):
    q, k, v = random_qkv(batch, 2, n, d_k, d_v, seed=n)
    do = np.random.default_rng(n + 1).standard_normal(v.shape)
    o = la1_forward(_t(q), _t(k), _t(v), decay, block_size=16)
    assert o.dtype == torch.float32 and o.shape == (batch, 2, n, d_v)
    assert relative_error(o, causal_linear_masked(q, k, v, decay)) <= RTOL
    grads = la1_backward(_t(q), _t(k), _t(v), _t(do), decay, block_size=16)
    refs = blockwise_backward(q, k, v, do, decay, block_size=16)[:3]
    for name, mine, ref in zip(("dq", "dk", "dv"), grads, refs):
        assert relative_error(mine, ref) <= RTOL, name


def test_autograd_function_and_strided_inputs():
    # (batch, n, heads, d) tensors viewed as (batch, heads, n, d): the wrapper must not assume contiguity.
    q, k, v = random_qkv(1, 3, 29, 16, 32, seed=7)
    do = np.random.default_rng(8).standard_normal(v.shape)
    decay = torch.tensor([1.0, 0.8, 0.05])
    leaves = [_t(x.transpose(0, 2, 1, 3)).requires_grad_() for x in (q, k, v)]
    o = la1_attention(*(x.transpose(1, 2) for x in leaves), decay, block_size=16)
    o.backward(_t(do))
    assert relative_error(o, causal_linear_masked(q, k, v, decay)) <= RTOL
    refs = blockwise_backward(q, k, v, do, decay.numpy())[:3]
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, refs):
        assert relative_error(leaf.grad.transpose(1, 2), ref) <= RTOL, name


def test_tiny_decay_long_distance_stays_finite():
    # lambda = 0.05 over 100 tokens is 0.05^99 ~ 1e-129, far below fp32's range. A kernel that built the
    # mask as lambda^i * lambda^-j (a negative power, 0.05^-99 ~ 1e129 > fp32 max) would give inf * 0 = NaN.
    q, k, v = random_qkv(1, 1, 100, 16, 16, seed=3)
    o = la1_forward(_t(q), _t(k), _t(v), 0.05, block_size=16)
    assert torch.isfinite(o).all()
    assert relative_error(o, causal_linear_masked(q, k, v, 0.05)) <= RTOL


def test_fp16_inputs_in_the_interpreter():
    # fp16 operands, fp32 accumulation: the error is fp16 rounding of q, k, v and of the score tile (~5e-4).
    q, k, v = random_qkv(1, 2, 37, 16, 16, seed=11)
    q16, k16, v16 = (torch.tensor(x, dtype=torch.float16) for x in (q, k, v))
    o = la1_forward(q16, k16, v16, [1.0, 0.9], block_size=16)
    assert o.dtype == torch.float16
    ref = causal_linear_masked(*(x.double().numpy() for x in (q16, k16, v16)), [1.0, 0.9])
    assert relative_error(o, ref) <= 2e-3


def test_arguments_are_checked():
    x = torch.zeros(1, 1, 4, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        la1_forward(x, x, x)
    y = x.float()
    with pytest.raises(ValueError, match="power of two >= 16"):
        la1_forward(y, y, y, block_size=8)
    with pytest.raises(ValueError, match="decay must lie in"):
        la1_forward(y, y, y, decay=1.5)
    with pytest.raises(ValueError, match="d_k, d_v <= 256"):
        la1_forward(y, y, torch.zeros(1, 1, 4, 512, device=DEVICE))
    with pytest.raises(ValueError, match="v must match q in seq_len"):
        la1_forward(y, y, torch.zeros(1, 1, 5, 16, device=DEVICE))


def test_la1_cost_by_hand_and_its_checks():
    from lightning_edu.perf.costs import la1_cost

    # n = 4, B = 2, d = 1: t = 2 blocks, 3 block pairs, each 2 dots of 2 x 2 x 1 for QK^T and PV: 2*2*2*(1+1) = 16.
    c = la1_cost(4, 1, 1, 2)
    assert c["pairs"] == 3 and c["flops"] == 3 * 16
    # bytes: Q_i in and O_i out per query block (2 * 2 * 2 elements) + K_j, V_j per pair (3 * 2 * 2), bf16.
    assert c["hbm_bytes"] == (2 * 2 * 2 + 3 * 2 * 2) * 2
    assert la1_cost(4, 1, 1, 2, batch=2, heads=3)["flops"] == 6 * 3 * 16
    for bad in ({"batch": 0}, {"heads": True}, {"dtype_bytes": 2.0}):
        with pytest.raises((TypeError, ValueError), match=list(bad)[0]):
            la1_cost(4, 1, 1, 2, **bad)


def test_la1_refuses_heads_wider_than_it_was_tested_for():
    q = torch.zeros(1, 1, 16, 256)
    with pytest.raises(ValueError, match=r"la1 supports d_k, d_v <= 128"):
        la1_forward(q, q, q[..., :16], 0.9)
