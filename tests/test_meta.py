"""Meta tensors: a model traced on the meta device (shapes without data, e.g. to count parameters or plan memory)
calls the attention with tensors that hold no values. Every entry point on the torch and triton backends then
answers with the shapes and dtypes a real call gives, and launches nothing."""

import pytest
import torch

from lightning_edu import lightning_attention, lightning_attention_backward, lightning_attention_step


def _described(outputs):
    return [(tuple(x.shape), x.dtype) for x in outputs]


def _calls(q, k, v, do, s0):
    """Each entry point on these tensors, every optional output asked for."""
    return {
        "forward": lambda backend: lightning_attention(q, k, v, [0.9, 1.0], backend=backend, initial_state=s0,
                                                       return_state=True),
        "backward": lambda backend: lightning_attention_backward(q, k, v, do, [0.9, 1.0], backend=backend,
                                                                 initial_state=s0, d_final_state=s0,
                                                                 return_state_grad=True),
        "step": lambda backend: lightning_attention_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], s0, [0.9, 1.0],
                                                         backend=backend),
    }


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("entry", ["forward", "backward", "step"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_meta_tensors_get_the_shapes_and_dtypes_of_a_real_call(backend, entry, dtype):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 16, generator=gen).to(dtype) for _ in range(2))
    v, do = (torch.randn(1, 2, 40, 32, generator=gen).to(dtype) for _ in range(2))
    s0 = torch.randn(1, 2, 16, 32, generator=gen)
    real = _calls(q, k, v, do, s0)[entry](backend)
    traced = _calls(*(x.to("meta") for x in (q, k, v, do, s0)))[entry](backend)
    assert all(x.device.type == "meta" for x in traced)
    assert _described(traced) == _described(real)
    assert all(torch.isfinite(x).all() for x in real)  # the real call computed something


def test_meta_tensors_through_autograd_on_the_triton_backend():
    # the op's fake forward and its registered backward: gradients of the leaves' shapes, on the meta device
    q, k = (torch.empty(2, 3, 50, 16, device="meta", requires_grad=True) for _ in range(2))
    v = torch.empty(2, 3, 50, 32, device="meta", requires_grad=True)
    lightning_attention(q, k, v, 0.5, backend="triton").sum().backward()
    assert [(x.grad.shape, x.grad.device.type) for x in (q, k, v)] == [(x.shape, "meta") for x in (q, k, v)]
