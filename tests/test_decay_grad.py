"""A learnable decay: dL/dlambda per head from the torch and triton backends (autograd through
``lightning_attention``), against float64 autograd through the masked quadratic form (errata.autograd_gradients)
and torch.autograd.gradcheck; and every path that cannot give it refuses rather than drop it."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.errata import autograd_gradients
from lightning_edu.torch_chunked import decay_gradient, decay_gradient_from_grads

from kernel_cases import on

# (backend, dtype) -> bound on the relative error of dL/dlambda
BOUNDS = {("torch", torch.float64): 1e-12, ("torch", torch.float32): 2e-5, ("triton", torch.float32): 2e-5,
          ("triton", torch.float16): 5e-2}


def _problem(batch, heads, n, d_k, d_v, seed, state=True):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((2, batch, heads, n, d_k)) * d_k**-0.5
    v, do = rng.standard_normal((2, batch, heads, n, d_v))
    s0 = rng.standard_normal((batch, heads, d_k, d_v)) if state else None
    dsn = rng.standard_normal((batch, heads, d_k, d_v)) if state else None
    return q, k, v, do, s0, dsn


def _learned(backend, dtype, q, k, v, do, decay, s0=None, dsn=None, block_size=None, cu_seqlens=None):
    t = lambda x: None if x is None else torch.tensor(x).to(dtype)  # noqa: E731
    lam = torch.tensor(decay, dtype=torch.float32 if dtype == torch.float16 else dtype, requires_grad=True)
    o, sn = le.lightning_attention(t(q), t(k), t(v), lam, backend=backend, initial_state=t(s0), return_state=True,
                                   block_size=block_size, cu_seqlens=cu_seqlens)
    loss = (o.double() * torch.tensor(do)).sum()
    if dsn is not None:
        loss = loss + (sn.double() * torch.tensor(dsn)).sum()
    loss.backward()
    return lam.grad.double().numpy()


def _lambda_as_learned(decay, dtype):
    """The lambdas as the learned tensor holds them (float32 unless float64): the judge must see the same values."""
    return np.asarray(decay, dtype=np.float64 if dtype == torch.float64 else np.float32).astype(np.float64).tolist()


def _rounded(dtype, *xs):
    """The inputs as the backend sees them (rounded to dtype), in float64: the judge runs on those."""
    return [None if x is None else torch.tensor(x).to(dtype).double().numpy() for x in xs]


@pytest.mark.parametrize("backend, dtype", list(BOUNDS), ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("n, d_k, d_v, decay", [
    (77, 16, 16, [1.0, 0.9, 0.05]),       # decay 1 and near 0 beside a typical one
    (130, 16, 32, [0.999, 0.5, 1e-3]),    # n past two 64-row blocks, d_k != d_v
    (1, 16, 16, [0.7, 1.0, 0.9]),         # one token
])
@pytest.mark.parametrize("state", [True, False])
def test_decay_gradient_matches_float64_autograd(backend, dtype, n, d_k, d_v, decay, state):
    q, k, v, do, s0, dsn = _problem(2, 3, n, d_k, d_v, seed=n + d_v, state=state)
    q, k, v, s0 = _rounded(dtype, q, k, v, s0)
    decay = _lambda_as_learned(decay, dtype)
    want = autograd_gradients(q, k, v, do, decay, s0, dsn, with_decay=True)[4]
    got = _learned(backend, dtype, q, k, v, do, decay, s0, dsn)
    assert got.shape == (3,)
    assert relative_error(got, want) < BOUNDS[backend, dtype]


@on()
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("lam", [1e-45, 1e-38, 1e-30, 1e-8])  # 1e-45 and 1e-38 are subnormal in float32
def test_decay_gradient_of_a_tiny_float32_lambda(device, backend, lam):
    """dL/dlambda where lambda dL/dlambda, the gradient in ln or log2 lambda, is subnormal in float32: the backends
    form dL/dlambda without it (dividing it by lambda afterwards would keep only the digits a subnormal has)."""
    q, k, v, do, s0, dsn = _problem(1, 2, 40, 16, 16, seed=4)
    q, k, v, s0 = _rounded(torch.float32, q, k, v, s0)
    decay = _lambda_as_learned([lam, 0.5], torch.float32)
    assert 0 < decay[0] < 1e-7  # still tiny once rounded to float32 (1e-45 becomes 2^-149)
    want = autograd_gradients(q, k, v, do, decay, s0, dsn, with_decay=True)[4]
    t = lambda x: torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    learned = t(decay).requires_grad_()
    o, sn = le.lightning_attention(t(q), t(k), t(v), learned, backend=backend, initial_state=t(s0), return_state=True)
    ((o.double() * t(do).double()).sum() + (sn.double() * t(dsn).double()).sum()).backward()
    got = learned.grad.double().cpu().numpy()
    assert relative_error(got, want) < BOUNDS[backend, torch.float32]
    assert relative_error(got[:1], want[:1]) < BOUNDS[backend, torch.float32]


@on()
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("lam", [1e-45, 1e-38, 1e-8])
def test_the_steps_decay_gradient_of_a_tiny_float32_lambda(device, backend, lam):
    """One decoding step, S' = lambda S + k^T v and o = q S', with the loss <o, do> + <S', dS'>: dL/dlambda is
    sum(S * G) with G = dS' + q^T do, in float64 here, for a float32 lambda that is subnormal or near it."""
    rng = np.random.default_rng(7)
    q, k, v, do = (rng.standard_normal((1, 2, 16)).astype(np.float32) for _ in range(4))
    s0, ds = (rng.standard_normal((1, 2, 16, 16)).astype(np.float32) for _ in range(2))
    decay = np.array([lam, 0.5], dtype=np.float32)
    grad_state = ds.astype(np.float64) + q.astype(np.float64)[..., :, None] * do.astype(np.float64)[..., None, :]
    want = (s0.astype(np.float64) * grad_state).sum(axis=(0, 2, 3))
    t = lambda x: torch.tensor(x, device=device)  # noqa: E731
    learned = t(decay).requires_grad_()
    o, sn = le.lightning_attention_step(t(q), t(k), t(v), t(s0), learned, backend=backend)
    ((o.double() * t(do).double()).sum() + (sn.double() * t(ds).double()).sum()).backward()
    got = learned.grad.double().cpu().numpy()
    assert relative_error(got, want) < 1e-6 and relative_error(got[:1], want[:1]) < 1e-6


@settings(max_examples=15, deadline=None)
@given(block=st.sampled_from([16, 32, 64]), n=st.integers(1, 90), lam=st.floats(0.05, 1.0))
def test_block_size_does_not_change_the_decay_gradient(block, n, lam):
    q, k, v, do, s0, dsn = _problem(1, 2, n, 5, 3, seed=n)
    want = autograd_gradients(q, k, v, do, [lam, 1.0], s0, dsn, with_decay=True)[4]
    got = _learned("torch", torch.float64, q, k, v, do, [lam, 1.0], s0, dsn, block_size=block)
    assert relative_error(got, want) < 1e-11


def test_gradcheck_through_the_torch_backend():
    q, k, v, _, s0, _ = _problem(1, 2, 23, 4, 3, seed=1)
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    lam = torch.tensor([0.8, 0.95], dtype=torch.float64, requires_grad=True)

    def f(lam):
        o, sn = le.lightning_attention(t(q), t(k), t(v), lam, backend="torch", initial_state=t(s0), return_state=True,
                                       block_size=8)
        return o, sn

    assert torch.autograd.gradcheck(f, (lam,))


def test_packed_sequences_add_their_decay_gradients():
    cu = [0, 30, 30, 77]
    q, k, v, do, _, _ = _problem(1, 3, 77, 16, 16, seed=5, state=False)
    decay = [1.0, 0.9, 0.5]
    want = sum(autograd_gradients(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], do[:, :, a:b], decay, with_decay=True)[4]
               for a, b in zip(cu[:-1], cu[1:]) if b > a)
    for backend, dtype in (("torch", torch.float64), ("triton", torch.float32)):
        got = _learned(backend, dtype, q, k, v, do, _lambda_as_learned(decay, dtype), cu_seqlens=cu)
        assert relative_error(got, want) < BOUNDS[backend, dtype]


def test_the_formula_is_the_sum_over_query_and_key_positions():
    """decay_gradient on its own: for one head, one query and one key at distance 3, dL/d(ln lambda) = 3 x the term."""
    n = 4
    q = torch.zeros(1, 1, n, 1, dtype=torch.float64)
    k = torch.zeros_like(q)
    q[0, 0, 3, 0], k[0, 0, 0, 0] = 2.0, 1.0  # query at t = 4, key at s = 1
    lam = 0.5
    # L = lam^3 * (q_4 . k_1) * (do_4 . v_1) with do_4 . v_1 = 1: dq_4 = lam^3 k_1, dk_1 = lam^3 q_4
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    dq[0, 0, 3, 0], dk[0, 0, 0, 0] = lam**3 * 1.0, lam**3 * 2.0
    got = decay_gradient_from_grads(q, k, dq, dk)
    assert torch.allclose(got, torch.tensor([3 * lam**3 * 2.0], dtype=torch.float64))
    v, do = torch.ones_like(q), torch.zeros_like(q)
    do[0, 0, 3, 0] = 1.0  # do_4 . v_1 = 1
    assert torch.allclose(decay_gradient(q, k, v, do, np.array([lam]), block_size=2), got)  # a pair across blocks
    assert torch.allclose(decay_gradient(q, k, v, do, np.array([lam]), block_size=4), got)  # inside one block


def test_the_torch_and_triton_steps_learn_decay_and_the_numpy_step_refuses():
    rng = np.random.default_rng(2)
    q, k, v = (torch.tensor(rng.standard_normal((2, 3, 16))) for _ in range(3))
    s = torch.tensor(rng.standard_normal((2, 3, 16, 16)))
    # d/dlambda of sum(q (lambda s + k^T v)) + sum(lambda s + k^T v) = sum(q s) + sum(s), per head
    want = (q[..., :, None] * s).sum(dim=(0, 2, 3)) + s.sum(dim=(0, 2, 3))
    for backend, dtype, bound in (("torch", torch.float64, 1e-12), ("triton", torch.float32, 1e-6)):
        lam = torch.tensor([0.9, 0.5, 1.0], dtype=dtype, requires_grad=True)
        o, new = le.lightning_attention_step(*(x.to(dtype) for x in (q, k, v, s)), lam, backend=backend)
        (o.sum() + new.sum()).backward()
        assert relative_error(lam.grad, want) < bound, backend
    with pytest.raises(TypeError, match="^decay requires grad"):
        le.lightning_attention_step(q.numpy(), k.numpy(), v.numpy(), s.numpy(), lam, backend="numpy")


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 2e-5), (torch.float16, 5e-2)])
def test_the_identity_from_dq_and_dk_cancels_badly_where_the_tangent_does_not(dtype, bound):
    """Chapter 06's lesson, held: at lambda = 1e-3 the short identity from dq, dk loses the answer to rounding, the
    tangent pass keeps it (both on the same rounded inputs, against float64 autograd)."""
    q, k, v, do, _, _ = _problem(1, 1, 130, 16, 16, seed=3, state=False)
    q, k, v = _rounded(dtype, q, k, v)
    decay = _lambda_as_learned([1e-3], dtype)
    want = autograd_gradients(q, k, v, do, decay, with_decay=True)[4] * np.asarray(decay)  # d/d(ln lambda)
    t = lambda x: torch.tensor(x).to(dtype)  # noqa: E731
    dq, dk, _ = le.lightning_attention_backward(t(q), t(k), t(v), t(do), decay, backend="torch")
    from_grads = decay_gradient_from_grads(t(q), t(k), dq, dk).numpy()
    tangent = decay_gradient(t(q), t(k), t(v), t(do), np.asarray(decay)).numpy()
    assert relative_error(tangent, want) < bound / 10
    assert relative_error(from_grads, want) > 10 * relative_error(tangent, want)
