"""Every combination a public entry point's docstring calls unsupported is refused with a clear error.

Each row: (entry point, the combination, a call, the exception, the message). A row per combination of
lightning_attention's "Unsupported" paragraph, and of lightning_attention_backward's own; the one a row cannot
hold (Triton without CUDA and with the interpreter off) has its own test below.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_edu as le


def np_qkv(n=8, d_k=16, d_v=16):
    rng = np.random.default_rng(0)
    return rng.standard_normal((1, 2, n, d_k)), rng.standard_normal((1, 2, n, d_k)), rng.standard_normal((1, 2, n, d_v))


def t_qkv(dtype=torch.float32, **kw):
    return [torch.from_numpy(x).to(dtype) for x in np_qkv(**kw)]


def _do(v):
    return torch.ones_like(v) if isinstance(v, torch.Tensor) else np.ones_like(v)


def _both(label, build, exc, pattern):
    """One combination, refused by lightning_attention and lightning_attention_backward alike."""
    def fwd():
        args, kwargs = build()
        le.lightning_attention(*args, **kwargs)

    def bwd():
        args, kwargs = build()
        q, k, v = args[:3]
        le.lightning_attention_backward(q, k, v, _do(v), *args[3:], **kwargs)

    return [("lightning_attention", label, fwd, exc, pattern),
            ("lightning_attention_backward", label, bwd, exc, pattern)]


def _masked():
    q, k, v = np_qkv()
    return (np.ma.masked_array(q, mask=False), k, v), {}


def _requires_grad():
    return (*t_qkv(), torch.full((2,), 0.5, requires_grad=True)), {"backend": "torch"}


ROWS = (
    _both("numpy backend, torch tensors", lambda: ((*t_qkv(),), {"backend": "numpy"}),
          TypeError, r"^backend='numpy' takes numpy arrays")
    + _both("torch backend, numpy arrays", lambda: (np_qkv(), {"backend": "torch"}),
            TypeError, r"^backend='torch' takes torch tensors")
    + _both("triton backend, numpy arrays", lambda: (np_qkv(), {"backend": "triton"}),
            TypeError, r"^backend='triton' takes torch tensors")
    + _both("triton, float64", lambda: ((*t_qkv(torch.float64),), {"backend": "triton"}),
            TypeError, r"must be float32, float16 or bfloat16 .* got float64$")
    + _both("triton, d > 256", lambda: ((*t_qkv(d_v=272),), {"backend": "triton"}),
            ValueError, r"supports d_k, d_v <= 256 .* got d_k=16, d_v=272$")
    + _both("triton, block 24", lambda: ((*t_qkv(),), {"backend": "triton", "block_size": 24}),
            ValueError, r"^block_size for backend='triton' must be a power of two >= 16")
    + _both("triton, block 8", lambda: ((*t_qkv(),), {"backend": "triton", "block_size": 8}),
            ValueError, r"^block_size for backend='triton' must be a power of two >= 16")
    + [("lightning_attention", "decay requires grad, numpy backend",
        lambda: le.lightning_attention(*np_qkv(), torch.full((2,), 0.5, requires_grad=True)), TypeError,
        r"^decay requires grad, but this call computes no gradient"),
       ("lightning_attention_backward", "decay requires grad",
        lambda: le.lightning_attention_backward(*_requires_grad()[0][:3], _requires_grad()[0][2], _requires_grad()[0][3],
                                                backend="torch"), TypeError,
        r"^decay requires grad, but this call computes no gradient")]
    + _both("masked array", _masked, TypeError, r"^q must be a plain numpy array, got a numpy masked array")
    + [("lightning_attention_backward", "do is None",
        lambda: le.lightning_attention_backward(*np_qkv(), None), TypeError, r"^do \(the gradient dL/do.*\) is required")]
)


@pytest.mark.parametrize("entry, label, call, exc, pattern", ROWS, ids=[f"{r[0]}: {r[1]}" for r in ROWS])
def test_unsupported_combination_is_refused(entry, label, call, exc, pattern):
    with pytest.raises(exc, match=pattern):
        call()


@pytest.mark.parametrize("entry", ["lightning_attention", "lightning_attention_backward"])
def test_triton_backend_refused_on_cpu_without_the_interpreter(entry, monkeypatch):
    # Triton reads TRITON_INTERPRET when a kernel is decorated; "0" here stands for a machine that never set it.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = t_qkv()
    args = (q, k, v) if entry == "lightning_attention" else (q, k, v, _do(v))
    with pytest.raises(ValueError, match=r"^backend='triton' needs CUDA tensors"):
        getattr(le, entry)(*args, backend="triton")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bf16 refusal concerns Triton's CPU interpreter")
@pytest.mark.parametrize("launcher", ["la1_forward", "la2_literal_forward", "la2_fast_forward"])
def test_kernel_launchers_refuse_bf16_in_the_interpreter(launcher):
    # The interpreter's bf16 arithmetic is wrong (values near 1e10 where 1e2 is right): refused, not computed.
    from lightning_edu.triton_kernels import la1, la2_fast, la2_literal, log2_decay_tensor

    q, k, v = t_qkv(torch.bfloat16)
    module = {"la1_forward": la1, "la2_literal_forward": la2_literal, "la2_fast_forward": la2_fast}[launcher]
    fn = getattr(module, launcher)
    args = (q, k, v, [0.5, 0.9]) if launcher == "la1_forward" else (q, k, v, log2_decay_tensor([0.5, 0.9], "cpu"))
    with pytest.raises(TypeError, match=rf"^{launcher}: Triton's CPU interpreter computes bfloat16 wrongly"):
        fn(*args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's bf16 path")
def test_triton_backend_computes_bf16_correctly_in_the_interpreter():
    # Once 1.7e10 where the answer is near 85: now computed in float32 and rounded to bf16.
    q, k, v = t_qkv(torch.bfloat16, n=64)
    o = le.lightning_attention(q, k, v, 0.9, backend="triton")
    ref = le.lightning_attention(*(x.double().numpy() for x in (q, k, v)), 0.9)
    assert o.dtype == torch.bfloat16
    assert float(np.linalg.norm(o.double().numpy() - ref) / np.linalg.norm(ref)) < 5e-3


def test_la1_attention_refuses_a_decay_that_requires_grad():
    # It used to detach the tensor silently, leaving decay.grad None although dL/dlambda is not 0.
    from lightning_edu.triton_kernels.la1 import la1_attention

    q, k, v = t_qkv()
    with pytest.raises(TypeError, match=r"^decay requires grad, but this call computes no gradient"):
        la1_attention(q, k, v, torch.full((2,), 0.5, requires_grad=True))
