"""The triton backend as torch.library custom ops (``lightning_edu::la2_forward``/``la2_backward``): opcheck, and
torch.compile(fullgraph=True) of a model that calls ``lightning_attention(..., backend="triton")``.

Each test runs on one device (tests/kernel_cases.py):

* "cpu": Triton's CPU interpreter (fp32, small shapes). The compiled runs use backend="aot_eager" (Dynamo and
  AOTAutograd, the backward traced through the op's registered autograd formula, no code generation) and, once,
  "inductor" (C++ code generation for the ops around the custom op; needs a C++ compiler).
* "cuda": the kernels compiled on a GPU (no interpreter, bf16 in the kernels): opcheck on CUDA, and
  torch.compile(fullgraph=True) with Inductor in bf16, which generates Triton code for the ops around the opaque
  custom op.

Compiled and eager runs launch the same kernels on the same inputs, so they agree to the rounding of what is
computed around them (COMPILED_VS_EAGER); both are also checked against the float64 numpy backend on the same
rounded inputs at the bounds of tests/triton_kernels/test_triton_la2.py (BOUNDS).
"""

import numpy as np
import pytest
import torch
from kernel_cases import cases, on

import lightning_edu as le
import lightning_edu.triton_kernels.hooks  # noqa: F401  (the registry's hook, imported outside the compiled region)
from lightning_edu.checks import relative_error
from lightning_edu.triton_kernels import la2_backward, la2_forward, log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import la2_fast_forward
from lightning_edu.triton_kernels.ops import launch_plan

# Against float64 numpy on the same rounded inputs, per dtype: tests/triton_kernels/test_triton_la2.py's bounds.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
# Compiled against eager, the same kernels on the same inputs: in fp32 in the interpreter they agree to 1e-6; in bf16
# on a GPU Inductor rounds the glue it fuses around the op (1e-2).
COMPILED_VS_EAGER = {torch.float32: 1e-6, torch.bfloat16: 1e-2}

SHAPE = (1, 2, 40, 16)  # cpu: one segment in the interpreter
LONG = (1, 2, 72, 16)  # cpu: with block_size=16, three segments, so the saved incoming states are non-empty
GPU_SHAPES = [(2, 3, 77, 64, 64), (1, 2, 1000, 128, 128)]  # batch, heads, n, d_k, d_v: one segment / several
GPU_DECAYS = [0.9, 0.99, 1.0]  # the first `heads` of them


def _inputs(shape, seed=0, dtype=torch.float32, grad=True, device="cpu"):
    """q, k, v (halved standard normals, rounded to dtype) and s0 (fp32) from a seeded generator on ``device``.
    ``shape``: (batch, heads, n, d) or (batch, heads, n, d_k, d_v)."""
    batch, heads, n, d_k, d_v = shape if len(shape) == 5 else (*shape, shape[-1])
    g = torch.Generator(device=device).manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, device=device, generator=g) / 2).to(dtype).requires_grad_(grad)  # noqa: E731
    q, k, v = mk(batch, heads, n, d_k), mk(batch, heads, n, d_k), mk(batch, heads, n, d_v)
    s0 = torch.randn(batch, heads, d_k, d_v, device=device, generator=g).requires_grad_(grad)
    return q, k, v, s0


def _log2(decays=(0.9, 0.99), grad=True, device="cpu"):
    return log2_decay_tensor(list(decays), device).clone().requires_grad_(grad)


# ---------------------------------------------------------------------------------------------------------
# 1. opcheck: schema (no aliasing, no mutation), autograd registration, fake vs real, AOT dispatch with dynamic
#    shapes (which also compares the gradients, the decay's among them, against eager).


@on("cpu")
@pytest.mark.parametrize("shape,block_size,with_state", [(SHAPE, None, False), (SHAPE, None, True), (LONG, 16, True)])
def test_opcheck_forward(device, shape, block_size, with_state):
    q, k, v, s0 = _inputs(shape, device=device)
    torch.library.opcheck(la2_forward, (q, k, v, _log2(device=device), s0 if with_state else None, block_size))


@on("cpu")
@pytest.mark.parametrize("shape,block_size,with_state", [(SHAPE, None, False), (SHAPE, None, True), (LONG, 16, True)])
def test_opcheck_backward(device, shape, block_size, with_state):
    q, k, v, s0 = _inputs(shape, grad=False, device=device)
    l2 = _log2(grad=False, device=device)
    s0 = s0 if with_state else None
    o, sn, incoming = la2_forward(q, k, v, l2, s0, block_size)
    assert incoming.shape == ((2, 3, 16, 16) if block_size else (0,))
    do, dsn = torch.randn_like(o), torch.randn_like(sn)
    torch.library.opcheck(la2_backward, (q, k, v, do, l2, s0, dsn, incoming, block_size))
    torch.library.opcheck(la2_backward, (q, k, v, do, l2, s0, None, incoming, block_size))


@on("cpu")
def test_forward_saves_no_states_when_asked_not_to(device):
    """save_states=False (inference): the same o and final state, and no segment states written."""
    q, k, v, s0 = _inputs(LONG, grad=False, device=device)
    o1, sn1, kept = la2_forward(q, k, v, _log2(grad=False, device=device), s0, 16, True)
    o2, sn2, none = la2_forward(q, k, v, _log2(grad=False, device=device), s0, 16, False)
    assert kept.shape == (2, 3, 16, 16) and none.shape == (0,)
    assert torch.equal(o1, o2) and torch.equal(sn1, sn2)
    torch.library.opcheck(la2_forward, (q, k, v, _log2(device=device), s0, 16, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@on("cpu")
@pytest.mark.parametrize("grad_mode,leaf_grad,want", [(True, True, True), (False, True, False), (True, False, False)])
def test_backend_saves_states_only_when_a_gradient_can_be_asked_for(monkeypatch, device, grad_mode, leaf_grad, want):
    """Every door (the op, the eager Function, an inference call) runs ops.forward_impl: the spy sits there."""
    import lightning_edu.triton_kernels as tk
    from lightning_edu.triton_kernels import ops

    seen = []
    impl = ops.forward_impl

    def spy(*args):
        seen.append(args[-1])
        return impl(*args)

    monkeypatch.setattr(ops, "forward_impl", spy)
    q, k, v, _ = _inputs(LONG, grad=leaf_grad, device=device)
    with torch.set_grad_enabled(grad_mode):
        tk.triton_attention(q, k, v, [0.9, 0.99], block_size=16)
    assert seen == [want]


@on("cpu")
def test_opcheck_forward_bfloat16(device):
    """bf16 off CUDA is computed in fp32 inside the op; the fake must still say o is bf16."""
    q, k, v, s0 = _inputs(SHAPE, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(la2_forward, (q, k, v, _log2(device=device), None, None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_backward_refuses_foreign_incoming():
    q, k, v, s0 = _inputs(LONG, grad=False)
    with pytest.raises(ValueError, match="incoming"):
        la2_backward(q, k, v, torch.zeros_like(v), _log2(grad=False), None, None, torch.empty(0), 16)


@on("cpu")
@pytest.mark.parametrize("shape,block_size", [((1, 2, 40, 16), None), ((1, 2, 300, 16), None),
                                               ((1, 2, 130, 16), 16), ((2, 3, 70, 96), None)])
def test_launch_plan_is_the_launchers_choice(device, shape, block_size):
    """The op computes on shapes the segment length la2_fast_forward picks by itself: same segments, same speed."""
    q, k, v, _ = _inputs(shape, grad=False, device=device)
    cfg, seg_len, num_seg = launch_plan(q, v, block_size)
    _, _, (own_seg_len, incoming) = la2_fast_forward(q, k, v, _log2([0.9] * shape[1], grad=False, device=device),
                                                     save_states=True, **cfg)
    assert seg_len == own_seg_len
    assert (incoming is None) == (num_seg == 1)


# ---------------------------------------------------------------------------------------------------------
# 2. torch.compile(fullgraph=True): no graph break, same output and gradients as eager.


class Attention(torch.nn.Module):
    def __init__(self, decay):
        super().__init__()
        self.decay = decay

    def forward(self, q, k, v):
        return le.lightning_attention(q, k, v, self.decay, backend="triton")


def _grads(fn, q, k, v, extra=()):
    leaves = (q, k, v, *extra)
    for x in leaves:
        x.grad = None
    out = fn(q, k, v)
    out.square().sum().backward()
    return out.detach(), [x.grad.clone() for x in leaves]


def _compiled_matches_eager(model, backend, device, extra=()):
    q, k, v, _ = _inputs(SHAPE, device=device)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break raises
    o_c, g_c = _grads(compiled, q, k, v, extra)
    o_e, g_e = _grads(model, q, k, v, extra)
    bound = COMPILED_VS_EAGER[torch.float32]
    assert relative_error(o_c, o_e) < bound
    for got, want in zip(g_c, g_e):
        assert relative_error(got, want) < bound


@on("cpu")
@pytest.mark.parametrize("decay", [0.9, [0.9, 0.8]], ids=["float", "list"])
def test_compile_fullgraph_host_decay(device, decay):
    _compiled_matches_eager(Attention(decay), "aot_eager", device)


@on("cpu")
def test_compile_fullgraph_learnable_decay(device):
    lam = torch.nn.Parameter(torch.tensor([0.9, 0.8], device=device))
    _compiled_matches_eager(Attention(lam), "aot_eager", device, extra=(lam,))


@on("cpu")
def test_compile_fullgraph_inductor(device):
    """Inductor compiles the graph around the opaque op (C++ on this CPU); the decay's gradient (torch ops in the
    op's backward formula) is compiled too."""
    lam = torch.nn.Parameter(torch.tensor([0.9, 0.8], device=device))
    _compiled_matches_eager(Attention(lam), "inductor", device, extra=(lam,))


@on("cpu")
def test_compile_fullgraph_state_in_and_out(device):
    """initial_state in, final state out, both differentiable, under compile."""

    def f(q, k, v, s0):
        o, sn = le.lightning_attention(q, k, v, [0.9, 0.99], backend="triton", initial_state=s0, return_state=True)
        return o.square().sum() + (sn * sn).sum()

    q, k, v, s0 = _inputs(SHAPE, device=device)
    loss_c = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, s0)
    g_c = torch.autograd.grad(loss_c, (q, k, v, s0))
    loss_e = f(q, k, v, s0)
    g_e = torch.autograd.grad(loss_e, (q, k, v, s0))
    bound = COMPILED_VS_EAGER[torch.float32]
    assert relative_error(loss_c.detach(), loss_e.detach()) < bound
    for got, want in zip(g_c, g_e):
        assert relative_error(got, want) < bound


@on("cpu")
def test_compile_fullgraph_op_level(device):
    """Below validation: the backend function itself is one op to Dynamo."""
    from lightning_edu.triton_kernels import triton_attention

    def f(q, k, v, l2):
        o, sn = triton_attention(q, k, v, l2)
        return o, sn

    q, k, v, _ = _inputs(SHAPE, grad=False, device=device)
    lam = torch.tensor([0.9, 0.8], device=device)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, lam)
    want = f(q, k, v, lam)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# 3. Eager answers: still the float64 numpy backend's on the same rounded inputs.


@on("cpu")
@pytest.mark.parametrize("shape,block_size", [(SHAPE, None), (LONG, 16)])
def test_eager_matches_numpy(device, shape, block_size):
    q, k, v, s0 = _inputs(shape, device=device)
    decays = [0.9, 0.99]
    o, sn = le.lightning_attention(q, k, v, decays, backend="triton", initial_state=s0, return_state=True,
                                   block_size=block_size)
    _assert_matches_numpy(q, k, v, s0, decays, o, sn, BOUNDS[torch.float32])


def _assert_matches_numpy(q, k, v, s0, decays, o, sn, bound):
    """Back-propagate random dO and dSN through (o, sn), then hold o, sn and the gradients of q, k, v, s0 to the
    float64 numpy rung within ``bound``."""
    do, dsn = torch.randn_like(o), torch.randn_like(sn)
    torch.autograd.backward((o, sn), (do, dsn))
    n64 = lambda x: x.detach().double().cpu().numpy()  # noqa: E731
    o_ref, sn_ref = le.lightning_attention(n64(q), n64(k), n64(v), np.array(decays), backend="numpy",
                                           initial_state=n64(s0), return_state=True)
    grads_ref = le.lightning_attention_backward(n64(q), n64(k), n64(v), n64(do), np.array(decays), backend="numpy",
                                                initial_state=n64(s0), d_final_state=n64(dsn),
                                                return_state_grad=True)
    assert relative_error(n64(o), o_ref) < bound
    assert relative_error(n64(sn), sn_ref) < bound
    for got, want in zip((q.grad, k.grad, v.grad, s0.grad), grads_ref):
        assert relative_error(n64(got), want) < bound


# ---------------------------------------------------------------------------------------------------------
# 4. On a GPU: opcheck on CUDA, and torch.compile(fullgraph=True) with Inductor in bf16.


@cases("shape,dtype,with_state", {
    # each shape in each dtype, with and without a state across them (each case compiles its own kernels)
    "cuda": [(shape, dtype, (i + j) % 2 == 1) for j, dtype in enumerate((torch.bfloat16, torch.float32))
             for i, shape in enumerate(GPU_SHAPES)],
})
def test_opcheck_cuda(device, shape, dtype, with_state):
    q, k, v, s0 = _inputs(shape, dtype=dtype, device=device)
    s0 = s0 if with_state else None
    heads = shape[1]
    # Forward: gradients (the decay's too) compared by test_aot_dispatch_dynamic; bf16 within opcheck's bf16
    # tolerances only if the two runs agree bit for bit (they launch the same kernels on the same inputs).
    torch.library.opcheck(la2_forward, (q, k, v, _log2(GPU_DECAYS[:heads], grad=True, device=device), s0, None))
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    s0d = None if s0 is None else s0.detach()
    o, sn, incoming = la2_forward(qd, kd, vd, _log2(GPU_DECAYS[:heads], grad=False, device=device), s0d, None)
    _, _, num_seg = launch_plan(qd, vd)
    assert incoming.shape[0] == (shape[0] * heads if num_seg > 1 else 0)
    torch.library.opcheck(la2_backward, (qd, kd, vd, torch.randn_like(o),
                                         _log2(GPU_DECAYS[:heads], grad=False, device=device), s0d,
                                         torch.randn_like(sn), incoming, None))


class AttentionWithState(torch.nn.Module):
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


@cases("shape,decay", {"cuda": [(shape, decay) for shape in GPU_SHAPES for decay in ("float", "list", "cuda_tensor")]})
def test_compile_fullgraph_inductor_bf16(device, shape, decay):
    heads = shape[1]
    lam = None
    if decay == "float":
        model = AttentionWithState(0.95)
    elif decay == "list":
        model = AttentionWithState(GPU_DECAYS[:heads])
    else:
        lam = torch.nn.Parameter(torch.tensor(GPU_DECAYS[:heads], device=device))
        model = AttentionWithState(lam)
    extra = () if lam is None else (lam,)
    q, k, v, s0 = _inputs(shape, dtype=torch.bfloat16, device=device)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)  # a graph break raises
    outs_c, grads_c = _run(compiled, q, k, v, s0, extra)
    outs_e, grads_e = _run(model, q, k, v, s0, extra)
    for got, want in zip(outs_c + grads_c, outs_e + grads_e):
        assert got.dtype == want.dtype
        # the same kernels; Inductor rounds the glue
        assert relative_error(got.float(), want.float()) < COMPILED_VS_EAGER[torch.bfloat16]


@cases("shape", {"cuda": GPU_SHAPES})
def test_compiled_bf16_matches_numpy(device, shape):
    """The compiled backend's answers against float64 on the same rounded inputs (bf16 bound)."""
    heads = shape[1]
    decays = GPU_DECAYS[:heads]
    q, k, v, s0 = _inputs(shape, dtype=torch.bfloat16, device=device)
    compiled = torch.compile(AttentionWithState(decays), backend="inductor", fullgraph=True)
    o, sn = compiled(q, k, v, s0)
    assert o.dtype == torch.bfloat16 and sn.dtype == torch.float32
    _assert_matches_numpy(q, k, v, s0, decays, o, sn, BOUNDS[torch.bfloat16])
