"""The torch backend on a GPU: forward, backward and a learnable decay against float64 autograd; non-finite values
kept causal by the masked product's branch-free path (on a GPU it never looks at the values on the host, which a
CPU run reaches only by forcing it: tests/test_torch.py); and no host-device synchronisation in a training step
whose decay is a CUDA tensor.

CUDA by nature: every test is a "cuda" case of tests/kernel_cases.py, marked ``gpu`` and skipped by its one rule
where there is no CUDA device. (The torch backend runs no Triton kernel; the rule is the same one.)"""

import pytest
import torch
from kernel_cases import marks

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.errata import autograd_gradients

pytestmark = marks("cuda")

LAMBDAS = [1.0, 0.999, 0.9, 1e-3]  # plain causal linear attention, slow and fast decay, decay near 0
HEADS = len(LAMBDAS)


def _inputs(n, d_k, d_v, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(2, HEADS, n, d_k, device="cuda", generator=g) * d_k**-0.5 for _ in range(2))
    v, do = (torch.randn(2, HEADS, n, d_v, device="cuda", generator=g) for _ in range(2))
    s0 = torch.randn(2, HEADS, d_k, d_v, device="cuda", generator=g) * 0.1
    return [x.to(dtype) for x in (q, k, v, do)] + [s0.to(dtype)]


def _as64(x):
    return x.detach().double().cpu().numpy()


@pytest.mark.parametrize("dtype, bound", [(torch.float64, 1e-12), (torch.float32, 2e-5)], ids=str)
def test_forward_backward_and_decay_gradient_match_float64_autograd(dtype, bound):
    # n = 300 is not a multiple of the 64-row block, d_k != d_v, one head per kind of decay
    q, k, v, do, s0 = _inputs(300, 48, 40, dtype, seed=0)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    lam = torch.tensor(LAMBDAS, device="cuda", dtype=dtype, requires_grad=True)
    o, sn = le.lightning_attention(*leaves[:3], lam, initial_state=leaves[3], return_state=True, backend="torch")
    dsn = torch.randn_like(sn)
    ((o * do).sum() + (sn * dsn).sum()).backward()
    lam64 = _as64(lam)  # the lambdas as the backend got them (rounded to dtype): the judge checks arithmetic only
    want_o = le.lightning_attention(*map(_as64, (q, k, v)), lam64, initial_state=_as64(s0), backend="numpy")
    want = autograd_gradients(*map(_as64, (q, k, v, do)), lam64, _as64(s0), _as64(dsn), with_decay=True)
    assert o.is_cuda and o.dtype == dtype
    assert relative_error(o, want_o) < bound
    for name, got, expected in zip(("dq", "dk", "dv", "d initial state", "d lambda"),
                                   [x.grad for x in leaves] + [lam.grad], want):
        assert relative_error(got, expected) < bound, name


def test_a_nan_key_reaches_only_the_outputs_after_it():
    # On a GPU the masked product always runs its branch-free path: a NaN key at token t of head 1 must reach that
    # head's outputs from t on and nothing before t, nor any other head (the mask selects, it does not multiply)
    q, k, v, _, _ = _inputs(200, 32, 32, torch.float32, seed=1)
    k[:, 1, 77, 3] = float("nan")
    o = le.lightning_attention(q, k, v, torch.tensor(LAMBDAS, device="cuda"), backend="torch")
    assert o[:, 1, :77].isfinite().all()
    assert o[:, 1, 77:].isnan().any(dim=-1).all()
    assert o[:, [0, 2, 3]].isfinite().all()


def test_a_training_step_with_a_cuda_decay_never_waits_for_the_gpu():
    q, k, v, do, _ = _inputs(500, 64, 64, torch.float32, seed=2)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    lam = torch.tensor(LAMBDAS, device="cuda", requires_grad=True)

    def step():
        le.lightning_attention(*leaves, lam, backend="torch").backward(do)

    step()  # any first-call work (caches, lazy initialisation) before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(x.grad.isfinite().all() for x in (*leaves, lam))
