"""The triton backend as torch.library custom ops (``lightning_edu::la2_forward``/``la2_backward``): opcheck, and
torch.compile(fullgraph=True) of a model that calls ``lightning_attention(..., backend="triton")``.

Runs in Triton's CPU interpreter (fp32, small shapes). The compiled runs use backend="aot_eager" (Dynamo and
AOTAutograd, the backward traced through the op's registered autograd formula, no code generation) and, once,
"inductor" (C++ code generation for the ops around the custom op; needs a C++ compiler). The GPU twin is
tests/gpu/test_gpu_compile.py.
"""

import numpy as np
import pytest
import torch

import lightning_edu as le
import lightning_edu.triton_kernels.hooks  # noqa: F401  (the registry's hook, imported outside the compiled region)
from lightning_edu.checks import relative_error
from lightning_edu.triton_kernels import la2_backward, la2_forward, log2_decay_tensor
from lightning_edu.triton_kernels.la2_fast import la2_fast_forward
from lightning_edu.triton_kernels.ops import launch_plan

SHAPE = (1, 2, 40, 16)  # one segment in the interpreter
LONG = (1, 2, 72, 16)  # with block_size=16: three segments, so the saved incoming states are non-empty


def _inputs(shape, seed=0, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    q, k, v = ((torch.randn(b, h, n, d, generator=g) / 2).to(dtype).requires_grad_(grad) for _ in range(3))
    s0 = torch.randn(b, h, d, d, generator=g).requires_grad_(grad)
    return q, k, v, s0


def _log2(decays=(0.9, 0.99), grad=True):
    return log2_decay_tensor(list(decays), "cpu").clone().requires_grad_(grad)


# ---------------------------------------------------------------------------------------------------------
# 1. opcheck: schema (no aliasing, no mutation), autograd registration, fake vs real, AOT dispatch with dynamic
#    shapes (which also compares the gradients, the decay's among them, against eager).


@pytest.mark.parametrize("shape,block_size,with_state", [(SHAPE, None, False), (SHAPE, None, True), (LONG, 16, True)])
def test_opcheck_forward(shape, block_size, with_state):
    q, k, v, s0 = _inputs(shape)
    torch.library.opcheck(la2_forward, (q, k, v, _log2(), s0 if with_state else None, block_size))


@pytest.mark.parametrize("shape,block_size,with_state", [(SHAPE, None, False), (SHAPE, None, True), (LONG, 16, True)])
def test_opcheck_backward(shape, block_size, with_state):
    q, k, v, s0 = _inputs(shape, grad=False)
    l2 = _log2(grad=False)
    s0 = s0 if with_state else None
    o, sn, incoming = la2_forward(q, k, v, l2, s0, block_size)
    assert incoming.shape == ((2, 3, 16, 16) if block_size else (0,))
    do, dsn = torch.randn_like(o), torch.randn_like(sn)
    torch.library.opcheck(la2_backward, (q, k, v, do, l2, s0, dsn, incoming, block_size))
    torch.library.opcheck(la2_backward, (q, k, v, do, l2, s0, None, incoming, block_size))


def test_forward_saves_no_states_when_asked_not_to():
    """save_states=False (inference): the same o and final state, and no segment states written."""
    q, k, v, s0 = _inputs(LONG, grad=False)
    o1, sn1, kept = la2_forward(q, k, v, _log2(grad=False), s0, 16, True)
    o2, sn2, none = la2_forward(q, k, v, _log2(grad=False), s0, 16, False)
    assert kept.shape == (2, 3, 16, 16) and none.shape == (0,)
    assert torch.equal(o1, o2) and torch.equal(sn1, sn2)
    torch.library.opcheck(la2_forward, (q, k, v, _log2(), s0, 16, False),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("grad_mode,leaf_grad,want", [(True, True, True), (False, True, False), (True, False, False)])
def test_backend_saves_states_only_when_a_gradient_can_be_asked_for(monkeypatch, grad_mode, leaf_grad, want):
    import lightning_edu.triton_kernels as tk

    seen = []

    def spy(*args):
        seen.append(args[-1])
        return la2_forward(*args)

    monkeypatch.setattr(tk, "la2_forward", spy)
    q, k, v, _ = _inputs(LONG, grad=leaf_grad)
    with torch.set_grad_enabled(grad_mode):
        tk.triton_attention(q, k, v, [0.9, 0.99], block_size=16)
    assert seen == [want]


def test_opcheck_forward_bfloat16():
    """bf16 off CUDA is computed in fp32 inside the op; the fake must still say o is bf16."""
    q, k, v, s0 = _inputs(SHAPE, dtype=torch.bfloat16)
    torch.library.opcheck(la2_forward, (q, k, v, _log2(), None, None),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_backward_refuses_foreign_incoming():
    q, k, v, s0 = _inputs(LONG, grad=False)
    with pytest.raises(ValueError, match="incoming"):
        la2_backward(q, k, v, torch.zeros_like(v), _log2(grad=False), None, None, torch.empty(0), 16)


@pytest.mark.parametrize("shape,block_size", [((1, 2, 40, 16), None), ((1, 2, 300, 16), None),
                                               ((1, 2, 130, 16), 16), ((2, 3, 70, 96), None)])
def test_launch_plan_is_the_launchers_choice(shape, block_size):
    """The op computes on shapes the segment length la2_fast_forward picks by itself: same segments, same speed."""
    q, k, v, _ = _inputs(shape, grad=False)
    cfg, seg_len, num_seg = launch_plan(q, v, block_size)
    _, _, (own_seg_len, incoming) = la2_fast_forward(q, k, v, _log2([0.9] * shape[1], grad=False), save_states=True,
                                                     **cfg)
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


def _compiled_matches_eager(model, backend, extra=()):
    q, k, v, _ = _inputs(SHAPE)
    compiled = torch.compile(model, backend=backend, fullgraph=True)  # a graph break raises
    o_c, g_c = _grads(compiled, q, k, v, extra)
    o_e, g_e = _grads(model, q, k, v, extra)
    assert relative_error(o_c, o_e) < 1e-6
    for got, want in zip(g_c, g_e):
        assert relative_error(got, want) < 1e-6


@pytest.mark.parametrize("decay", [0.9, [0.9, 0.8]], ids=["float", "list"])
def test_compile_fullgraph_host_decay(decay):
    _compiled_matches_eager(Attention(decay), "aot_eager")


def test_compile_fullgraph_learnable_decay():
    lam = torch.nn.Parameter(torch.tensor([0.9, 0.8]))
    _compiled_matches_eager(Attention(lam), "aot_eager", extra=(lam,))


def test_compile_fullgraph_inductor():
    """Inductor compiles the graph around the opaque op (C++ on this CPU); the decay's gradient (torch ops in the
    op's backward formula) is compiled too."""
    lam = torch.nn.Parameter(torch.tensor([0.9, 0.8]))
    _compiled_matches_eager(Attention(lam), "inductor", extra=(lam,))


def test_compile_fullgraph_state_in_and_out():
    """initial_state in, final state out, both differentiable, under compile."""

    def f(q, k, v, s0):
        o, sn = le.lightning_attention(q, k, v, [0.9, 0.99], backend="triton", initial_state=s0, return_state=True)
        return o.square().sum() + (sn * sn).sum()

    q, k, v, s0 = _inputs(SHAPE)
    loss_c = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, s0)
    g_c = torch.autograd.grad(loss_c, (q, k, v, s0))
    loss_e = f(q, k, v, s0)
    g_e = torch.autograd.grad(loss_e, (q, k, v, s0))
    assert relative_error(loss_c.detach(), loss_e.detach()) < 1e-6
    for got, want in zip(g_c, g_e):
        assert relative_error(got, want) < 1e-6


def test_compile_fullgraph_op_level():
    """Below validation: the backend function itself is one op to Dynamo."""
    from lightning_edu.triton_kernels import triton_attention

    def f(q, k, v, l2):
        o, sn = triton_attention(q, k, v, l2)
        return o, sn

    q, k, v, _ = _inputs(SHAPE, grad=False)
    lam = torch.tensor([0.9, 0.8])
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, lam)
    want = f(q, k, v, lam)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# 3. Eager answers: still the float64 numpy backend's on the same rounded inputs.


@pytest.mark.parametrize("shape,block_size", [(SHAPE, None), (LONG, 16)])
def test_eager_matches_numpy(shape, block_size):
    q, k, v, s0 = _inputs(shape)
    decays = [0.9, 0.99]
    o, sn = le.lightning_attention(q, k, v, decays, backend="triton", initial_state=s0, return_state=True,
                                   block_size=block_size)
    do, dsn = torch.randn_like(o), torch.randn_like(sn)
    torch.autograd.backward((o, sn), (do, dsn))
    n64 = lambda x: x.detach().double().numpy()  # noqa: E731
    o_ref, sn_ref = le.lightning_attention(n64(q), n64(k), n64(v), np.array(decays), backend="numpy",
                                           initial_state=n64(s0), return_state=True)
    grads_ref = le.lightning_attention_backward(n64(q), n64(k), n64(v), n64(do), np.array(decays), backend="numpy",
                                                initial_state=n64(s0), d_final_state=n64(dsn),
                                                return_state_grad=True)
    assert relative_error(n64(o), o_ref) < 1e-5
    assert relative_error(n64(sn), sn_ref) < 1e-5
    for got, want in zip((q.grad, k.grad, v.grad, s0.grad), grads_ref):
        assert relative_error(n64(got), want) < 1e-5
