"""The Triton decode-step kernel (lightning_edu.triton_kernels.decode) against float64.

Each test runs on one device (tests/kernel_cases.py). "cpu", in Triton's CPU interpreter: single steps with odd head
dims, several state slices per head, in place, 16-bit inputs, non-finite values per head. "cuda", on a GPU: fp32,
fp16 and bf16 inputs with an fp32 state, a decode loop that reproduces one parallel call, the step API, and a
packed batch. On both: the backend's step as the custom op ``lightning_edu::decode_step`` (opcheck, its gradients
against the torch step's, torch.compile(fullgraph=True): aot_eager in the interpreter, Inductor on a GPU), and on
the CPU that a step no gradient can follow launches the kernel alone.

Bounds (relative Frobenius error), BOUNDS below for the output o per input dtype: fp32 1e-5, fp16 3e-3, bf16 2e-2
(cuda only); the fp32 state within the fp32 bound, or 10x it after a 40-step loop. One fp32 step in the interpreter
(a product and a d_k-term sum per element) holds the tighter STEP_BOUND, 1e-6, on o and on the state.
"""

import numpy as np
import pytest
import torch
from kernel_cases import cases, on

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.numpy_blockwise import blockwise_forward
from lightning_edu.triton_kernels import log2_decay_tensor
from lightning_edu.triton_kernels.decode import decode_step

BOUNDS = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
STEP_BOUND = 1e-6


def _case(batch, heads, d_k, d_v, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, heads, d_k)), rng.standard_normal((batch, heads, d_k)),
            rng.standard_normal((batch, heads, d_v)), rng.standard_normal((batch, heads, d_k, d_v)))


def _reference(q, k, v, state, decay):
    lam = np.asarray(decay, dtype=np.float64)[None, :, None, None]
    new = k[..., :, None] * v[..., None, :] + (0.0 if state is None else lam * state)
    return np.einsum("bhk,bhkv->bhv", q, new), new


@cases("shape,block_v,with_state", {
    "cpu": [(shape, block_v, with_state) for with_state in (True, False)
            for shape, block_v in [((2, 3, 5, 7), None), ((1, 2, 64, 128), None), ((1, 1, 16, 300), 64),
                                   ((3, 1, 1, 1), None)]],
})
def test_decode_step_matches_float64(device, shape, block_v, with_state):
    q, k, v, s = _case(*shape, seed=sum(shape))
    decay = [0.9, 1.0, 1e-3][: shape[1]]
    s = s if with_state else None
    o_ref, s_ref = _reference(q, k, v, s, decay)
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    o, new = decode_step(t(q), t(k), t(v), t(s), log2_decay_tensor(decay, device), block_v=block_v)
    assert o.dtype == torch.float32 and new.dtype == torch.float32 and new.shape == s_ref.shape
    assert relative_error(new, s_ref) < STEP_BOUND and relative_error(o, o_ref) < STEP_BOUND


@on("cpu")
def test_decode_step_in_place_overwrites_the_given_state(device):
    q, k, v, s = _case(2, 2, 16, 48, seed=1)
    o_ref, s_ref = _reference(q, k, v, s, [0.5, 0.99])
    state = torch.tensor(s, dtype=torch.float32, device=device)
    o, new = decode_step(*(torch.tensor(x, dtype=torch.float32, device=device) for x in (q, k, v)), state,
                         log2_decay_tensor([0.5, 0.99], device), out_state=state, block_v=16)
    assert new.data_ptr() == state.data_ptr()
    assert relative_error(state, s_ref) < STEP_BOUND and relative_error(o, o_ref) < STEP_BOUND


@on()
def test_a_repeated_step_into_aligned_and_unaligned_states_is_right_each_time(device):
    # A launch names its specialisation (launch_keyed): the out_state's alignment is part of it, so a step written
    # into a state one float off a 16-byte boundary after one into an aligned state (and again: the second time
    # from the kept launch) compiles its own kernel instead of reusing the aligned one's wider stores.
    q, k, v, s = _case(2, 3, 16, 40, seed=4)
    o_ref, s_ref = _reference(q, k, v, s, [0.5, 0.9, 0.99])
    qkv = [torch.tensor(x, dtype=torch.float32, device=device) for x in (q, k, v)]
    state = torch.tensor(s, dtype=torch.float32, device=device)
    log2 = log2_decay_tensor([0.5, 0.9, 0.99], device)
    buffer = torch.empty(state.numel() + 1, dtype=torch.float32, device=device)
    for out_state in [None, buffer[1:].view(state.shape)] * 2:
        o, new = decode_step(*qkv, state, log2, out_state=out_state)
        assert out_state is None or new.data_ptr() == out_state.data_ptr()
        assert relative_error(new, s_ref) < STEP_BOUND and relative_error(o, o_ref) < STEP_BOUND


@on("cpu")
def test_decode_step_in_fp16_keeps_an_fp32_state(device):
    q, k, v, s = _case(1, 2, 32, 32, seed=2)
    t = [torch.tensor(x, dtype=torch.float16, device=device) for x in (q, k, v)]
    o_ref, s_ref = _reference(*(x.double().cpu().numpy() for x in t), s, [0.9, 0.9])
    o, new = decode_step(*t, torch.tensor(s, dtype=torch.float32, device=device), log2_decay_tensor([0.9, 0.9], device))
    assert o.dtype == torch.float16 and new.dtype == torch.float32
    assert relative_error(new, s_ref) < STEP_BOUND and relative_error(o, o_ref) < BOUNDS[torch.float16]


@on("cpu")
def test_a_nan_in_one_head_stays_in_that_head(device):
    q, k, v, s = _case(1, 3, 8, 8, seed=3)
    k[0, 1, 2] = np.nan
    o, new = decode_step(*(torch.tensor(x, dtype=torch.float32, device=device) for x in (q, k, v, s)),
                         log2_decay_tensor([0.9] * 3, device))
    assert torch.isfinite(o[0, [0, 2]]).all() and torch.isfinite(new[0, [0, 2]]).all()
    assert torch.isnan(o[0, 1]).all() and torch.isnan(new[0, 1, 2]).all() and torch.isfinite(new[0, 1, [0, 1, 3]]).all()


@on("cpu")
def test_decode_step_refuses_bf16_in_the_interpreter(device):
    x = torch.zeros(1, 1, 16, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="bfloat16"):
        decode_step(x, x, x, None, torch.zeros(1))


@cases("shape,dtype", {
    "cuda": [(shape, dtype) for shape in [(256, 16, 128, 128), (3, 5, 64, 32), (1, 2, 256, 256), (2, 1, 7, 9)]
             for dtype in BOUNDS],
})
def test_decode_loop_matches_the_parallel_form(device, shape, dtype):
    batch, heads, d_k, d_v = shape
    steps = 40
    g = torch.Generator(device=device).manual_seed(batch + d_k)
    q, k = (torch.randn(batch, heads, steps, d_k, device=device, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(batch, heads, steps, d_v, device=device, generator=g).to(dtype)
    decay = np.linspace(0.9, 1.0, heads)
    l2 = log2_decay_tensor(decay, device)
    state = torch.zeros(batch, heads, d_k, d_v, device=device)
    outs = []
    for t in range(steps):
        o, state = decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state, l2, out_state=state)
        outs.append(o)
    o = torch.stack(outs, dim=2)
    ref_o, ref_s = blockwise_forward(*(x.double().cpu().numpy() for x in (q, k, v)), decay, 16)
    assert o.dtype == dtype and state.dtype == torch.float32
    assert relative_error(o, ref_o) < BOUNDS[dtype] and relative_error(state, ref_s) < BOUNDS[torch.float32] * 10


@cases("dtype", {"cuda": list(BOUNDS)})
def test_step_api_on_cuda_matches_numpy(device, dtype):
    import lightning_edu as le

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 3, 64)) for _ in range(3))
    s = rng.standard_normal((4, 3, 64, 64)) * 0.1
    decay = [0.5, 0.99, 1.0]
    want_o, want_s = le.lightning_attention_step(q, k, v, s, decay)
    cu = [torch.tensor(x, device=device).to(dtype) for x in (q, k, v)]
    o, new = le.lightning_attention_step(*cu, torch.tensor(s, device=device, dtype=torch.float32), decay)
    assert o.dtype == dtype and new.dtype == torch.float32 and o.is_cuda
    q64, k64, v64 = (x.double().cpu().numpy() for x in cu)  # the rounded inputs: only the step's error is measured
    want_o, want_s = le.lightning_attention_step(q64, k64, v64, s, decay)
    assert relative_error(o, want_o) < BOUNDS[dtype] and relative_error(new, want_s) < BOUNDS[torch.float32]


@cases("dtype", {"cuda": [torch.float32, torch.bfloat16]})
def test_packed_batch_on_cuda_equals_one_call_per_sequence(device, dtype):
    import lightning_edu as le

    cu = [0, 5, 5, 70, 200, 201]
    g = torch.Generator(device=device).manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, 201, 64, device=device, generator=g).to(dtype) for _ in range(4))
    decay = [0.9, 1.0]
    o, states = le.lightning_attention(q, k, v, decay, return_state=True, cu_seqlens=cu)
    dq, dk, dv = le.lightning_attention_backward(q, k, v, do, decay, cu_seqlens=cu)
    for i in range(len(cu) - 1):
        a, b = cu[i], cu[i + 1]
        if a == b:
            assert float(states[i].abs().max()) == 0.0
            continue
        piece = lambda x: x[:, :, a:b]  # noqa: E731
        # each sequence alone, by the rung below in float64 (no kernel to compile per sequence length)
        one = [piece(x).double() for x in (q, k, v, do)]
        ref_o, ref_s = le.lightning_attention(*one[:3], decay, return_state=True, backend="torch")
        ref = le.lightning_attention_backward(*one, decay, backend="torch")
        # the state is accumulated in fp32 from products of the dtype's operands: the dtype's bound against float64
        assert relative_error(piece(o), ref_o) < BOUNDS[dtype] and relative_error(states[i:i + 1], ref_s) < BOUNDS[dtype]
        for got, want in zip((dq, dk, dv), ref):
            assert relative_error(piece(got), want) < BOUNDS[dtype]
    with pytest.raises(ValueError, match="cu_seqlens"):
        le.lightning_attention(q, k, v, decay, cu_seqlens=torch.tensor(cu, device=device))


# ---------------------------------------------------------------------------------------------------------------
# The backend's step as the custom op lightning_edu::decode_step: its schema, fake and autograd registration
# (opcheck), its gradients against the torch step's, under torch.compile(fullgraph=True) (aot_eager in the
# interpreter, Inductor on a GPU), and the decoding loop's path, the kernel's launch alone, when nothing needs a
# gradient. (The value of every gradient against float64: tests/test_gradients_everywhere.py.)


def _step_leaves(device, d_k=16, d_v=20, seed=5):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(2, 2, d_k, device=device, generator=g) for _ in range(2))
    v = torch.randn(2, 2, d_v, device=device, generator=g)
    s = torch.randn(2, 2, d_k, d_v, device=device, generator=g)
    lam = torch.tensor([0.9, 0.5], device=device)
    return [x.requires_grad_() for x in (q, k, v, s, lam)]


def _step_loss(backend):
    def loss(q, k, v, s, lam):
        o, new = le.lightning_attention_step(q, k, v, s, lam, backend=backend)
        return (o * o).sum() + (new * new.detach().sin()).sum()  # every output, through non-uniform weights

    return loss


@on()
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "no-state"])
def test_the_step_op_passes_opcheck(device, with_state):
    from lightning_edu.triton_kernels.decode import decode_op

    q, k, v, s, lam = _step_leaves(device)
    l2 = torch.log2(lam.detach().double()).requires_grad_()  # a learnable decay's log2 is float64 (hooks)
    torch.library.opcheck(decode_op, (q, k, v, s if with_state else None, l2))


@cases("compiler", {"cpu": ["aot_eager"], "cuda": ["inductor"]})
def test_the_step_compiles_fullgraph_with_the_torch_steps_gradients(device, compiler):
    leaves = _step_leaves(device)
    eager = torch.autograd.grad(_step_loss("triton")(*leaves), leaves)
    torch_step = torch.autograd.grad(_step_loss("torch")(*leaves), leaves)
    compiled = torch.compile(_step_loss("triton"), backend=compiler, fullgraph=True)  # a graph break raises
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for name, e, t, c in zip(("q", "k", "v", "state", "decay"), eager, torch_step, got):
        assert relative_error(e, t) < STEP_BOUND, name
        assert relative_error(c, e) < STEP_BOUND, name
    with torch.no_grad():  # no gradient to follow: the same bits as eager
        step = lambda *x: le.lightning_attention_step(*x, backend="triton")  # noqa: E731
        for c, e in zip(torch.compile(step, backend=compiler, fullgraph=True)(*leaves), step(*leaves)):
            assert torch.equal(c, e) if compiler == "aot_eager" else relative_error(c, e) < STEP_BOUND


@on("cpu")
def test_the_step_takes_the_op_only_when_a_gradient_can_follow(monkeypatch, device):
    from lightning_edu.triton_kernels import hooks

    calls, op = [], hooks.decode_op
    monkeypatch.setattr(hooks, "decode_op", lambda *inputs: calls.append(True) or op(*inputs))
    leaves = _step_leaves(device)
    plain = [x.detach() for x in leaves]
    with_grad = le.lightning_attention_step(*leaves[:4], plain[4], backend="triton")
    assert calls == [True]
    with torch.no_grad():
        le.lightning_attention_step(*leaves, backend="triton")
    without = le.lightning_attention_step(*plain, backend="triton")
    assert calls == [True]  # grad mode off, or nothing requiring grad: the kernel's launch alone
    assert all(torch.equal(a, b) for a, b in zip(with_grad, without))  # and the same bits either way
