"""The torch backend (lightning_edu.torch_chunked) against float64 ground truth. (Chapter 06.)

Ground truth comes from three places the backend does not use: the numpy per-token recurrence, the
numpy Algorithm 2, and torch float64 autograd through a masked quadratic form written out below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_edu import lightning_attention, lightning_attention_backward
from lightning_edu import numpy_blockwise, numpy_reference
from lightning_edu import torch_chunked as tc
from lightning_edu.checks import random_qkv, relative_error

SEQ_LENS = (1, 7, 37, 130)
DECAYS = {"one": 1.0, "small": 0.01, "per_head": [1.0, 0.9, 0.01]}


def quadratic_with_state(q, k, v, s0, lam):
    """o = [(Q K^T) * M] V + diag(lambda^(t+1)) Q S0 and the final state, as plain differentiable torch.

    Written from the definition KV_t = sum_(s<=t) lambda^(t-s) k_s^T v_s + lambda^(t+1) S0 (t 0-based),
    with no blocks, so autograd through it is an independent float64 reference for every gradient.
    """
    n = q.shape[2]
    lam = torch.as_tensor(lam, dtype=torch.float64).reshape(-1, 1, 1)  # (heads or 1, 1, 1)
    t = torch.arange(n, dtype=torch.float64)
    gap = t[:, None] - t[None, :]
    mask = torch.where(gap >= 0, lam ** gap.clamp(min=0), torch.zeros(()))
    o = ((q @ k.transpose(-1, -2)) * mask) @ v + (lam ** (t[:, None] + 1)) * (q @ s0)
    final = (lam[..., :1] ** n) * s0 + ((lam ** (n - 1 - t)[:, None]) * k).transpose(-1, -2) @ v
    return o, final


def _inputs(n, heads=3, d_k=5, d_v=4, seed=0, dtype=torch.float64, requires_grad=False):
    q, k, v, s = random_qkv(2, heads, n, d_k, d_v, seed=seed, state=True)
    return [torch.tensor(x, dtype=dtype, requires_grad=requires_grad) for x in (q, k, v, s)]


def _decay(name, heads=3):
    lam = DECAYS[name]
    return lam if np.ndim(lam) == 0 else lam[:heads]


@pytest.mark.parametrize("n", SEQ_LENS)
@pytest.mark.parametrize("decay", sorted(DECAYS))
@pytest.mark.parametrize("block_size", [None, 5, 16])
def test_forward_matches_numpy_recurrence(n, decay, block_size):
    lam = _decay(decay)
    q, k, v, s = _inputs(n, seed=n)
    o_ref, state_ref = numpy_reference.causal_linear_recurrent(
        q.numpy(), k.numpy(), v.numpy(), lam, initial_state=s.numpy(), return_state=True
    )
    for scan in tc.SCANS:
        o, state = tc.chunked_forward(q, k, v, lam, block_size, s, scan=scan)
        assert o.dtype == torch.float64 and o.shape == (2, 3, n, 4)
        assert relative_error(o, o_ref) < 1e-10
        assert relative_error(state, state_ref) < 1e-10
    o_loop, state_loop = tc.loop_forward(q, k, v, lam, block_size, s)
    assert relative_error(o_loop, o_ref) < 1e-10 and relative_error(state_loop, state_ref) < 1e-10
    o_rec, state_rec = tc.recurrent_forward(q, k, v, lam, s)
    assert relative_error(o_rec, o_ref) < 1e-10 and relative_error(state_rec, state_ref) < 1e-10


def test_forward_without_initial_state_matches_masked_quadratic():
    q, k, v, _ = _inputs(37, seed=3)
    lam = [1.0, 0.5, 0.01]
    ref = numpy_reference.causal_linear_masked(q.numpy(), k.numpy(), v.numpy(), lam)
    o, _ = tc.chunked_forward(q, k, v, lam, block_size=6)
    assert relative_error(o, ref) < 1e-10
    assert relative_error(tc.masked_forward(q, k, v, lam), ref) < 1e-10


@pytest.mark.parametrize("n", SEQ_LENS)
@pytest.mark.parametrize("decay", sorted(DECAYS))
def test_gradients_match_autograd_through_quadratic_form(n, decay):
    lam = _decay(decay)
    leaves = _inputs(n, seed=10 + n, requires_grad=True)
    rng = np.random.default_rng(n)
    do = torch.tensor(rng.standard_normal((2, 3, n, 4)))
    d_final = torch.tensor(rng.standard_normal((2, 3, 5, 4)))
    o_ref, final_ref = quadratic_with_state(*leaves, lam)
    ref = torch.autograd.grad((o_ref * do).sum() + (final_ref * d_final).sum(), leaves)
    for block_size in (None, 7):
        for scan in tc.SCANS:
            o, final = tc.chunked_forward(*leaves[:3], lam, block_size, leaves[3], scan=scan)
            assert relative_error(o, o_ref) < 1e-10 and relative_error(final, final_ref) < 1e-10
            got = torch.autograd.grad((o * do).sum() + (final * d_final).sum(), leaves)
            for name, g, r in zip(("dq", "dk", "dv", "d_initial_state"), got, ref):
                assert relative_error(g, r) < 1e-10, (name, block_size, scan)


@pytest.mark.parametrize("n", (7, 130))
def test_backward_matches_numpy_algorithm_2(n):
    lam = [0.99, 1.0, 0.01]
    q, k, v, s = _inputs(n, seed=20 + n)
    rng = np.random.default_rng(20 + n)
    do = torch.tensor(rng.standard_normal((2, 3, n, 4)))
    d_final = torch.tensor(rng.standard_normal((2, 3, 5, 4)))
    ref = numpy_blockwise.blockwise_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), lam, 16, s.numpy(), d_final.numpy())
    got = tc.chunked_backward(q, k, v, do, lam, 11, s, d_final)
    assert [g.dtype for g in got] == [torch.float64] * 4
    for g, r in zip(got, ref):
        assert relative_error(g, r) < 1e-10


def test_gradcheck_float64_with_initial_state():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, d, dtype=torch.float64, requires_grad=True) for d in (3, 3, 2))
    s = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True)
    for scan in tc.SCANS:
        assert torch.autograd.gradcheck(lambda *a: tc.chunked_forward(*a[:3], [0.8, 1.0], 4, a[3], scan=scan), (q, k, v, s))
    assert torch.autograd.gradcheck(lambda *a: tc.chunked_forward(*a, decay=0.3, block_size=2), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", ["one", "per_head"])
def test_half_inputs_within_1e_2_of_float64(dtype, decay):
    lam = _decay(decay)
    q64, k64, v64, s64 = _inputs(130, seed=5)
    q, k, v = (x.to(dtype).requires_grad_() for x in (q64, k64, v64))
    s = s64.to(dtype).requires_grad_()
    # The reference sees the same rounded inputs: what is measured is the error of the computation.
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v, s)]
    o_ref, final_ref = quadratic_with_state(*leaves, lam)
    o, final = tc.chunked_forward(q, k, v, lam, 16, s)
    assert o.dtype == dtype and final.dtype == torch.float32  # the state is kept in float32
    assert relative_error(o, o_ref) < 1e-2 and relative_error(final, final_ref) < 1e-2
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad((o.float() * do.float()).sum() + final.sum(), (q, k, v, s))
    ref = torch.autograd.grad((o_ref * do.double()).sum() + final_ref.sum(), leaves)
    for g, r, x in zip(got, ref, (q, k, v, s)):
        assert g.dtype == x.dtype
        assert relative_error(g, r) < 1e-2


def test_float32_computes_in_float32():
    q, k, v, s = (x.float() for x in _inputs(37, seed=6))
    o, final = tc.chunked_forward(q, k, v, 0.9, 8, s)
    assert o.dtype == final.dtype == torch.float32
    ref = numpy_reference.causal_linear_recurrent(q.double().numpy(), k.double().numpy(), v.double().numpy(), 0.9, initial_state=s.double().numpy())
    err = relative_error(o, ref)
    assert 1e-9 < err < 1e-5  # float32 rounding is visible (so it did not silently run in float64) and small


@pytest.mark.parametrize("block_size", [1, 3, 13, 48, 100, 200])
def test_block_sizes_not_powers_of_two_agree(block_size):
    q, k, v, s = _inputs(130, seed=7)
    lam = [0.95, 1.0, 0.3]
    base, base_state = tc.loop_forward(q, k, v, lam, 64, s)
    o, state = tc.chunked_forward(q, k, v, lam, block_size, s)
    o_log, state_log = tc.chunked_forward(q, k, v, lam, block_size, s, scan="log")
    o_loop, state_loop = tc.loop_forward(q, k, v, lam, block_size, s)
    for a, b in ((o, base), (o_log, o), (o_loop, o), (state, base_state), (state_log, state), (state_loop, state)):
        assert relative_error(a, b) < 1e-12


def test_log_scan_equals_sequential_scan():
    rng = torch.Generator().manual_seed(8)
    local = torch.randn(2, 3, 37, 4, 5, generator=rng, dtype=torch.float64)
    block_decay = torch.rand(3, 37, generator=rng, dtype=torch.float64)
    init = torch.randn(2, 3, 4, 5, generator=rng, dtype=torch.float64)
    seq = tc.scan_states(local, block_decay, init)
    log = tc.scan_states(local, block_decay, init, scan="log")
    assert seq.shape == (2, 3, 38, 4, 5)
    assert relative_error(log, seq) < 1e-13
    # and the sequential scan is the recurrence it claims to be, written out here
    state = init
    for i in range(37):
        state = block_decay[:, i, None, None] * state + local[:, :, i]
    assert relative_error(seq[:, :, -1], state) < 1e-14


def test_small_decay_with_large_blocks_does_not_overflow():
    # lambda^-B for lambda = 0.01 and B = 256 is 1e512: a form that divided by lambda^B would give inf/NaN.
    q, k, v, s = _inputs(600, heads=1, seed=9)
    o, state = tc.chunked_forward(q, k, v, 0.01, 256, s)
    ref_o, ref_state = numpy_reference.causal_linear_recurrent(q.numpy(), k.numpy(), v.numpy(), 0.01, initial_state=s.numpy(), return_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert relative_error(o, ref_o) < 1e-10 and relative_error(state, ref_state) < 1e-10


def test_public_api_routes_torch_tensors_to_this_backend():
    q, k, v, s = _inputs(37, seed=11)
    lam = [1.0, 0.5, 0.01]
    o_ref, state_ref = numpy_reference.causal_linear_recurrent(q.numpy(), k.numpy(), v.numpy(), lam, initial_state=s.numpy(), return_state=True)
    for backend in ("torch", "auto"):
        o, state = lightning_attention(q, k, v, lam, backend=backend, block_size=8, initial_state=s, return_state=True)
        assert isinstance(o, torch.Tensor)
        assert relative_error(o, o_ref) < 1e-10 and relative_error(state, state_ref) < 1e-10
    do = torch.ones_like(o)
    d_final = torch.full_like(s, 0.5)
    ref = numpy_blockwise.blockwise_backward(q.numpy(), k.numpy(), v.numpy(), do.numpy(), lam, 8, s.numpy(), d_final.numpy())
    got = lightning_attention_backward(q, k, v, do, lam, backend="torch", initial_state=s, d_final_state=d_final, return_state_grad=True)
    assert len(got) == 4
    for g, r in zip(got, ref):
        assert isinstance(g, torch.Tensor) and relative_error(g, r) < 1e-10
    # the forward through the public API is differentiable (hand-written backward)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s)]
    o, state = lightning_attention(*leaves[:3], lam, backend="torch", initial_state=leaves[3], return_state=True)
    grads = torch.autograd.grad((o * do).sum() + (state * d_final).sum(), leaves)
    for g, r in zip(grads, ref):
        assert relative_error(g, r) < 1e-10


def test_errors_name_the_argument():
    q, k, v, _ = _inputs(7)
    with pytest.raises(ValueError, match="scan must be one of"):
        tc.chunked_forward(q, k, v, scan="parallel")
    with pytest.raises(TypeError, match="backend='torch' takes torch tensors"):
        tc.chunked_forward(q.numpy(), k.numpy(), v.numpy())
    with pytest.raises(ValueError, match="decay must have one value per head"):
        tc.loop_forward(q, k, v, [0.5, 0.5])
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        tc.chunked_forward(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        tc.recurrent_forward(q, k, v, initial_state=torch.zeros(2, 3, 4, 5, dtype=torch.float64))


def _same_bits(a, b):
    """Equal bit for bit, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("plant", ["finite", "nan", "inf", "sum overflows"])
def test_masked_product_with_and_without_a_look_at_x_gives_the_same_bits(dtype, plant):
    # look=True reads x on the host to skip the masked path when x is finite (the CPU's way); look=False always runs
    # the masked path, branch-free (a GPU's or a compiled graph's way). The same bits either way, and causal.
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(2, 3, 16, 16, generator=gen).to(dtype)
    keep = torch.ones(16, 16, dtype=torch.bool).tril()
    x = torch.randn(2, 3, 16, 5, generator=gen).to(dtype)
    if plant == "nan":
        x[0, 1, 9, 2] = float("nan")
    elif plant == "inf":
        x[1, 2, 4, 0] = float("-inf")
    elif plant == "sum overflows":
        x[:, :, :, 3] = torch.finfo(dtype).max / 2  # every entry finite, the sum not
    looked, blind = tc.masked_product(weights, keep, x, look=True), tc.masked_product(weights, keep, x, look=False)
    assert _same_bits(looked, blind)
    if plant == "nan":  # rows before the planted token stay finite: the mask selected, it did not multiply
        assert looked[0, 1, :9].isfinite().all() and looked[0, 1, 9:, 2].isnan().all()


def test_masked_product_compiles_without_a_graph_break():
    # Under torch.compile the default does not look at x (a host read would break the graph): fullgraph traces it.
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    weights, x = torch.randn(2, 8, 8), torch.randn(2, 8, 4)
    x[1, 3, 0] = float("nan")
    compiled = torch.compile(lambda w, v: tc.masked_product(w, keep, v), backend="eager", fullgraph=True)
    got, want = compiled(weights, x), tc.masked_product(weights, keep, x)
    assert _same_bits(got, want)
