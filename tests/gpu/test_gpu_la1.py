"""Lightning Attention-1 Triton kernels on CUDA: fp32, fp16 and bf16 against float64 ground truth.

The reference is computed in float64 numpy from the inputs *as rounded to the tested dtype*, so the bound
measures the kernel's arithmetic only. Bounds (relative Frobenius error, per dtype):

* fp32: 1e-5. The wrapper asks tl.dot for IEEE fp32 (no tf32), so the error is fp32 rounding (~1e-6).
* fp16: 3e-3. Score tiles are rounded to fp16 (unit roundoff 4.9e-4) before the second dot; fp32 accumulators.
* bf16: 2e-2. The same rounding with bf16's 8-bit mantissa (unit roundoff 3.9e-3).
"""

import numpy as np
import pytest
import torch

from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_backward
from lightning_edu.numpy_reference import causal_linear_masked
from lightning_edu.triton_kernels.la1 import la1_attention

pytestmark = pytest.mark.gpu

BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SHAPES = [  # (batch, heads, n, d_k, d_v): odd lengths, d_k != d_v, every supported head dim
    (1, 2, 1, 16, 32),
    (2, 3, 37, 32, 16),
    (1, 2, 130, 64, 128),
    (1, 2, 1000, 128, 64),
]


CASES = [(shape, None) for shape in SHAPES] + [((1, 1, 515, 128, 128), 32), ((1, 2, 300, 64, 64), 16)]


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
@pytest.mark.parametrize("shape,block_size", CASES, ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple) else f"B{x}")
def test_la1_forward_backward_on_gpu(shape, dtype, block_size):
    batch, heads, n, d_k, d_v = shape
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + d_k)
    q, k, v = (torch.randn(batch, heads, n, d, device="cuda", generator=gen).to(dtype) for d in (d_k, d_k, d_v))
    do = torch.randn(batch, heads, n, d_v, device="cuda", generator=gen).to(dtype)
    decay = torch.tensor(([1.0, 0.05, 0.99] * heads)[:heads])
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = la1_attention(*leaves, decay, block_size=block_size)
    o.backward(do)
    torch.cuda.synchronize()

    q64, k64, v64, do64 = (x.double().cpu().numpy() for x in (q, k, v, do))
    lam = decay.double().numpy()
    bound = BOUNDS[dtype]
    assert o.dtype == dtype
    err = relative_error(o, causal_linear_masked(q64, k64, v64, lam))
    assert err <= bound, f"o: {err:.2e} > {bound:.0e}"
    refs = blockwise_backward(q64, k64, v64, do64, lam)[:3]
    for name, leaf, ref in zip(("dq", "dk", "dv"), leaves, refs):
        assert leaf.grad.dtype == dtype
        err = relative_error(leaf.grad, ref)
        assert err <= bound, f"{name}: {err:.2e} > {bound:.0e}"


def test_la1_sequence_length_is_not_compiled_in():
    # One compiled kernel serves every n: new lengths (none a multiple of 16, which Triton specialises on)
    # add no entry to the kernel cache (device_caches[device][0] in Triton 3.6 and 3.7).
    from lightning_edu.triton_kernels.la1 import la1_forward, la1_forward_kernel

    def cached():
        return len(la1_forward_kernel.device_caches[torch.cuda.current_device()][0])

    x = torch.randn(1, 1, 300, 64, device="cuda", dtype=torch.bfloat16)
    la1_forward(x, x, x, 0.9)
    before = cached()
    assert before >= 1
    for n in (301, 517, 1025):
        x = torch.randn(1, 1, n, 64, device="cuda", dtype=torch.bfloat16)
        la1_forward(x, x, x, 0.9)
    assert cached() == before
