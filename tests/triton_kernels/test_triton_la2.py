"""Lightning Attention-2 Triton kernels, every variant, forward and backward, against float64.

Each case runs on one device (tests/kernel_cases.py): "cpu" in Triton's CPU interpreter, fp32 only (its bf16 is
wrong), small odd shapes with 16-row blocks and explicit segment lengths; "cuda" on a GPU in fp32, fp16 and bf16,
odd shapes up to n = 20000 and d = 256 with the kernels' own tiles.

The reference is the numpy Algorithm 1-2 rung in float64, fed the *same rounded* inputs, so the bounds measure the
kernels alone. Bounds (relative Frobenius error, per dtype), BOUNDS below:

* fp32: 1e-5. IEEE fp32 (not tf32) dots; in the interpreter the error lands near 1e-7.
* fp16: 5e-3 and bf16: 2e-2 (cuda only). 16-bit dot operands and a 16-bit copy of the fp32 state in each
  inter-block product; outputs rounded to the input dtype.
"""

import numpy as np
import pytest
import torch
from kernel_cases import cases, compiled, kernel_inputs, on, synchronize
from kernel_cases import to_numpy64 as _np

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_backward, blockwise_forward
from lightning_edu.numpy_reference import causal_linear_recurrent
from lightning_edu.triton_kernels import VARIANTS, log2_decay_tensor

BOUNDS = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DECAYS = np.array([1.0, 0.99, 0.05])  # the cuda cases' decays, the first `heads` of them



def _shape_id(shape):
    return "x".join(map(str, shape))


# cpu: (batch, heads, n, d_k, d_v), decay per head, segment length (None: automatic); 16-row blocks.
CPU_SHAPES = [
    ((1, 2, 1, 16, 16), [1.0, 0.5], None),
    ((1, 2, 37, 16, 32), [0.9, 0.05], None),
    ((2, 1, 100, 32, 16), [1.0], 32),
    ((1, 2, 130, 16, 48), [0.999, 1e-3], 48),
]
GPU_SHAPES = [  # batch, heads, n, d_k, d_v; decays DECAYS[:heads]; each launcher's own tiles (the backend's)
    (2, 3, 1, 16, 16),
    (1, 3, 77, 32, 64),
    (2, 2, 1000, 64, 64),
    (1, 3, 333, 128, 128),
    (1, 2, 300, 128, 64),
    (1, 2, 129, 256, 256),
    (1, 2, 4099, 128, 128),
]
LA3_FP32_D128 = "la3 fp32 d=128"  # its dK/dV kernel compiles for about two minutes: the cases that need it share it
# fp32 on the GPU at four of them (one token; d_k != d_v at an odd length; many segments at d = 128; d = 256):
# exact fp32 dots compile to long runs of scalar multiply-adds (tens of seconds per kernel), and the interpreter
# checks fp32 at every CPU shape.
GPU_FP32_SHAPES = [GPU_SHAPES[i] for i in (0, 1, 5, 6)]
# fp16 and bf16 take turns over the shapes: both are 16-bit dot operands with a float32 accumulator, and what differs
# between them (the rounding, hence the bound) is seen at a small, a long and a wide shape each; every shape is still
# run in 16 bits, and compiling the other 16-bit dtype at every shape too would double the cases' compile time.
GPU_HALF = {shape: (torch.float16, torch.bfloat16)[i % 2] for i, shape in enumerate(GPU_SHAPES)}


# What each tested kernel is, said once (no variant name is parsed): its forward and backward launchers, whether
# they take a segment length, and its backward's options. la2_fast with the fused dK/dV backward is measured
# (chapter 08) but is not a VARIANTS entry of its own.
KERNELS = {
    "la2_literal": (*VARIANTS["la2_literal"], False, {}),
    "la2_fast": (*VARIANTS["la2_fast"], True, {}),
    "la2_fast_fused_bwd": (*VARIANTS["la2_fast"], True, {"fused_dkdv": True}),
    "la3": (*VARIANTS["la3"], False, {}),
}


def test_every_variant_is_tested():
    assert set(VARIANTS) <= set(KERNELS), f"untested variants: {sorted(set(VARIANTS) - set(KERNELS))}"


@cases("variant,shape,decays,block,seg_len,dtype", {
    "cpu": [(variant, shape, decays, 16, seg_len, torch.float32)
            for variant in sorted(KERNELS) for shape, decays, seg_len in CPU_SHAPES],
    "cuda": [(variant, shape, list(DECAYS[:shape[1]]), None, None, dtype)
             for variant in sorted(VARIANTS) for shape in GPU_SHAPES for dtype in BOUNDS
             if dtype == GPU_HALF[shape] or dtype == torch.float32 and shape in GPU_FP32_SHAPES],
}, same_worker=lambda case: LA3_FP32_D128 if (case[0], case[1][3], case[-1]) == ("la3", 128, torch.float32) else None)
def test_variant_forward_backward(device, variant, shape, decays, block, seg_len, dtype):
    q, k, v, do, s0, dsn = kernel_inputs(shape, device, dtype)
    lam = np.array(decays)
    forward, backward, segmented, backward_options = KERNELS[variant]
    l2 = log2_decay_tensor(lam, device)
    if variant == "la2_literal" and max(shape[3:]) > 128:
        with pytest.raises(ValueError, match="la2_literal supports d_k, d_v <= 128"):
            forward(q, k, v, l2, s0)
        return
    if variant == "la3" and max(shape[3:]) > 128:
        with pytest.raises(ValueError, match="la3 supports d_k, d_v <= 128"):
            backward(q, k, v, do, l2, s0, dsn)
        return
    fwd_extra = dict({"seg_len": seg_len} if segmented else {}, **({} if block is None else {"block": block}))
    bwd_extra = dict(fwd_extra, **backward_options)
    (o, sn), grads = compiled(device, lambda: (forward(q, k, v, l2, s0, **fwd_extra),
                                               backward(q, k, v, do, l2, s0, dsn, **bwd_extra)))
    synchronize(device)
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    bound = BOUNDS[dtype]
    assert o.dtype == dtype and sn.dtype == torch.float32
    assert relative_error(o, ro) < bound
    assert relative_error(sn, rs) < bound
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert got.dtype == (torch.float32 if name == "d_state" else dtype)
        assert relative_error(got, want) < bound, name


@cases("shape,decays,backend,block_size,dtype", {
    "cpu": [((1, 2, 45, 16, 32), [0.95, 0.3], "triton", 16, torch.float32)],
    "cuda": [((2, 3, 517, 64, 32), list(DECAYS), "auto", None, dtype) for dtype in BOUNDS],  # auto picks triton
})
def test_backend_differentiates_with_state(device, shape, decays, backend, block_size, dtype):
    q, k, v, do, s0, dsn = kernel_inputs(shape, device, dtype, seed=1)
    lam = np.array(decays)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    o, sn = le.lightning_attention(*leaves[:3], lam, backend=backend, block_size=block_size,
                                   initial_state=leaves[3], return_state=True)
    assert o.dtype == dtype and sn.dtype == torch.float32
    ((o.float() * do.float()).sum() + (sn * dsn).sum()).backward()
    ro, rs = blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    bound = BOUNDS[dtype]
    assert relative_error(o, ro) < bound and relative_error(sn, rs) < bound
    for leaf, want in zip(leaves, ref):
        assert relative_error(leaf.grad, want) < bound


@on("cpu")
def test_backend_unused_final_state_and_backward_entry_point(device):
    q, k, v, do, _, _ = kernel_inputs((1, 1, 33, 16, 16), device, seed=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = le.lightning_attention(*leaves, 0.7, backend="triton", block_size=16)
    (o * do).sum().backward()
    dq, dk, dv = le.lightning_attention_backward(q, k, v, do, 0.7, backend="triton", block_size=16)
    ref = le.lightning_attention_backward(_np(q), _np(k), _np(v), _np(do), 0.7, backend="numpy")
    for leaf, mine, want in zip(leaves, (dq, dk, dv), ref):
        assert relative_error(leaf.grad, want) < BOUNDS[torch.float32]
        assert relative_error(mine, want) < BOUNDS[torch.float32]


@on("cpu")
def test_sequence_length_is_not_a_compile_time_constant(device):
    from lightning_edu.triton_kernels.la2_fast import _la2_fast_forward_kernel

    q, k, v, *_ = kernel_inputs((1, 1, 70, 16, 16), device, seed=3)
    for n in (70, 41, 23):
        out = le.lightning_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], 0.9, backend="triton", block_size=16)
        want = le.lightning_attention(*(_np(x[:, :, :n]) for x in (q, k, v)), 0.9)
        assert relative_error(out, want) < BOUNDS[torch.float32]
    import inspect

    params = inspect.signature(_la2_fast_forward_kernel.fn).parameters
    assert params["n"].annotation is inspect.Parameter.empty  # a runtime argument
    assert "constexpr" in str(params["BLOCK"].annotation)  # while tile sizes are compile-time


@on()
@pytest.mark.parametrize("bad", [8, 24, 100])
def test_triton_block_size_must_be_a_power_of_two_tile(device, bad):
    q, k, v, *_ = kernel_inputs((1, 1, 8, 16, 16), device)
    with pytest.raises(ValueError, match="block_size for backend='triton' must be a power of two >= 16"):
        le.lightning_attention(q, k, v, backend="triton", block_size=bad)


def test_literal_refuses_heads_it_cannot_hold_on_chip():
    from lightning_edu.triton_kernels.la2_literal import la2_literal_backward, la2_literal_forward

    q, k, v, do, _, _ = kernel_inputs((1, 1, 4, 256, 16), "cpu")
    l2 = log2_decay_tensor([0.9], "cpu")
    with pytest.raises(ValueError, match=r"la2_literal supports d_k, d_v <= 128 .* got d_k=256, d_v=16"):
        la2_literal_forward(q, k, v, l2)
    with pytest.raises(ValueError, match=r"la2_literal supports d_k, d_v <= 128"):
        la2_literal_backward(q, k, v, do, l2)


@cases("shape,decays,block,seg_len,dtype", {
    "cpu": [((2, 2, 100, 16, 32), [0.97, 0.2], 16, seg_len, torch.float32) for seg_len in (None, 32, 48)]
    # fp16: the pre-passes stream 32-row blocks (prepass_tiles), not the 16-row blocks of the passes they feed
    + [((2, 2, 100, 16, 32), [0.97, 0.2], 16, 64, torch.float16)],
    "cuda": [(shape, list(DECAYS[:shape[1]]), None, None, dtype)  # la2_fast_forward's own block and segments
             for shape in [(1, 2, 4099, 128, 128), (2, 3, 1000, 64, 32), (1, 2, 20000, 64, 64)] for dtype in BOUNDS],
})
def test_backward_reusing_the_forwards_segment_states(device, shape, decays, block, seg_len, dtype):
    from lightning_edu.triton_kernels.la2_fast import la2_fast_backward, la2_fast_forward

    batch, heads, n = shape[:3]
    q, k, v, do, s0, dsn = kernel_inputs(shape, device, dtype, seed=3)
    lam = np.array(decays)
    l2 = log2_decay_tensor(lam, device)
    tiles = {} if block is None else {"block": block}

    def forward_backward():
        o, sn, saved = la2_fast_forward(q, k, v, l2, s0, seg_len=seg_len, save_states=True, **tiles)
        return o, saved, la2_fast_backward(q, k, v, do, l2, s0, dsn, seg_len=seg_len, saved=saved, **tiles)

    o, saved, grads = compiled(device, forward_backward)
    # Long enough to be cut into segments (in the interpreter; on a 132-SM GPU): one incoming state per segment.
    assert saved[1].shape[:2] == (batch * heads, -(-n // saved[0])) and saved[1].shape[1] > 1
    synchronize(device)
    ref = blockwise_backward(_np(q), _np(k), _np(v), _np(do), lam, 64, _np(s0), _np(dsn))
    bound = BOUNDS[dtype]
    assert relative_error(o, blockwise_forward(_np(q), _np(k), _np(v), lam, 64, _np(s0))[0]) < bound
    for name, got, want in zip(("dq", "dk", "dv", "d_state"), grads, ref):
        assert relative_error(got, want) < bound, name


@on("cpu")
def test_one_segment_saves_nothing(device):
    from lightning_edu.triton_kernels.la2_fast import la2_fast_forward

    q, k, v, *_ = kernel_inputs((1, 1, 40, 16, 16), device, seed=5)
    _, _, (seg_len, incoming) = la2_fast_forward(q, k, v, log2_decay_tensor([0.9], device), block=16, seg_len=48,
                                                 save_states=True)
    assert seg_len == 48 and incoming is None


@cases("shape,dtype", {
    "cpu": [((2, 2, 100, 32, 64), torch.float32)],  # the sliced plan's tiles, given explicitly
    "cuda": [((4, 16, 1000, 128, 128), torch.bfloat16), ((4, 16, 1000, 64, 64), torch.bfloat16)],  # the public call's
})
def test_a_forward_as_one_segment_of_32_column_slices(device, shape, dtype):
    """plan.sliced_forward's plan: with no backward to follow, d_v in 32-column slices and no pre-pass."""
    from lightning_edu.triton_kernels import ops
    from lightning_edu.triton_kernels.la2_fast import backend_tiles, la2_fast_forward, sliced_plan

    q, k, v, _, s0, _ = kernel_inputs(shape, device, dtype, seed=7)
    lam = np.linspace(0.9, 0.9999, shape[1])
    lam[0] = 1.0
    ref = blockwise_forward(_np(q), _np(k), _np(v), lam, 64)[0]
    if device == "cpu":
        n = shape[2]
        o, _ = compiled(device, lambda: la2_fast_forward(q, k, v, log2_decay_tensor(lam, device), block=16,
                                                         block_dv=32, num_warps=4, num_stages=3,
                                                         seg_len=-(-n // 16) * 16))
        assert relative_error(o, ref) < BOUNDS[dtype]
        assert sliced_plan(q, v, backend_tiles(q, v)[0]) is None  # the interpreter keeps its segments
        return
    plan = sliced_plan(q, v, backend_tiles(q, v)[0])
    if plan is None:
        pytest.skip(f"this GPU's {torch.cuda.get_device_properties(0).multi_processor_count} SMs do not call for it")
    cfg, seg_len, num_seg = ops.launch_plan(q, v, None, save_states=False)
    assert (cfg["block_dv"], cfg["num_stages"], seg_len, num_seg) == (*plan, 1)
    assert ops.launch_plan(q, v, None, save_states=True)[2] > 1  # with a backward to follow: segments
    with torch.no_grad():
        o = le.lightning_attention(q, k, v, lam, backend="triton")
    assert relative_error(o, ref) < BOUNDS[dtype]


@on("cuda")
def test_decay_near_zero_and_long_sequence_stay_finite(device):
    q, k, v, do, s0, dsn = kernel_inputs((1, 2, 20000, 64, 64), device, torch.bfloat16, seed=2)
    lam = np.array([1e-3, 1.0])
    o = le.lightning_attention(q, k, v, lam)
    assert torch.isfinite(o).all()
    ro = blockwise_forward(_np(q), _np(k), _np(v), lam, 256)[0]
    assert relative_error(o, ro) < BOUNDS[torch.bfloat16]


def test_log2_decay_is_built_once_per_device_and_values():
    from lightning_edu.triton_kernels import log2_decay_tensor

    a = log2_decay_tensor([0.5, 1.0], "cpu")
    assert a.tolist() == [-1.0, 0.0] and a.dtype == torch.float32
    assert log2_decay_tensor(np.array([0.5, 1.0]), torch.device("cpu")) is a  # no new host-to-device copy
    assert log2_decay_tensor([0.25, 1.0], "cpu") is not a


@on("cpu")
@pytest.mark.parametrize("reverse", [False, True])
def test_the_prepass_sums_each_segment_in_either_order(device, monkeypatch, reverse):
    # Each segment's local state, sum over its positions p (in processing order) of lambda^(end-1-p) k_p^T v_p,
    # against float64, with the pre-pass summing from the segment's start (Horner) and from its end
    # (the setting prepass_tail_first); float16 sums from the start whatever the setting (its operands would lose
    # the small powers), so both settings give it the same bits.
    from lightning_edu.triton_kernels import la2_fast
    from lightning_edu.triton_kernels.plan import override

    heads, n, d_k, d_v, block, seg_len = 2, 100, 16, 32, 16, 48
    lam = np.array([0.93, 0.3])
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, heads, n, d_k, generator=gen), torch.randn(1, heads, n, d_v, generator=gen)
    log2_decay = torch.tensor(np.log2(lam), dtype=torch.float32)
    num_seg = -(-n // seg_len)

    def states(dtype, tail_first):
        seg = torch.zeros(heads, num_seg, d_k, d_v)
        with override(prepass_tail_first=tail_first):
            la2_fast.segment_states(k.to(dtype), v.to(dtype), log2_decay, seg, seg_len, block, 32, 4, 2, reverse)
        return seg[:, : num_seg - 1].double().numpy()  # the last segment's state is never needed, nor written

    k64, v64 = _np(k), _np(v)
    if reverse:
        k64, v64 = k64[:, :, ::-1], v64[:, :, ::-1]
    want = np.zeros((heads, num_seg - 1, d_k, d_v))
    for j in range(num_seg - 1):  # segment j's state: the float64 recurrence over its rows, from zero
        rows = slice(j * seg_len, (j + 1) * seg_len)
        _, state = causal_linear_recurrent(k64[:, :, rows], k64[:, :, rows], v64[:, :, rows], lam, return_state=True)
        want[:, j] = state[0]
    start, tail = states(torch.float32, False), states(torch.float32, True)
    for name, got in (("start first", start), ("tail first", tail)):
        err = relative_error(got, want)
        assert err < 1e-6, f"{name}: {err:.1e}"
    assert not np.array_equal(start, tail)  # the same sum, rounded in another order
    assert np.array_equal(states(torch.float16, False), states(torch.float16, True))

