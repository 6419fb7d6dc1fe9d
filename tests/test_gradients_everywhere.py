"""No gradient dropped without a word (issue 46): every public function x backend x argument that can require grad.

One table, ``EXPECTED``: for each public function, each argument that a caller can hand over as a tensor requiring
grad, and what must happen when that argument alone requires it:

* ``GRAD``: autograd gives its gradient, checked against float64 autograd through the recurrences written below
  (never through the function under test) on the same float32 values;
* a pattern: the call raises a TypeError whose message starts with it, naming the argument.

A loss reads every output (o and the state, when there is one) through fixed random weights, so a gradient that
reaches only part of the graph shows. Backends: "torch" (on the CPU) and "triton" (the CPU interpreter, and the same
cases on a GPU, marked gpu: tests/kernel_cases.py); hybrid_attention has no "triton" (refused for its softmax,
whatever requires grad: tests/test_hybrid.py). "numpy" takes no tensors at all: a tensor q that requires grad is
refused there before anything else (``NUMPY_REFUSAL``).

The step functions run with a state, and their q, k, v also without one (``"q, no state"``: the state-free branch
of each backend; normalized_attention_step's q not, see (*) below). Shapes: batch 1, 2 heads, n = 24, d = 16.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from kernel_cases import marks

import lightning_edu as le
from lightning_edu.checks import relative_error
from lightning_edu.feature_maps import LearnedReLU2

GRAD = "grad"
HEADS, N, D = 2, 24, 16
DECAY = (0.9, 0.7)
EPS = 1e-6
BLOCK = 8  # hybrid_attention's softmax blocks: three of them in N
# float32 against float64 on these shapes: the sequence functions sum N tokens' products, the steps one.
BOUNDS = {"sequence": 1e-5, "step": 2e-6}

_BACKWARD_REFUSAL = r"^{} requires grad, but the gradients this call returns are not differentiable"
EXPECTED = {
    "lightning_attention": {"q": GRAD, "k": GRAD, "v": GRAD, "decay": GRAD, "initial_state": GRAD},
    "lightning_attention_backward": {
        **{name: _BACKWARD_REFUSAL.format(name) for name in ("q", "k", "v", "do", "initial_state", "d_final_state")},
        "decay": r"^decay requires grad, but this call computes no gradient with respect to lambda"},
    "lightning_attention_step": {"q": GRAD, "k": GRAD, "v": GRAD, "state": GRAD, "decay": GRAD,
                                 "q, no state": GRAD, "k, no state": GRAD, "v, no state": GRAD},
    "normalized_attention": {"q": GRAD, "k": GRAD, "v": GRAD, "decay": GRAD, "initial_state": GRAD,
                             "feature_map": GRAD, "eps": r"^eps must be a finite real number"},
    "normalized_attention_step": {"q": GRAD, "k": GRAD, "v": GRAD, "state": GRAD, "decay": GRAD,
                                  "feature_map": GRAD, "eps": r"^eps must be a finite real number",
                                  "k, no state": GRAD, "v, no state": GRAD},  # (*)
    "hybrid_attention": {"q": GRAD, "k": GRAD, "v": GRAD, "decay": GRAD, "feature_map": GRAD,
                         "scale": r"^scale must be a finite real number"},
}
# (*) Not q: from a zero state one token's o is phi(q).phi(k) v / (phi(q).phi(k) + eps), v up to eps, so dL/dq is
# of the order of eps, all rounding.
BACKENDS = {name: ("torch",) if name == "hybrid_attention" else ("torch", "triton") for name in EXPECTED}
NUMPY_REFUSAL = r"^backend='numpy' takes numpy arrays, got q as"
STEPS = ("lightning_attention_step", "normalized_attention_step")


# ------------------------------------------------------------------------------------------------ the references


def _recurrence(q, k, v, lam, state):
    """Causal linear attention, token by token: S_t = lambda S_{t-1} + k_t^T v_t, o_t = q_t S_t; (o, S_n)."""
    S = state if state is not None else q.new_zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]))
    lam = lam[None, :, None, None]
    out = []
    for t in range(q.shape[2]):
        S = lam * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(out, 2), S


def _normalized(q, k, v, lam, state, phi, eps):
    """phi(q_t) S_t / (phi(q_t) . z_t + eps), S and z accumulated separately; (o, [S | z])."""
    pq, pk = phi(q), phi(k)
    S0, z0 = (None, None) if state is None else (state[..., :-1], state[..., -1:])
    num, S = _recurrence(pq, pk, v, lam, S0)
    z = z0 if z0 is not None else pq.new_zeros(pq.shape[:2] + (pq.shape[-1], 1))
    den = []
    for t in range(q.shape[2]):
        z = lam[None, :, None, None] * z + pk[:, :, t, :, None]
        den.append((pq[:, :, t, :, None] * z).sum(-2))
    return num / (torch.stack(den, 2) + eps), torch.cat([S, z], -1)


def _hybrid(q, k, v, lam, phi, scale):
    """The joint normaliser's weights written out: w_ts = lambda^(t-s) e^(scale q_t . k_s) in t's block,
    lambda^(t-s) phi(q_t) . phi(k_s) before it, 0 after t; o_t = sum_s w_ts v_s / sum_s w_ts."""
    t = torch.arange(q.shape[2])
    gap = (t[:, None] - t[None, :]).double()
    powers = torch.where(gap >= 0, lam[:, None, None] ** gap.clamp(min=0), 0.0)  # (heads, n, n)
    same_block = (t[:, None] // BLOCK) == (t[None, :] // BLOCK)
    inside = torch.exp(scale * q @ k.transpose(-1, -2))
    before = phi(q) @ phi(k).transpose(-1, -2)
    w = powers * torch.where(same_block, inside, before)
    return (w @ v) / w.sum(-1, keepdim=True)


def _elu1(x):
    return F.elu(x) + 1


# --------------------------------------------------------------------------------------------------- the calls


def _inputs(function, device):
    """float32 tensors on ``device`` (and a float32 feature map), none requiring grad: the sequence functions' q, k, v
    (1, heads, N, D), the steps' (1, heads, D); the state of the normalised forms is [S | z] with z > 0."""
    rng = np.random.default_rng(46)
    step = function in STEPS
    shape = (1, HEADS, D) if step else (1, HEADS, N, D)
    t = lambda x: torch.tensor(x, dtype=torch.float32, device=device)  # noqa: E731
    x = {name: t(rng.standard_normal(shape) / 2) for name in ("q", "k", "v", "do")}
    state = rng.standard_normal((1, HEADS, D, D)) / 2
    if function.startswith("normalized"):
        state = np.concatenate([state, rng.uniform(0.5, 1.5, (1, HEADS, D, 1))], -1)
    x["state"] = t(state)
    x["d_final_state"] = t(rng.standard_normal((1, HEADS, D, D)))
    x["decay"] = t(DECAY)
    x["feature_map"] = LearnedReLU2(D, generator=torch.Generator().manual_seed(46)).to(device).requires_grad_(False)
    return x


def _call(function, backend, x, phi="elu+1", eps=EPS, scale=None, with_state=True):
    """The function on x's tensors; every output it gives, as a tuple."""
    q, k, v, lam = x["q"], x["k"], x["v"], x["decay"]
    state = x["state"] if with_state else None
    if function == "lightning_attention":
        return le.lightning_attention(q, k, v, lam, backend=backend, initial_state=state, return_state=True)
    if function == "lightning_attention_backward":
        return le.lightning_attention_backward(q, k, v, x["do"], lam, backend=backend, initial_state=state,
                                               d_final_state=x["d_final_state"], return_state_grad=True)
    if function == "lightning_attention_step":
        return le.lightning_attention_step(q, k, v, state, lam, backend=backend)
    if function == "normalized_attention":
        return le.normalized_attention(q, k, v, lam, feature_map=phi, eps=eps, backend=backend, initial_state=state,
                                       return_state=True)
    if function == "normalized_attention_step":
        return le.normalized_attention_step(q, k, v, state, lam, feature_map=phi, eps=eps, backend=backend)
    assert function == "hybrid_attention"
    return (le.hybrid_attention(q, k, v, lam, block_size=BLOCK, feature_map=phi, scale=scale, backend=backend),)


def _reference(function, x, phi, with_state):
    """The float64 outputs of ``function`` on x (float64 tensors, any of them leaves that require grad)."""
    lam = x["decay"]
    state = x["state"] if with_state else None
    q, k, v = x["q"], x["k"], x["v"]
    if function in STEPS:  # one token: the recurrences with a sequence axis of length 1
        q, k, v = q[:, :, None], k[:, :, None], v[:, :, None]
    if function.startswith("lightning"):
        o, s = _recurrence(q, k, v, lam, state)
    elif function.startswith("normalized"):
        o, s = _normalized(q, k, v, lam, state, phi, EPS)
    else:
        return (_hybrid(q, k, v, lam, phi, D ** -0.5),)
    return (o[:, :, 0], s) if function in STEPS else (o, s)


def _loss(outputs, weights):
    return sum((out.double() * w).sum() for out, w in zip(outputs, weights))


def _weights(outputs):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(out.shape, generator=g, dtype=torch.float64) for out in outputs]


def _params():
    params = []
    for function, expected in EXPECTED.items():
        for argument, want in expected.items():
            for backend in BACKENDS[function]:
                devices = ("cpu", "cuda") if backend == "triton" else ("cpu",)
                for device in devices:
                    params.append(pytest.param(function, backend, argument, want, device,
                                               marks=marks(device) if backend == "triton" else [],
                                               id=f"{function}-{backend}-{argument.replace(', ', '-')}-{device}"))
        params.append(pytest.param(function, "numpy", "q", NUMPY_REFUSAL, "cpu", id=f"{function}-numpy-q-cpu"))
    return params


@pytest.mark.parametrize("function, backend, argument, want, device", _params())
def test_each_argument_that_requires_grad_gets_its_gradient_or_a_type_error(function, backend, argument, want,
                                                                            device):
    name, _, variant = argument.partition(", ")
    with_state = variant != "no state"
    x = _inputs(function, device)
    kwargs = {}
    if name == "feature_map":
        x["feature_map"].requires_grad_(True)
        kwargs["phi"] = x["feature_map"]
        leaf = x["feature_map"].W
    elif name in ("eps", "scale"):  # numbers: a 0-d tensor that requires grad cannot pass for one
        leaf = torch.tensor(EPS if name == "eps" else D ** -0.5, requires_grad=True)
        kwargs[name] = leaf
    else:
        leaf = x["state" if name == "initial_state" else name].requires_grad_(True)
    if backend == "numpy":
        with pytest.raises(TypeError, match=want):
            _call(function, backend, x, **kwargs, with_state=with_state)
        return
    if want != GRAD:
        with pytest.raises(TypeError, match=want):
            _call(function, backend, x, **kwargs, with_state=with_state)
        return

    outputs = _call(function, backend, x, **kwargs, with_state=with_state)
    weights = [w.to(device) for w in _weights(outputs)]
    _loss(outputs, weights).backward()
    got = leaf.grad
    assert got is not None, f"{argument} requires grad, but no gradient reached it"

    # float64 autograd through the recurrences, on the same float32 values
    x64 = {key: value.detach().cpu().double() for key, value in x.items() if torch.is_tensor(value)}
    if name == "feature_map":
        W = x["feature_map"].W.detach().cpu().double().requires_grad_()
        phi = lambda z: F.relu(z @ W) ** 2  # noqa: E731  (LearnedReLU2's map)
        ref_leaf = W
    else:
        phi = _elu1
        ref_leaf = x64["state" if name == "initial_state" else name].requires_grad_()
    ref = _reference(function, x64, phi, with_state)
    _loss(ref, [w.cpu() for w in weights]).backward()
    bound = BOUNDS["step" if function in STEPS else "sequence"]
    assert relative_error(got, ref_leaf.grad) < bound
