"""The backend's two doors to the same kernels: the custom op (compiled code, tensor subclasses) and the autograd
Function eager calls take (:class:`lightning_edu.triton_kernels.ops.EagerLA2`); the cached log2 of a decay
tensor; and, for every hand-written backward (both triton doors, LA-1, the torch backend), a second derivative
that raises instead of coming back without the attention's term. (CPU: the kernels run in Triton's interpreter.)"""

import numpy as np
import pytest
import torch

import lightning_edu.triton_kernels as tk
from lightning_edu.triton_kernels import log2_decay_tensor, triton_attention
from lightning_edu.triton_kernels.ops import la2_forward


def _inputs(seed, shape=(2, 2, 75, 32, 16)):
    batch, heads, n, d_k, d_v = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, n, d_k, generator=gen) * 0.3 for _ in range(2))
    v = torch.randn(batch, heads, n, d_v, generator=gen)
    s0 = torch.randn(batch, heads, d_k, d_v, generator=gen)
    return q, k, v, s0


def _grads(path, q, k, v, s0, lam, loss):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, s0)]
    lam = lam.clone().requires_grad_()
    if path == "op":  # the custom op, called as torch.compile would see it (a learned lambda's log2 in float64)
        o, sn, _ = la2_forward(*leaves[:3], torch.log2(lam.double()), leaves[3], 16, True)
    else:
        o, sn = triton_attention(*leaves[:3], lam, leaves[3], block_size=16)
    loss(o, sn).backward()
    return [o, sn] + [x.grad for x in leaves] + [lam.grad]


LOSSES = {
    "output and state": lambda o, sn: (o * o.detach().cos()).sum() + sn.square().sum(),
    "output only": lambda o, sn: o.square().sum(),
    "state only": lambda o, sn: sn.sum(),  # dO is None: the backward runs on zeros
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_eager_function_and_custom_op_agree_bit_for_bit(loss):
    q, k, v, s0 = _inputs(1)
    lam = torch.tensor([0.9, 0.995])
    by_op = _grads("op", q, k, v, s0, lam, LOSSES[loss])
    eager = _grads("eager", q, k, v, s0, lam, LOSSES[loss])
    names = ["o", "final state", "dq", "dk", "dv", "d initial state", "d lambda"]
    for name, a, b in zip(names, by_op, eager):
        assert a is not None and b is not None, name
        assert torch.equal(a, b), f"{name} differs between the custom op and the eager Function"


def test_eager_calls_skip_the_dispatcher_and_subclasses_take_the_op(monkeypatch):
    calls = []
    op = tk.la2_forward

    def counting(*args):
        calls.append(type(args[0]).__name__)
        return op(*args)

    monkeypatch.setattr(tk, "la2_forward", counting)
    q, k, v, _ = _inputs(2)
    triton_attention(q, k, v, [0.9, 0.99])
    assert calls == [], "a plain eager call went through the custom op"
    # A meta tensor has no data: only the op (its fake implementation) can answer, with the right shapes.
    o, sn = triton_attention(*(x.to("meta") for x in (q, k, v)), [0.9, 0.99])
    assert calls == ["Tensor"] and o.device.type == "meta"
    assert o.shape == v.shape and sn.shape == (2, 2, 32, 16) and sn.dtype == torch.float32


def test_log2_of_a_decay_buffer_is_computed_once_per_version():
    lam = torch.tensor([0.5, 0.25])
    first = log2_decay_tensor(lam, "cpu")
    assert torch.equal(first, torch.tensor([-1.0, -2.0]))
    assert log2_decay_tensor(lam, "cpu") is first, "the same unchanged tensor was not served from the cache"
    lam.mul_(0.5)  # an in-place change: a new version
    second = log2_decay_tensor(lam, "cpu")
    assert torch.equal(second, torch.tensor([-2.0, -3.0])), "a stale log2 was served after an in-place change"
    same_values = torch.tensor([0.25, 0.125])
    assert log2_decay_tensor(same_values, "cpu") is not second  # another tensor is another entry
    learnable = torch.tensor([0.5, 0.25], requires_grad=True)
    a, b = log2_decay_tensor(learnable, "cpu"), log2_decay_tensor(learnable, "cpu")
    assert a is not b and a.requires_grad, "a decay that requires grad must be recomputed inside the graph"
    with torch.inference_mode():
        frozen = torch.tensor([0.5, 0.5])
    assert torch.equal(log2_decay_tensor(frozen, "cpu"), torch.tensor([-1.0, -1.0]))


def test_log2_of_host_lambdas_is_cached_by_value():
    lam = np.array([0.5, 0.25])
    first = log2_decay_tensor(lam, "cpu")
    assert torch.equal(first, torch.tensor([-1.0, -2.0]))
    assert log2_decay_tensor(np.array([0.5, 0.25]), "cpu") is first  # equal values, another array: one entry
    assert log2_decay_tensor([0.5, 0.25], "cpu") is first  # and a list of them
    lam[1] = 0.125  # an array changed in place is looked up by its new values, never served the old ones
    assert torch.equal(log2_decay_tensor(lam, "cpu"), torch.tensor([-1.0, -3.0]))
    assert log2_decay_tensor(np.array([0.5, 0.25], dtype=np.float32), "cpu") is first  # 0.5, 0.25: exact in fp32


_COMPILE_FIRST = r"""
import torch
import lightning_edu as le

class Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 96)
        self.register_buffer("decay", torch.tensor([0.9, 0.99]))  # a CPU tensor, not a Python constant

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 40, 3, 2, 16).permute(2, 0, 3, 1, 4)
        return le.lightning_attention(q, k, v, self.decay, backend="triton")

torch.manual_seed(0)
model, x = Mixer(), torch.randn(2, 40, 32)
compiled = torch.compile(model, backend="aot_eager", fullgraph=True)(x)  # before any eager call: a break raises
print(torch.equal(compiled, model(x)))
"""


def test_a_model_compiles_whole_before_its_first_eager_call():
    """A fresh process whose first call is compiled: no import inside the traced call (the backends' modules
    are loaded with the package), and a CPU decay buffer is a graph value, not a host read."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_FIRST], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("door", ["triton operator", "triton function", "torch", "la1"])
@pytest.mark.parametrize("how", ["autograd.grad with inputs", "backward"])
def test_a_second_derivative_is_refused_not_dropped(door, how):
    """No backend has a second derivative (their hand-written backwards have none of their own): asking for one
    must raise, by either route, never return a gradient that silently lacks the attention's term."""
    q, k, v, _ = _inputs(3)
    q.requires_grad_()
    if door == "triton operator":
        o, _, _ = la2_forward(q, k, v, log2_decay_tensor([0.9, 0.99], "cpu"), None, 16, True)
    elif door == "triton function":
        o, _ = triton_attention(q, k, v, [0.9, 0.99], block_size=16)
    elif door == "torch":
        import lightning_edu as le

        o = le.lightning_attention(q, k, v, [0.9, 0.99], backend="torch", block_size=16)
    else:
        from lightning_edu.triton_kernels.la1 import la1_attention

        o = la1_attention(q, k, v, [0.9, 0.99], block_size=16)
    (gq,) = torch.autograd.grad(o.square().sum(), [q], create_graph=True)
    loss = gq.sum() + q.square().sum()  # the second term alone would give a plausible-looking answer
    with pytest.raises(RuntimeError, match="no second derivative|no autograd formula"):
        if how == "backward":
            loss.backward()
        else:
            torch.autograd.grad(loss, [q])


def test_a_call_no_gradient_can_follow_runs_without_the_autograd_function(monkeypatch):
    # Inference (grad mode off, or no input requiring a gradient) takes the kernels alone: the same bits, no
    # Function, no segment states saved. A call that may be differentiated still takes the Function.
    applied = []
    real = tk.EagerLA2.apply
    monkeypatch.setattr(tk.EagerLA2, "apply", lambda *a: applied.append(a[-1]) or real(*a))
    q, k, v, s0 = _inputs(3)
    with torch.no_grad():
        o, sn = triton_attention(q, k, v, [0.9, 0.99], s0)
    o2, sn2 = triton_attention(q, k, v, [0.9, 0.99], s0)  # grad mode on, but nothing requires a gradient
    assert applied == [] and o.grad_fn is None and o2.grad_fn is None
    leaf = q.clone().requires_grad_()
    o3, sn3 = triton_attention(leaf, k, v, [0.9, 0.99], s0)
    assert applied == [True] and o3.grad_fn is not None  # the Function, saving its states for the backward
    assert all(torch.equal(a, b) for a, b in ((o, o2), (o, o3), (sn, sn2), (sn, sn3)))
