"""Lightning Attention-2 Triton kernels under the CPU interpreter (fp32 only: its bf16 is wrong).

Every variant, forward and backward, against the float64 numpy rung (Algorithms 1-2), on odd shapes.
Tolerance 1e-5 relative: fp32 products with IEEE (not tf32) dots land near 1e-7.
"""

import numpy as np
import pytest
import torch

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_backward, blockwise_forward
from lightning_edu.triton_kernels import VARIANTS, log2_decay_tensor

TOL = 1e-5

SHAPES = [  # batch, heads, n, d_k, d_v, decay per head, segment length (None: automatic)
    (1, 2, 1, 16, 16, [1.0, 0.5], None),
    (1, 2, 37, 16, 32, [0.9, 0.05], None),
    (2, 1, 100, 32, 16, [1.0], 32),
    (1, 2, 130, 16, 48, [0.999, 1e-3], 48),
]


def _inputs(batch, heads, n, d_k, d_v, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, n, d_k, generator=g) for _ in range(2))
    v, do = (torch.randn(batch, heads, n, d_v, generator=g) for _ in range(2))
    s0, dsn = (torch.randn(batch, heads, d_k, d_v, generator=g) for _ in range(2))
    return q, k, v, do, s0, dsn


@pytest.mark.parametrize("variant", sorted(VARIANTS) + ["la2_fast_fused_bwd"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"n{s[2]}-dk{s[3]}-dv{s[4]}")
def test_variant_matches_float64_blockwise(variant, shape):
    batch, heads, n, d_k, d_v, decay, seg_len = shape
    q, k, v, do, s0, dsn = _inputs(batch, heads, n, d_k, d_v)
    lam = np.array(decay)
    forward, backward = VARIANTS[variant.replace("_fused_bwd", "")]
    fwd_extra = {"seg_len": seg_len} if variant.startswith("la2_fast") else {}
    bwd_extra = dict(fwd_extra, fused_dkdv=True) if variant == "la2_fast_fused_bwd" else fwd_extra
    l2 = log2_decay_tensor(lam, "cpu")
    o, sn = forward(q, k, v, l2, s0, block=16, **fwd_extra)
    grads = backward(q, k, v, do, l2, s0, dsn, block=16, **bwd_extra)
    ro, rs = blockwise_forward(q.numpy(), k.numpy(), v.numpy(), lam, 16, s0.numpy())
    ref = blockwise_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), lam, 16, s0.numpy(), dsn.numpy())
    assert relative_error(o, ro) < TOL
    assert relative_error(sn, rs) < TOL
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert relative_error(got, want) < TOL, name


def test_backend_autograd_matches_numpy_with_state_and_block_size():
    q, k, v, do, s0, dsn = _inputs(1, 2, 45, 16, 32, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    o, sn = le.lightning_attention(*leaves[:3], [0.95, 0.3], backend="triton", block_size=16,
                                   initial_state=leaves[3], return_state=True)
    assert o.dtype == torch.float32 and sn.dtype == torch.float32
    ((o * do).sum() + (sn * dsn).sum()).backward()
    lam = np.array([0.95, 0.3])
    ref = blockwise_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), lam, 16, s0.numpy(), dsn.numpy())
    for leaf, want in zip(leaves, ref):
        assert relative_error(leaf.grad, want) < TOL


def test_backend_unused_final_state_and_backward_entry_point():
    q, k, v, do, _, _ = _inputs(1, 1, 33, 16, 16, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = le.lightning_attention(*leaves, 0.7, backend="triton", block_size=16)
    (o * do).sum().backward()
    dq, dk, dv = le.lightning_attention_backward(q, k, v, do, 0.7, backend="triton", block_size=16)
    ref = le.lightning_attention_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), 0.7, backend="numpy")
    for leaf, mine, want in zip(leaves, (dq, dk, dv), ref):
        assert relative_error(leaf.grad, want) < TOL
        assert relative_error(mine, want) < TOL


def test_sequence_length_is_not_a_compile_time_constant():
    from lightning_edu.triton_kernels.la2_fast import _la2_fast_forward_kernel

    q, k, v, *_ = _inputs(1, 1, 70, 16, 16, seed=3)
    for n in (70, 41, 23):
        out = le.lightning_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], 0.9, backend="triton", block_size=16)
        want = le.lightning_attention(*(x[:, :, :n].double().numpy() for x in (q, k, v)), 0.9)
        assert relative_error(out, want) < TOL
    import inspect

    params = inspect.signature(_la2_fast_forward_kernel.fn).parameters
    assert params["n"].annotation is inspect.Parameter.empty  # a runtime argument
    assert "constexpr" in str(params["BLOCK"].annotation)  # while tile sizes are compile-time


@pytest.mark.parametrize("bad", [8, 24, 100])
def test_triton_block_size_must_be_a_power_of_two_tile(bad):
    q, k, v, *_ = _inputs(1, 1, 8, 16, 16)
    with pytest.raises(ValueError, match="block_size for backend='triton' must be a power of two >= 16"):
        le.lightning_attention(q, k, v, backend="triton", block_size=bad)


def test_literal_refuses_heads_it_cannot_hold_on_chip():
    from lightning_edu.triton_kernels.la2_literal import la2_literal_backward, la2_literal_forward

    q, k, v, do, _, _ = _inputs(1, 1, 4, 256, 16)
    l2 = log2_decay_tensor([0.9], "cpu")
    with pytest.raises(ValueError, match=r"la2_literal supports d_k, d_v <= 128 .* got d_k=256, d_v=16"):
        la2_literal_forward(q, k, v, l2)
    with pytest.raises(ValueError, match=r"la2_literal supports d_k, d_v <= 128"):
        la2_literal_backward(q, k, v, do, l2)


@pytest.mark.parametrize("seg_len", [None, 32, 48])
def test_backward_reusing_the_forwards_segment_states(seg_len):
    from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward

    q, k, v, do, s0, dsn = _inputs(2, 2, 100, 16, 32, seed=4)
    lam = np.array([0.97, 0.2])
    l2 = log2_decay_tensor(lam, "cpu")
    o, sn, saved = la2_fast_forward(q, k, v, l2, s0, block=16, seg_len=seg_len, save_states=True)
    assert saved[1].shape[:2] == (4, -(-100 // saved[0])) and saved[1].shape[1] > 1
    grads = la2_fast_backward(q, k, v, do, l2, s0, dsn, block=16, seg_len=seg_len, saved=saved)
    ref = blockwise_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), lam, 16, s0.numpy(), dsn.numpy())
    assert relative_error(o, blockwise_forward(q.numpy(), k.numpy(), v.numpy(), lam, 16, s0.numpy())[0]) < TOL
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert relative_error(got, want) < TOL, name


def test_one_segment_saves_nothing():
    from lightning_edu.triton_kernels.la2_fast import la2_fast_forward

    q, k, v, *_ = _inputs(1, 1, 40, 16, 16, seed=5)
    _, _, (seg_len, incoming) = la2_fast_forward(q, k, v, log2_decay_tensor([0.9], "cpu"), block=16, seg_len=48,
                                                 save_states=True)
    assert seg_len == 48 and incoming is None


def test_log2_decay_is_built_once_per_device_and_values():
    from lightning_edu.triton_kernels import log2_decay_tensor

    a = log2_decay_tensor([0.5, 1.0], "cpu")
    assert a.tolist() == [-1.0, 0.0] and a.dtype == torch.float32
    assert log2_decay_tensor(np.array([0.5, 1.0]), torch.device("cpu")) is a  # no new host-to-device copy
    assert log2_decay_tensor([0.25, 1.0], "cpu") is not a
