"""The recompute-heavy backward kernel (lightning_edu.triton_kernels.la3) in the CPU interpreter, fp32 and fp16,
against float64 Algorithm 2; its argument checks; and the backend's choice of backward. The same kernels on a
GPU, every tile choice and the shared-memory claim: tests/gpu/test_gpu_la3.py."""

import numpy as np
import pytest
import torch

import lightning_edu as le
from lightning_edu.checks import random_qkv, relative_error
from lightning_edu.numpy_blockwise import blockwise_backward
from lightning_edu.triton_kernels import backward_kernel, log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import la2_fast_backward
from lightning_edu.triton_kernels.la3 import la3_backward, la3_dkdv, la3_tiles

CASES = [  # batch, heads, n, d_k, d_v, decays, chunk, micro, seg_len
    (1, 2, 37, 16, 32, [1.0, 0.9], 32, 16, None),
    (2, 1, 150, 32, 16, [0.05], 64, 16, 64),
    (1, 2, 130, 16, 16, [0.999, 1e-3], 64, 32, None),
    (1, 1, 1, 16, 16, [0.5], 16, 16, None),
    (1, 1, 200, 16, 16, [0.9], 32, 32, 64),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[2]}-C{c[6]}-c{c[7]}-seg{c[8]}")
def test_la3_backward_matches_algorithm2(case):
    batch, heads, n, d_k, d_v, decay, chunk, micro, seg_len = case
    q, k, v, s0 = random_qkv(batch, heads, n, d_k, d_v, seed=n, state=True)
    rng = np.random.default_rng(n + 1)
    do, dsn = rng.standard_normal(v.shape), rng.standard_normal(s0.shape)
    ref = blockwise_backward(q, k, v, do, decay, initial_state=s0, d_final_state=dsn)
    t = [torch.tensor(x, dtype=torch.float32) for x in (q, k, v, do, s0, dsn)]
    got = la3_backward(*t[:4], log2_decay_tensor(decay, "cpu"), t[4], t[5], chunk=chunk, micro=micro, seg_len=seg_len)
    for name, g, r in zip(("dq", "dk", "dv", "d_state"), got, ref):
        assert g.dtype == torch.float32
        assert relative_error(g, r) < 1e-5, name


def test_la3_backward_in_fp16_returns_fp16_within_its_bound():
    q, k, v = random_qkv(1, 2, 90, 32, 32, seed=3)
    do = np.random.default_rng(4).standard_normal(v.shape)
    t = [torch.tensor(x, dtype=torch.float16) for x in (q, k, v, do)]
    ref = blockwise_backward(*(x.double().numpy() for x in t), [0.9, 1.0])
    got = la3_backward(*t, log2_decay_tensor([0.9, 1.0], "cpu"))
    for g, r in zip(got[:3], ref[:3]):
        assert g.dtype == torch.float16 and relative_error(g, r) < 5e-3


def test_backend_uses_la3_for_16_bit_inputs_with_equal_head_dims_up_to_d64_and_its_gradients_are_right():
    assert backward_kernel(64, 64, torch.bfloat16) is la3_backward
    assert backward_kernel(64, 32, torch.float16) is la2_fast_backward  # la3 was measured at d_k = d_v only
    assert backward_kernel(128, 64, torch.bfloat16) is la2_fast_backward
    assert backward_kernel(64, 64, torch.float32) is la2_fast_backward
    q, k, v = random_qkv(1, 2, 70, 32, 32, seed=5)
    do = np.random.default_rng(6).standard_normal(v.shape)
    leaves = [torch.tensor(x, dtype=torch.float16).requires_grad_() for x in (q, k, v)]
    o = le.lightning_attention(*leaves, [0.8, 1.0], backend="triton")
    o.backward(torch.tensor(do, dtype=torch.float16))
    ref = blockwise_backward(*(x.detach().double().numpy() for x in leaves), do.astype(np.float16).astype(np.float64),
                             [0.8, 1.0])
    for leaf, r in zip(leaves, ref):
        assert leaf.grad.dtype == torch.float16 and relative_error(leaf.grad, r) < 5e-3


def test_la3_tiles_by_dtype():
    assert la3_tiles(torch.bfloat16) == la3_tiles(torch.float16) == dict(chunk=64, micro=64, num_warps=4, num_stages=1)
    assert la3_tiles(torch.float32)["micro"] == 16


@pytest.mark.parametrize("chunk,micro,message", [
    (48, 16, "chunk must be a power of two"), (64, 8, "micro must be a power of two"),
    (32, 64, "chunk must be a multiple of micro"),
])
def test_la3_dkdv_refuses_bad_tiles(chunk, micro, message):
    x = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match=message):
        la3_dkdv(x, x, x, x, torch.zeros(1), chunk=chunk, micro=micro)


def test_la3_refuses_head_dims_above_128_and_the_registry_says_so_first():
    x = torch.zeros(1, 1, 8, 256)
    with pytest.raises(ValueError, match="la3 supports d_k, d_v <= 128"):
        la3_backward(x, x, x, x, torch.zeros(1))
    from lightning_edu import registry
    from lightning_edu.validation import validate_attention_args

    args = validate_attention_args(x, x, x, 1.0, backend="triton", do=x)
    with pytest.raises(ValueError, match="triton.la3"):
        registry.check_supports(registry.get("triton.la3"), args, backward=True)


def test_la3_refuses_bf16_in_the_interpreter():
    x = torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16"):
        la3_backward(x, x, x, x, torch.zeros(1))
