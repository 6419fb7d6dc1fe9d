"""The triton backend inside a training step on a GPU: no host-device synchronisation whatever form decay takes,
CUDA-graph capture of forward + backward, a learnable decay against float64, and a bad lambda in a GPU tensor
turned into NaN for its head rather than read by the host.

CUDA by nature (the host-device synchronisation it checks and CUDA graphs have no interpreter counterpart): every test
is a "cuda" case of tests/kernel_cases.py, marked ``gpu`` and skipped by its one rule where the compiled kernels
cannot run on CUDA."""

import numpy as np
import pytest
import torch
from kernel_cases import marks

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.errata import autograd_gradients

pytestmark = marks("cuda")

HEADS = 4
LAMBDAS = [1.0, 0.99, 0.9, 0.5]
DECAYS = {
    "float": lambda: 0.99,
    "list": lambda: list(LAMBDAS),
    "numpy": lambda: np.array(LAMBDAS),
    "cpu tensor": lambda: torch.tensor(LAMBDAS),
    "cuda tensor": lambda: torch.tensor(LAMBDAS, device="cuda"),
    "cuda tensor, learnable": lambda: torch.tensor(LAMBDAS, device="cuda", requires_grad=True),
}


def _inputs(n=1000, d=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(2, HEADS, n, d, device="cuda", generator=g) * d**-0.5 for _ in range(4))
    return [x.to(dtype).requires_grad_(i < 3) for i, x in enumerate((q, k, v, do))]


def _step(q, k, v, do, decay):
    o = le.lightning_attention(q, k, v, decay, backend="triton")
    o.backward(do)
    return o


@pytest.mark.parametrize("form", list(DECAYS))
def test_forward_and_backward_never_wait_for_the_gpu(form):
    q, k, v, do = _inputs()
    decay = DECAYS[form]()
    _step(q, k, v, do, decay)  # compile and build any cached decay tensor first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            _step(q, k, v, do, decay)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_forward_and_backward_replay_from_a_cuda_graph():
    q, k, v, do = _inputs(seed=1)
    decay = torch.tensor(LAMBDAS, device="cuda", requires_grad=True)
    leaves = (q, k, v, decay)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        for _ in range(2):
            for x in leaves:
                x.grad = None
            _step(q, k, v, do, decay)
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o = _step(q, k, v, do, decay)
    with torch.no_grad():  # new inputs, copied into the captured ones
        g = torch.Generator(device="cuda").manual_seed(2)
        for x in (q, k, v, do):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(x.dtype) * 0.125)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_o.clone()] + [x.grad.clone() for x in leaves]
    eager_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    o = _step(*eager_leaves[:3], do, eager_leaves[3])
    eager = [o] + [x.grad for x in eager_leaves]
    for got, want in zip(replayed, eager):
        assert torch.equal(got, want) or relative_error(got, want) < 1e-6


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)], ids=str)
def test_learnable_decay_matches_float64_autograd(dtype, bound):
    q, k, v, do = (x.detach() for x in _inputs(n=300, d=64, dtype=dtype, seed=3))
    s0 = torch.randn(2, HEADS, 64, 64, device="cuda") * 0.1
    lam = torch.tensor([1.0, 0.999, 0.9, 1e-3], device="cuda", requires_grad=True)
    o, sn = le.lightning_attention(q, k, v, lam, initial_state=s0, return_state=True)
    dsn = torch.randn_like(sn)
    ((o.float() * do.float()).sum() + (sn * dsn).sum()).backward()
    as64 = lambda x: x.double().cpu().numpy()  # noqa: E731
    want = autograd_gradients(as64(q), as64(k), as64(v), as64(do), as64(lam.detach()), as64(s0), as64(dsn),
                              with_decay=True)[4]
    assert relative_error(lam.grad, want) < bound


def test_a_bad_lambda_in_a_gpu_tensor_makes_its_head_nan_and_no_other():
    q, k, v, _ = (x.detach() for x in _inputs(n=200, seed=4))
    lam = torch.tensor([0.9, 1.5, 0.99, -0.1], device="cuda")
    o = le.lightning_attention(q, k, v, lam)
    finite = torch.isfinite(o).all(dim=(0, 2, 3)).tolist()
    assert finite == [True, False, True, False]
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\] \(head 1\)"):
        le.lightning_attention(q, k, v, lam.cpu())  # on the host it is read and refused
