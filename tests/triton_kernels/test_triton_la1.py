"""Lightning Attention-1 Triton kernels (lightning_edu.triton_kernels.la1): in the CPU interpreter and on CUDA.

Each case runs on one device (tests/kernel_cases.py): "cpu" in Triton's CPU interpreter, fp32 (and one fp16 test)
on small shapes; "cuda" on a GPU in fp32, fp16 and bf16 on larger shapes (every supported head dim, n up to 1000).

References are float64 numpy rungs that share no code with the kernels: the masked left product (forward) and
Algorithm 2 in numpy (backward), computed from the inputs *as rounded to the tested dtype*, so a bound measures the
kernel's arithmetic only. Bounds (relative Frobenius error, per dtype), BOUNDS below:

* fp32: 1e-5. The wrapper asks tl.dot for IEEE fp32 (the interpreter has no tf32; on a GPU "ieee" is asked for
  too), so the only error is fp32 rounding: over the cpu cases' sums of at most ~100 * 32 terms it was measured
  near 2e-7; on the cuda cases it is ~1e-6.
* fp16: 3e-3. Score tiles are rounded to fp16 (unit roundoff 4.9e-4) before the second dot; fp32 accumulators.
  (The interpreter's fp16 forward test holds a tighter 2e-3: its error is fp16 rounding of q, k, v and of the
  score tile, ~5e-4.)
* bf16: 2e-2. The same rounding with bf16's 8-bit mantissa (unit roundoff 3.9e-3); cuda only.
"""

import numpy as np
import pytest
import torch
from kernel_cases import cases, compiled, on, synchronize

from lightning_edu.checks import random_qkv, relative_error
from lightning_edu.numpy_blockwise import blockwise_backward
from lightning_edu.numpy_reference import causal_linear_masked
from lightning_edu.triton_kernels.la1 import la1_attention, la1_forward

BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _decays(heads):
    return ([1.0, 0.05, 0.99] * heads)[:heads]


# (batch, heads, n, d_k, d_v), decay per head, block_size (None: the wrapper's choice).
CPU_CASES = [  # every n ends in a partial block of 16 except n = 1 (a single row)
    ((1, 2, 1, 16, 32), [1.0, 0.05], 16),
    ((2, 2, 17, 32, 16), [0.9, 1.0], 16),
    ((1, 2, 37, 16, 16), [0.05, 0.5], 16),
    ((1, 2, 100, 32, 32), [1.0, 0.99], 16),
]
GPU_SHAPES = [  # odd lengths, d_k != d_v, every supported head dim
    (1, 2, 1, 16, 32),
    (2, 3, 37, 32, 16),
    (1, 2, 130, 64, 128),
    (1, 2, 1000, 128, 64),
]
GPU_CASES = ([(shape, _decays(shape[1]), None) for shape in GPU_SHAPES]
             + [((1, 1, 515, 128, 128), _decays(1), 32), ((1, 2, 300, 64, 64), _decays(2), 16)])


# On the GPU every case runs in bf16, and fp32 and fp16 take every other case each: every dtype meets a one-row
# sequence or a partial block, d_k != d_v and d = 128 (each (case, dtype) compiles six kernels, and the GPU suite
# is bound by its compilations).
GPU_DTYPES = {torch.bfloat16: range(len(GPU_CASES)), torch.float32: range(0, len(GPU_CASES), 2),
              torch.float16: range(1, len(GPU_CASES), 2)}


@cases("shape,decays,block_size,dtype", {
    "cpu": [(*case, torch.float32) for case in CPU_CASES],
    "cuda": [(*GPU_CASES[i], dtype) for dtype, cases_of in GPU_DTYPES.items() for i in cases_of],
})
def test_forward_and_backward_match_float64(device, shape, decays, block_size, dtype):
    batch, heads, n, d_k, d_v = shape
    gen = torch.Generator(device=device).manual_seed(n * 7 + d_k)
    q, k, v = (torch.randn(batch, heads, n, d, device=device, generator=gen).to(dtype) for d in (d_k, d_k, d_v))
    do = torch.randn(batch, heads, n, d_v, device=device, generator=gen).to(dtype)
    decay = torch.tensor(decays)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None  # what a pass that only compiled (kernel_cases.compiled) accumulated
        o = la1_attention(*leaves, decay, block_size=block_size)
        o.backward(do)
        return o

    o = compiled(device, forward_backward)
    synchronize(device)

    q64, k64, v64, do64 = (x.double().cpu().numpy() for x in (q, k, v, do))
    lam = decay.double().numpy()
    bound = BOUNDS[dtype]
    assert o.dtype == dtype and o.shape == (batch, heads, n, d_v)
    err = relative_error(o, causal_linear_masked(q64, k64, v64, lam))
    assert err <= bound, f"o: {err:.2e} > {bound:.0e}"
    refs = blockwise_backward(q64, k64, v64, do64, lam)[:3]
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, refs):
        assert leaf.grad.dtype == dtype
        err = relative_error(leaf.grad, ref)
        assert err <= bound, f"{name}: {err:.2e} > {bound:.0e}"


@on()
def test_autograd_function_and_strided_inputs(device):
    # (batch, n, heads, d) tensors viewed as (batch, heads, n, d): the wrapper must not assume contiguity.
    q, k, v = random_qkv(1, 3, 29, 16, 32, seed=7)
    do = np.random.default_rng(8).standard_normal(v.shape)
    decay = torch.tensor([1.0, 0.8, 0.05])
    t = lambda x: torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    leaves = [t(x.transpose(0, 2, 1, 3)).requires_grad_() for x in (q, k, v)]
    o = la1_attention(*(x.transpose(1, 2) for x in leaves), decay, block_size=16)
    o.backward(t(do))
    assert relative_error(o, causal_linear_masked(q, k, v, decay)) <= BOUNDS[torch.float32]
    refs = blockwise_backward(q, k, v, do, decay.numpy())[:3]
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, refs):
        assert relative_error(leaf.grad.transpose(1, 2), ref) <= BOUNDS[torch.float32], name


@on()
def test_tiny_decay_long_distance_stays_finite(device):
    # lambda = 0.05 over 100 tokens is 0.05^99 ~ 1e-129, far below fp32's range. A kernel that built the
    # mask as lambda^i * lambda^-j (a negative power, 0.05^-99 ~ 1e129 > fp32 max) would give inf * 0 = NaN.
    q, k, v = random_qkv(1, 1, 100, 16, 16, seed=3)
    o = la1_forward(*(torch.tensor(x, dtype=torch.float32, device=device) for x in (q, k, v)), 0.05, block_size=16)
    assert torch.isfinite(o).all()
    assert relative_error(o, causal_linear_masked(q, k, v, 0.05)) <= BOUNDS[torch.float32]


@on("cpu")
def test_fp16_inputs_in_the_interpreter(device):
    # fp16 operands, fp32 accumulation: the error is fp16 rounding of q, k, v and of the score tile (~5e-4).
    q, k, v = random_qkv(1, 2, 37, 16, 16, seed=11)
    q16, k16, v16 = (torch.tensor(x, dtype=torch.float16, device=device) for x in (q, k, v))
    o = la1_forward(q16, k16, v16, [1.0, 0.9], block_size=16)
    assert o.dtype == torch.float16
    ref = causal_linear_masked(*(x.double().cpu().numpy() for x in (q16, k16, v16)), [1.0, 0.9])
    assert relative_error(o, ref) <= 2e-3


@on()
def test_arguments_are_checked(device):
    x = torch.zeros(1, 1, 4, 16, dtype=torch.float64, device=device)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        la1_forward(x, x, x)
    y = x.float()
    with pytest.raises(ValueError, match="power of two >= 16"):
        la1_forward(y, y, y, block_size=8)
    with pytest.raises(ValueError, match="decay must lie in"):
        la1_forward(y, y, y, decay=1.5)
    with pytest.raises(ValueError, match="d_k, d_v <= 256"):
        la1_forward(y, y, torch.zeros(1, 1, 4, 512, device=device))
    with pytest.raises(ValueError, match="v must match q in seq_len"):
        la1_forward(y, y, torch.zeros(1, 1, 5, 16, device=device))


@on("cuda")
def test_la1_sequence_length_is_not_compiled_in(device):
    # One compiled kernel serves every n: new lengths (none a multiple of 16, which Triton specialises on)
    # add no entry to the kernel cache (device_caches[device][0] in Triton 3.6 and 3.7).
    from lightning_edu.triton_kernels.la1 import la1_forward_kernel

    def cached():
        return len(la1_forward_kernel.device_caches[torch.cuda.current_device()][0])

    x = torch.randn(1, 1, 300, 64, device=device, dtype=torch.bfloat16)
    la1_forward(x, x, x, 0.9)
    before = cached()
    assert before >= 1
    for n in (301, 517, 1025):
        x = torch.randn(1, 1, n, 64, device=device, dtype=torch.bfloat16)
        la1_forward(x, x, x, 0.9)
    assert cached() == before


def test_la1_cost_by_hand_and_its_checks():
    from lightning_edu.costs import la1_cost

    # n = 4, B = 2, d = 1: t = 2 blocks, 3 block pairs, each 2 dots of 2 x 2 x 1 for QK^T and PV: 2*2*2*(1+1) = 16.
    c = la1_cost(4, 1, 1, 2)
    assert c["pairs"] == 3 and c["flops"] == 3 * 16
    # bytes: Q_i in and O_i out per query block (2 * 2 * 2 elements) + K_j, V_j per pair (3 * 2 * 2), bf16.
    assert c["hbm_bytes"] == (2 * 2 * 2 + 3 * 2 * 2) * 2
    assert la1_cost(4, 1, 1, 2, batch=2, heads=3)["flops"] == 6 * 3 * 16
    for bad in ({"batch": 0}, {"heads": True}, {"dtype_bytes": 2.0}):
        with pytest.raises((TypeError, ValueError), match=list(bad)[0]):
            la1_cost(4, 1, 1, 2, **bad)


@on()
def test_la1_refuses_heads_wider_than_it_was_tested_for(device):
    q = torch.zeros(1, 1, 16, 256, device=device)
    with pytest.raises(ValueError, match=r"la1 supports d_k, d_v <= 128"):
        la1_forward(q, q, q[..., :16], 0.9)
