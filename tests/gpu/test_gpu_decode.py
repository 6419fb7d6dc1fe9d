"""The decode-step kernel on a real GPU, fp32/fp16/bf16 inputs with an fp32 state, against float64; and a decode
loop that reproduces one parallel call. Skipped without CUDA (tests/gpu/conftest.py)."""

import numpy as np
import pytest
import torch

from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_forward
from lightning_edu.triton_kernels import log2_decay_tensor
from lightning_edu.triton_kernels.decode import decode_step

BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
@pytest.mark.parametrize("shape", [(256, 16, 128, 128), (3, 5, 64, 32), (1, 2, 256, 256), (2, 1, 7, 9)],
                         ids=lambda s: "x".join(map(str, s)))
def test_decode_loop_matches_the_parallel_form(shape, dtype):
    batch, heads, d_k, d_v = shape
    steps = 40
    g = torch.Generator(device="cuda").manual_seed(batch + d_k)
    q, k = (torch.randn(batch, heads, steps, d_k, device="cuda", generator=g).to(dtype) for _ in range(2))
    v = torch.randn(batch, heads, steps, d_v, device="cuda", generator=g).to(dtype)
    decay = np.linspace(0.9, 1.0, heads)
    l2 = log2_decay_tensor(decay, "cuda")
    state = torch.zeros(batch, heads, d_k, d_v, device="cuda")
    outs = []
    for t in range(steps):
        o, state = decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state, l2, out_state=state)
        outs.append(o)
    o = torch.stack(outs, dim=2)
    ref_o, ref_s = blockwise_forward(*(x.double().cpu().numpy() for x in (q, k, v)), decay, 16)
    assert o.dtype == dtype and state.dtype == torch.float32
    assert relative_error(o, ref_o) < BOUNDS[dtype] and relative_error(state, ref_s) < BOUNDS[torch.float32] * 10
