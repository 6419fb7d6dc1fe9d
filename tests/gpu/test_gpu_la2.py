"""Lightning Attention-2 Triton kernels on a real GPU, every variant and dtype, against float64.

The reference is the numpy Algorithm 1-2 rung in float64, fed the *same rounded* inputs, so the bounds
measure the kernels alone: fp32 1e-5 (IEEE fp32 dots), fp16 5e-3 and bf16 2e-2 (16-bit dot operands and a
16-bit copy of the fp32 state in each inter-block product; outputs rounded to the input dtype).
Skipped without CUDA (tests/gpu/conftest.py). Run: python -m pytest tests/gpu
"""

import numpy as np
import pytest
import torch

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_backward, blockwise_forward
from lightning_edu.triton_kernels import VARIANTS, log2_decay_tensor

BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
SHAPES = [  # batch, heads, n, d_k, d_v
    (2, 3, 1, 16, 16),
    (1, 3, 77, 32, 64),
    (2, 2, 1000, 64, 64),
    (1, 3, 333, 128, 128),
    (1, 2, 300, 128, 64),
    (1, 2, 129, 256, 256),
    (1, 2, 4099, 128, 128),
]
DECAYS = np.array([1.0, 0.99, 0.05])


def _case(shape, dtype, seed=0):
    batch, heads, n, d_k, d_v = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) / 2).to(dtype)  # noqa: E731
    q, k, v, do = mk(batch, heads, n, d_k), mk(batch, heads, n, d_k), mk(batch, heads, n, d_v), mk(batch, heads, n, d_v)
    s0, dsn = (torch.randn(batch, heads, d_k, d_v, device="cuda", generator=g) for _ in range(2))
    return q, k, v, do, s0, dsn, DECAYS[:heads]


def _np(x):
    return x.detach().double().cpu().numpy()


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_variant_forward_backward(variant, shape, dtype):
    q, k, v, do, s0, dsn, lam = _case(shape, dtype)
    forward, backward = VARIANTS[variant]
    l2 = log2_decay_tensor(lam, "cuda")
    if variant == "la2_literal" and max(shape[3:]) > 128:
        with pytest.raises(ValueError, match="la2_literal supports d_k, d_v <= 128"):
            forward(q, k, v, l2, s0)
        return
    if variant == "la3" and max(shape[3:]) > 128:
        with pytest.raises(ValueError, match="la3 supports d_k, d_v <= 128"):
            backward(q, k, v, do, l2, s0, dsn)
        return
    block = 32 if max(shape[3:]) > 128 else 64
    o = torch.full_like(v, float("nan"))  # poison: every element must be written
    o, sn = forward(q, k, v, l2, s0, block=block)
    grads = backward(q, k, v, do, l2, s0, dsn, block=block)
    torch.cuda.synchronize()
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    bound = BOUNDS[dtype]
    assert o.dtype == dtype and sn.dtype == torch.float32
    assert relative_error(o, ro) < bound
    assert relative_error(sn, rs) < bound
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert got.dtype == (torch.float32 if name == "d_state" else dtype)
        assert relative_error(got, want) < bound, name


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
def test_backend_auto_picks_triton_and_differentiates(dtype):
    q, k, v, do, s0, dsn, lam = _case((2, 3, 517, 64, 32), dtype, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    o, sn = le.lightning_attention(*leaves[:3], lam, initial_state=leaves[3], return_state=True)
    ((o.float() * do.float()).sum() + (sn * dsn).sum()).backward()
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    bound = BOUNDS[dtype]
    assert relative_error(o, ro) < bound and relative_error(sn, rs) < bound
    for leaf, want in zip(leaves, ref):
        assert relative_error(leaf.grad, want) < bound


def test_decay_near_zero_and_long_sequence_stay_finite():
    q, k, v, do, s0, dsn, _ = _case((1, 2, 20000, 64, 64), torch.bfloat16, seed=2)
    lam = np.array([1e-3, 1.0])
    o = le.lightning_attention(q, k, v, lam)
    assert torch.isfinite(o).all()
    ro = blockwise_forward(_np(q), _np(k), _np(v), lam, 256)[0]
    assert relative_error(o, ro) < BOUNDS[torch.bfloat16]


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 4099, 128, 128), (2, 3, 1000, 64, 32), (1, 2, 20000, 64, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_reusing_forward_segment_states(shape, dtype):
    from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward

    q, k, v, do, s0, dsn, lam = _case(shape, dtype, seed=3)
    l2 = log2_decay_tensor(lam, "cuda")
    o, sn, saved = la2_fast_forward(q, k, v, l2, s0, save_states=True)
    assert saved[1].shape[1] > 1  # long enough to be cut into segments on a 132-SM GPU
    grads = la2_fast_backward(q, k, v, do, l2, s0, dsn, saved=saved)
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert relative_error(got, want) < BOUNDS[dtype], name
