"""The backend's custom ops on a real GPU: opcheck on CUDA, and torch.compile(fullgraph=True) with Inductor in bf16.

The CPU twin is tests/test_compile.py. Here the kernels run compiled (no interpreter, bf16 in the kernels), and
Inductor generates Triton code for the ops around the opaque custom op. Compiled and eager runs launch the same
kernels on the same inputs, so they agree to the rounding of what Inductor fuses around them; both are also
checked against the float64 numpy backend at the bf16 bound of tests/gpu/test_gpu_la2.py.
Skipped without CUDA (tests/gpu/conftest.py). Run: python -m pytest tests/gpu
"""

import numpy as np
import pytest
import torch

import lightning_edu as le
import lightning_edu.triton_kernels.hooks  # noqa: F401  (the registry's hook, imported outside the compiled region)
from lightning_edu.checks import relative_error
from lightning_edu.triton_kernels import la2_backward, la2_forward, log2_decay_tensor
from lightning_edu.triton_kernels.ops import launch_plan

BF16_BOUND = 2e-2  # as tests/gpu/test_gpu_la2.py
SHAPES = [(2, 3, 77, 64, 64), (1, 2, 1000, 128, 128)]  # batch, heads, n, d_k, d_v: one segment / several
DECAYS = [0.9, 0.99, 1.0]


def _inputs(shape, dtype=torch.bfloat16, seed=0, grad=True):
    batch, heads, n, d_k, d_v = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) / 2).to(dtype).requires_grad_(grad)  # noqa: E731
    q, k, v = mk(batch, heads, n, d_k), mk(batch, heads, n, d_k), mk(batch, heads, n, d_v)
    s0 = torch.randn(batch, heads, d_k, d_v, device="cuda", generator=g).requires_grad_(grad)
    return q, k, v, s0


def _log2(heads, grad=False):
    return log2_decay_tensor(DECAYS[:heads], "cuda").clone().requires_grad_(grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_opcheck_cuda(shape, dtype, with_state):
    q, k, v, s0 = _inputs(shape, dtype)
    s0 = s0 if with_state else None
    heads = shape[1]
    # Forward: gradients (the decay's too) compared by test_aot_dispatch_dynamic; bf16 within opcheck's bf16
    # tolerances only if the two runs agree bit for bit (they launch the same kernels on the same inputs).
    torch.library.opcheck(la2_forward, (q, k, v, _log2(heads, grad=True), s0, None))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    s0d = None if s0 is None else s0.detach()
    o, sn, incoming = la2_forward(qd, kd, vd, _log2(heads), s0d, None)
    _, _, num_seg = launch_plan(qd, vd)
    assert incoming.shape[0] == (shape[0] * heads if num_seg > 1 else 0)
    torch.library.opcheck(la2_backward, (qd, kd, vd, torch.randn_like(o), _log2(heads), s0d, torch.randn_like(sn),
                                         incoming, None))


class Attention(torch.nn.Module):
    def __init__(self, decay):
        super().__init__()
        self.decay = decay

    def forward(self, q, k, v, s0):
        o, sn = le.lightning_attention(q, k, v, self.decay, backend="triton", initial_state=s0, return_state=True)
        return o, sn


def _run(model, q, k, v, s0, extra=()):
    leaves = (q, k, v, s0, *extra)
    for x in leaves:
        x.grad = None
    o, sn = model(q, k, v, s0)
    (o.float().square().sum() + sn.square().sum()).backward()
    return [o.detach(), sn.detach()], [x.grad.clone() for x in leaves]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("decay", ["float", "list", "cuda_tensor"])
def test_compile_fullgraph_inductor_bf16(shape, decay):
    heads = shape[1]
    lam = None
    if decay == "float":
        model = Attention(0.95)
    elif decay == "list":
        model = Attention(DECAYS[:heads])
    else:
        lam = torch.nn.Parameter(torch.tensor(DECAYS[:heads], device="cuda"))
        model = Attention(lam)
    extra = () if lam is None else (lam,)
    q, k, v, s0 = _inputs(shape)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)  # a graph break raises
    outs_c, grads_c = _run(compiled, q, k, v, s0, extra)
    outs_e, grads_e = _run(model, q, k, v, s0, extra)
    for got, want in zip(outs_c + grads_c, outs_e + grads_e):
        assert got.dtype == want.dtype
        assert relative_error(got.float(), want.float()) < 1e-2  # the same kernels; Inductor rounds the glue


@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_bf16_matches_numpy(shape):
    """The compiled backend's answers against float64 on the same rounded inputs (bf16 bound)."""
    heads = shape[1]
    decays = DECAYS[:heads]
    q, k, v, s0 = _inputs(shape)
    compiled = torch.compile(Attention(decays), backend="inductor", fullgraph=True)
    o, sn = compiled(q, k, v, s0)
    do, dsn = torch.randn_like(o), torch.randn_like(sn)
    torch.autograd.backward((o, sn), (do, dsn))
    n64 = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    o_ref, sn_ref = le.lightning_attention(n64(q), n64(k), n64(v), np.array(decays), backend="numpy",
                                           initial_state=n64(s0), return_state=True)
    grads_ref = le.lightning_attention_backward(n64(q), n64(k), n64(v), n64(do), np.array(decays), backend="numpy",
                                                initial_state=n64(s0), d_final_state=n64(dsn),
                                                return_state_grad=True)
    assert o.dtype == torch.bfloat16 and sn.dtype == torch.float32
    assert relative_error(n64(o), o_ref) < BF16_BOUND
    assert relative_error(n64(sn), sn_ref) < BF16_BOUND
    for got, want in zip((q.grad, k.grad, v.grad, s0.grad), grads_ref):
        assert relative_error(n64(got), want) < BF16_BOUND
