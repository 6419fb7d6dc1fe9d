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


@pytest.mark.parametrize("dtype", list(BOUNDS), ids=str)
def test_step_api_on_cuda_matches_numpy(dtype):
    import lightning_edu as le

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 3, 64)) for _ in range(3))
    s = rng.standard_normal((4, 3, 64, 64)) * 0.1
    decay = [0.5, 0.99, 1.0]
    want_o, want_s = le.lightning_attention_step(q, k, v, s, decay)
    cu = [torch.tensor(x, device="cuda").to(dtype) for x in (q, k, v)]
    o, new = le.lightning_attention_step(*cu, torch.tensor(s, device="cuda", dtype=torch.float32), decay)
    assert o.dtype == dtype and new.dtype == torch.float32 and o.is_cuda
    q64, k64, v64 = (x.double().cpu().numpy() for x in cu)  # the rounded inputs: only the step's error is measured
    want_o, want_s = le.lightning_attention_step(q64, k64, v64, s, decay)
    assert relative_error(o, want_o) < BOUNDS[dtype] and relative_error(new, want_s) < BOUNDS[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_batch_on_cuda_equals_one_call_per_sequence(dtype):
    import lightning_edu as le

    cu = [0, 5, 5, 70, 200, 201]
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, 201, 64, device="cuda", generator=g).to(dtype) for _ in range(4))
    decay = [0.9, 1.0]
    o, states = le.lightning_attention(q, k, v, decay, return_state=True, cu_seqlens=cu)
    dq, dk, dv = le.lightning_attention_backward(q, k, v, do, decay, cu_seqlens=cu)
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        if a == b:
            assert float(states[i].abs().max()) == 0.0
            continue
        piece = lambda x: x[:, :, a:b]  # noqa: E731
        ref_o, ref_s = le.lightning_attention(piece(q), piece(k), piece(v), decay, return_state=True)
        ref = le.lightning_attention_backward(piece(q), piece(k), piece(v), piece(do), decay)
        assert relative_error(piece(o), ref_o) < BOUNDS[dtype] and relative_error(states[i:i + 1], ref_s) < 1e-5
        for got, want in zip((dq, dk, dv), ref):
            assert relative_error(piece(got), want) < BOUNDS[dtype]
    with pytest.raises(ValueError, match="cu_seqlens"):
        le.lightning_attention(q, k, v, decay, cu_seqlens=torch.tensor(cu, device="cuda"))
