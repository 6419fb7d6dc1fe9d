"""The recompute-heavy backward kernel (lightning_edu.triton_kernels.la3) against float64 Algorithm 2; its argument
checks; and the backend's choice of backward.

Each case runs on one device (tests/kernel_cases.py): "cpu" in Triton's CPU interpreter, fp32 and fp16, small
shapes with explicit tiles and segment lengths; "cuda" on a GPU, every tile choice of the chapter-09 sweep in bf16
(the forward's saved segment states given), and the shared-memory claim read from the compiled kernels.

The reference is float64 Algorithm 2 in numpy on the *same rounded* inputs. Bounds (relative Frobenius error, per
dtype), BOUNDS below, those of tests/triton_kernels/test_triton_la2.py: fp32 1e-5 (IEEE fp32 dots), fp16 5e-3 and bf16 2e-2
(16-bit dot operands and 16-bit copies of the fp32 states; gradients rounded to the input dtype).
"""

import numpy as np
import pytest
import torch
from kernel_cases import cases, compiled, kernel_inputs, on
from kernel_cases import to_numpy64 as _np

import lightning_edu as le
from lightning_edu.checks import random_qkv, relative_error
from lightning_edu.numpy_blockwise import blockwise_backward
from benchmarks.la3_sweep import TILES
from lightning_edu.triton_kernels import VARIANTS, backward_kernel, log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward
from lightning_edu.triton_kernels.la3 import la3_backward, la3_dkdv, la3_tiles

BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DECAYS = np.array([1.0, 0.999, 1e-3])  # the cuda cases' decays, the first `heads` of them



CPU_CASES = [  # (batch, heads, n, d_k, d_v), decays, tiles: la3 computes its own segment states
    ((1, 2, 37, 16, 32), [1.0, 0.9], dict(chunk=32, micro=16, seg_len=None)),
    ((2, 1, 150, 32, 16), [0.05], dict(chunk=64, micro=16, seg_len=64)),
    ((1, 2, 130, 16, 16), [0.999, 1e-3], dict(chunk=64, micro=32, seg_len=None)),
    ((1, 1, 1, 16, 16), [0.5], dict(chunk=16, micro=16, seg_len=None)),
    ((1, 1, 200, 16, 16), [0.9], dict(chunk=32, micro=32, seg_len=64)),
]
GPU_SHAPES = [  # every tile choice of TILES, given the forward's saved segment states
    (2, 3, 1000, 64, 64), (1, 3, 4099, 128, 128), (1, 2, 333, 128, 64), (1, 3, 77, 16, 32),
    # 64-row micro-chunks fault here on Triton 3.6 (an H100), so la3_dkdv takes 16-row ones.
    (2, 3, 517, 64, 32),
]


@cases("shape,decays,tiles,from_forward,dtype", {
    "cpu": [(shape, decays, tiles, False, torch.float32) for shape, decays, tiles in CPU_CASES],
    "cuda": [(shape, list(DECAYS[:shape[1]]), TILES[name], True, torch.bfloat16)
             for name in sorted(TILES) for shape in GPU_SHAPES],
})
def test_la3_backward_matches_algorithm2(device, shape, decays, tiles, from_forward, dtype):
    q, k, v, do, s0, dsn = kernel_inputs(shape, device, dtype)
    lam = np.array(decays)
    l2 = log2_decay_tensor(lam, device)

    def backward():
        saved = la2_fast_forward(q, k, v, l2, s0, save_states=True)[2] if from_forward else None
        return la3_backward(q, k, v, do, l2, s0, dsn, saved=saved, **tiles)

    grads = compiled(device, backward)
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert got.dtype == (torch.float32 if name == "d_state" else dtype), name
        assert relative_error(got, want) < BOUNDS[dtype], name


@on("cpu")
def test_la3_backward_in_fp16_returns_fp16_within_its_bound(device):
    q, k, v = random_qkv(1, 2, 90, 32, 32, seed=3)
    do = np.random.default_rng(4).standard_normal(v.shape)
    t = [torch.tensor(x, dtype=torch.float16, device=device) for x in (q, k, v, do)]
    ref = blockwise_backward(*(_np(x) for x in t), [0.9, 1.0])
    got = la3_backward(*t, log2_decay_tensor([0.9, 1.0], device))
    for g, r in zip(got[:3], ref[:3]):
        assert g.dtype == torch.float16 and relative_error(g, r) < BOUNDS[torch.float16]


@on("cpu")
def test_backend_uses_la3_for_16_bit_inputs_with_equal_head_dims_up_to_d64_and_its_gradients_are_right(device):
    assert backward_kernel(64, 64, torch.bfloat16) == "la3"
    assert backward_kernel(64, 32, torch.float16) == "la2_fast"  # la3 was measured at d_k = d_v only
    assert backward_kernel(128, 64, torch.bfloat16) == "la2_fast"
    assert backward_kernel(64, 64, torch.float32) == "la2_fast"
    assert VARIANTS["la3"][1] is la3_backward and VARIANTS["la2_fast"][1] is la2_fast_backward
    q, k, v = random_qkv(1, 2, 70, 32, 32, seed=5)
    do = np.random.default_rng(6).standard_normal(v.shape)
    leaves = [torch.tensor(x, dtype=torch.float16, device=device).requires_grad_() for x in (q, k, v)]
    o = le.lightning_attention(*leaves, [0.8, 1.0], backend="triton")
    o.backward(torch.tensor(do, dtype=torch.float16, device=device))
    ref = blockwise_backward(*(_np(x) for x in leaves), do.astype(np.float16).astype(np.float64), [0.8, 1.0])
    for leaf, r in zip(leaves, ref):
        assert leaf.grad.dtype == torch.float16 and relative_error(leaf.grad, r) < BOUNDS[torch.float16]


@cases("d,dtype", {"cuda": [(d, dtype) for d in (64, 128) for dtype in (torch.bfloat16, torch.float32)]},
       same_worker=lambda case: "la3 fp32 d=128" if case == (128, torch.float32) else None)  # as test_triton_la2's
def test_every_la3_kernel_fits_in_99_kib_of_shared_memory(device, d, dtype):
    from lightning_edu.triton_kernels.resources import SM120_SHARED_LIMIT, compiled_resources
    from lightning_edu.triton_kernels import kernel_config

    q, k, v, do, s0, dsn = kernel_inputs((1, 2, 700, d, d), device, dtype, seed=1)
    l2 = log2_decay_tensor(DECAYS[:2], device)
    cfg = kernel_config(d, d, dtype)  # the backend's tiles on a GPU: 16-row blocks for fp32
    records = compiled_resources(lambda: compiled(device, la3_backward, q, k, v, do, l2, s0, dsn, seg_len=256, **cfg),
                                 fresh=True)
    kernels = {r["kernel"] for r in records}
    assert {"_segment_state_kernel", "_la2_fast_forward_kernel", "_la3_dkdv_kernel"} <= kernels, kernels
    for r in records:
        assert r["shared"] <= SM120_SHARED_LIMIT, r


def test_la3_tiles_by_dtype():
    assert la3_tiles(torch.bfloat16) == la3_tiles(torch.float16) == dict(chunk=64, micro=64, num_warps=4, num_stages=1)
    # fp32: c = C = 16 (no micro-chunk pairs to unroll); above d = 64 the fp32 state spills, 8 warps spill less
    for d in (16, 64, 65, 128):
        tiles = la3_tiles(torch.float32, d)
        assert (tiles["chunk"], tiles["micro"], tiles["num_warps"]) == (16, 16, 4 if d <= 64 else 8)
    assert la3_tiles(torch.bfloat16, 128) == la3_tiles(torch.bfloat16)


@pytest.mark.parametrize("chunk,micro,message", [
    (48, 16, "chunk must be a power of two"), (64, 8, "micro must be a power of two"),
    (32, 64, "chunk must be a multiple of micro"),
])
def test_la3_dkdv_refuses_bad_tiles(chunk, micro, message):
    x = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match=message):
        la3_dkdv(x, x, x, x, torch.zeros(1), chunk=chunk, micro=micro)


@on()
def test_la3_refuses_head_dims_above_128_and_the_registry_says_so_first(device):
    x = torch.zeros(1, 1, 8, 256, device=device)
    with pytest.raises(ValueError, match="la3 supports d_k, d_v <= 128"):
        la3_backward(x, x, x, x, torch.zeros(1, device=device))
    from lightning_edu import registry
    from lightning_edu.validation import validate_attention_args

    args = validate_attention_args(x, x, x, 1.0, backend="triton", do=x)
    with pytest.raises(ValueError, match="triton.la3"):
        registry.check_supports(registry.get("triton.la3"), args, backward=True)


@on("cpu")
def test_la3_refuses_bf16_in_the_interpreter(device):
    x = torch.zeros(1, 1, 8, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="bfloat16"):
        la3_backward(x, x, x, x, torch.zeros(1))
