"""Every argument error, raised through every public entry point that validates.

Each test asserts the exception type and that the message names the argument, what was expected and
what was given (the contract of lightning_edu/validation.py).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from lightning_edu import lightning_attention, lightning_attention_backward
from lightning_edu import numpy_blockwise as nb
from lightning_edu import numpy_reference as nr
from lightning_edu.validation import validate_attention_args, validate_block_size, validate_decay

BATCH, HEADS, N, D_K, D_V = 2, 3, 5, 4, 6


def qkv(dtype=np.float64, batch=BATCH, heads=HEADS, n=N, d_k=D_K, d_v=D_V):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((batch, heads, n, d_k)).astype(dtype)
    k = rng.standard_normal((batch, heads, n, d_k)).astype(dtype)
    v = rng.standard_normal((batch, heads, n, d_v)).astype(dtype)
    return q, k, v


def do_grad(shape=(BATCH, HEADS, N, D_V)):
    return np.ones(shape)


# Every public function that checks q, k, v; each takes (q, k, v, **extra) where extra holds only the
# keywords that function accepts.
CALLERS = {
    "lightning_attention": lambda q, k, v, **kw: lightning_attention(q, k, v, **kw),
    "lightning_attention_backward": lambda q, k, v, **kw: lightning_attention_backward(
        q, k, v, kw.pop("do", do_grad(tuple(v.shape) if hasattr(v, "shape") else (1,))), **kw
    ),
    "softmax_attention": lambda q, k, v, **kw: nr.softmax_attention(q, k, v, **kw),
    "linear_attention_left": lambda q, k, v, **kw: nr.linear_attention_left(q, k, v, **kw),
    "linear_attention_right": lambda q, k, v, **kw: nr.linear_attention_right(q, k, v, **kw),
    "causal_linear_masked": lambda q, k, v, **kw: nr.causal_linear_masked(q, k, v, **kw),
    "causal_linear_recurrent": lambda q, k, v, **kw: nr.causal_linear_recurrent(q, k, v, **kw),
    "causal_linear_cumsum": lambda q, k, v, **kw: nr.causal_linear_cumsum(q, k, v, **kw),
    "blockwise_forward": lambda q, k, v, **kw: nb.blockwise_forward(q, k, v, **kw),
    "blockwise_backward": lambda q, k, v, **kw: nb.blockwise_backward(
        q, k, v, kw.pop("do", do_grad(tuple(v.shape) if hasattr(v, "shape") else (1,))), **kw
    ),
}
ALL = sorted(CALLERS)
WITH_DECAY = [c for c in ALL if c not in ("softmax_attention", "linear_attention_left", "linear_attention_right")]
WITH_BLOCK = ["lightning_attention", "lightning_attention_backward", "blockwise_forward", "blockwise_backward"]
WITH_BACKEND = ["lightning_attention", "lightning_attention_backward"]
WITH_STATE = ["lightning_attention", "lightning_attention_backward", "causal_linear_recurrent", "blockwise_forward", "blockwise_backward"]
WITH_DO = ["lightning_attention_backward", "blockwise_backward"]


def call(name, q, k, v, **kw):
    return CALLERS[name](q, k, v, **kw)


def test_callers_accept_valid_arguments():
    # The error tests below are only meaningful if the same calls succeed with valid arguments.
    q, k, v = qkv()
    for name in ALL:
        kw = {"decay": np.array([1.0, 0.5, 0.05])} if name in WITH_DECAY else {}
        out = call(name, q, k, v, **kw)
        first = out[0] if isinstance(out, tuple) else out
        assert first.shape[:3] == (BATCH, HEADS, N), name


# ---------------------------------------------------------------- ndim and shapes


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_wrong_ndim(name, which):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which][0]  # drop the batch axis: 3-D
    want = "(batch, heads, seq_len, d_v)" if which == "v" else "(batch, heads, seq_len, d_k)"
    given = re.escape(str(tuple(args[which].shape)))
    with pytest.raises(ValueError, match=rf"^{which} must be 4-D {re.escape(want)}, got 3-D shape {given}"):
        call(name, args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", ALL)
def test_five_dimensional_q(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^q must be 4-D .*got 5-D shape \(1, 2, 3, 5, 4\)"):
        call(name, q[None], k, v)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize(
    "which, axis, axis_name",
    [("k", 0, "batch"), ("k", 1, "heads"), ("k", 2, "seq_len"), ("v", 0, "batch"), ("v", 1, "heads"), ("v", 2, "seq_len")],
)
def test_mismatched_leading_axes(name, which, axis, axis_name):
    q, k, v = qkv()
    x = {"k": k, "v": v}[which]
    bad = np.concatenate([x, x], axis=axis)  # double that axis
    expected, given = q.shape[axis], 2 * q.shape[axis]
    args = {"k": k, "v": v, which: bad}
    pattern = rf"^{which} must match q in {axis_name} \(axis {axis}\): expected {expected}, got {given}"
    with pytest.raises(ValueError, match=pattern):
        call(name, q, args["k"], args["v"])


@pytest.mark.parametrize("name", ALL)
def test_mismatched_d_k(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"^k must have the same d_k as q \(axis 3\): expected {D_K}, got {D_K - 1}"):
        call(name, q, k[..., :-1], v)


@pytest.mark.parametrize("name", ALL)
def test_empty_axis(name):
    q, k, v = qkv(n=0)
    with pytest.raises(ValueError, match=r"every axis must have length >= 1, got q \(2, 3, 0, 4\) and v \(2, 3, 0, 6\)"):
        call(name, q, k, v)


# ---------------------------------------------------------------- array types and dtypes


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_, np.complex128])
def test_non_float_arrays(name, which, dtype):
    q, k, v = qkv()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].astype(dtype)
    with pytest.raises(TypeError, match=rf"^{which} must hold floating-point numbers, got dtype {np.dtype(dtype)}"):
        call(name, args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", ALL)
def test_not_an_array(name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^q must be a numpy.ndarray or torch.Tensor, got list"):
        call(name, q.tolist(), k, v)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_numpy_and_torch(name, which):
    q, k, v = qkv()
    args = {"k": k, "v": v}
    args[which] = torch.from_numpy(args[which])
    pattern = rf"^{which} must be the same array type as q \(numpy\), got torch.Tensor of shape .*do not mix numpy and torch"
    with pytest.raises(TypeError, match=pattern):
        call(name, q, args["k"], args["v"])


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_mixed_torch_q_and_numpy_k(name):
    q, k, v = qkv()
    pattern = r"^k must be the same array type as q \(torch\), got numpy.ndarray of shape \(2, 3, 5, 4\) and dtype float64"
    with pytest.raises(TypeError, match=pattern):
        call(name, torch.from_numpy(q), k, torch.from_numpy(v))


@pytest.mark.parametrize("name", sorted(set(ALL) - set(WITH_BACKEND)))
def test_numpy_functions_refuse_torch_tensors(name):
    q, k, v = (torch.from_numpy(x) for x in qkv())
    pattern = rf"^{name} is a float64 numpy reference and takes numpy arrays, got q as torch.Tensor of shape \(2, 3, 5, 4\), dtype torch.float64"
    with pytest.raises(TypeError, match=pattern):
        call(name, q, k, v)


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_numpy_backend_with_torch_tensors(name):
    q, k, v = (torch.from_numpy(x) for x in qkv())
    kw = {"do": torch.ones(BATCH, HEADS, N, D_V, dtype=torch.float64)} if name in WITH_DO else {}
    with pytest.raises(TypeError, match=r"^backend='numpy' takes numpy arrays, got q as torch.Tensor.*convert with .numpy\(\)"):
        call(name, q, k, v, backend="numpy", **kw)


@pytest.mark.parametrize("name", WITH_BACKEND)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_torch_backends_with_numpy_arrays(name, backend):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"^backend='{backend}' takes torch tensors, got q as numpy.ndarray of shape \(2, 3, 5, 4\)"):
        call(name, q, k, v, backend=backend)


@pytest.mark.parametrize("name", WITH_BACKEND)
@pytest.mark.parametrize("which", ["k", "v"])
def test_torch_dtype_mismatch(name, which):
    q, k, v = (torch.from_numpy(x) for x in qkv())
    args = {"k": k, "v": v}
    args[which] = args[which].float()
    with pytest.raises(TypeError, match=rf"^{which} must have the same dtype as q \(torch.float64\), got torch.float32"):
        call(name, q, args["k"], args["v"], backend="torch")


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_torch_device_mismatch(name):
    # The meta device needs no GPU, so the device check can be exercised on any machine.
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(ValueError, match=r"^v must be on the same device as q \(cpu\), got meta"):
        call(name, q, k, v.to("meta"), backend="torch")


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_triton_backend_without_cuda_or_interpreter(name, monkeypatch):
    # _resolve_backend reads TRITON_INTERPRET at call time; "0" stands for a machine where nobody set it.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (torch.from_numpy(x).float() for x in qkv())
    kw = {"do": torch.ones(BATCH, HEADS, N, D_V)} if name in WITH_DO else {}
    with pytest.raises(ValueError, match=r"^backend='triton' needs CUDA tensors \(or TRITON_INTERPRET=1 .*\), got q on cpu$"):
        call(name, q, k, v, backend="triton", **kw)


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_torch_initial_state_on_another_device(name):
    q, k, v = (torch.from_numpy(x) for x in qkv())
    s0 = torch.zeros(BATCH, HEADS, D_K, D_V, dtype=torch.float64, device="meta")
    with pytest.raises(ValueError, match=r"^initial_state must be on the same device as q \(cpu\), got meta$"):
        call(name, q, k, v, backend="torch", initial_state=s0)


@pytest.mark.parametrize("name", WITH_BACKEND)
def test_torch_integer_tensors(name):
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(TypeError, match=r"^q must hold floating-point numbers, got dtype torch.int64"):
        call(name, q.long(), k.long(), v.long(), backend="torch")


# ---------------------------------------------------------------- decay


@pytest.mark.parametrize("name", WITH_DECAY)
@pytest.mark.parametrize("decay, given", [(0.0, "0.0"), (-0.5, "-0.5"), (1.5, "1.5"), (float("inf"), "inf"), (float("nan"), "nan")])
def test_scalar_decay_outside_unit_interval(name, decay, given):
    q, k, v = qkv()
    # A scalar is shared by every head, so no head is named.
    with pytest.raises(ValueError, match=rf"^decay must lie in \(0, 1\], got {given}$"):
        call(name, q, k, v, decay=decay)


@pytest.mark.parametrize("name", WITH_DECAY)
def test_per_head_decay_outside_unit_interval_names_the_head(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^decay must lie in \(0, 1\] \(head 2\), got 1.01$"):
        call(name, q, k, v, decay=np.array([0.5, 1.0, 1.01]))
    with pytest.raises(ValueError, match=r"^decay must lie in \(0, 1\] \(head 1\), got nan$"):
        call(name, q, k, v, decay=[0.5, float("nan"), 0.9])


@pytest.mark.parametrize("name", WITH_DECAY)
@pytest.mark.parametrize("length", [2, 4])
def test_decay_of_wrong_length(name, length):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"^decay must have one value per head: expected length {HEADS}, got length {length}$"):
        call(name, q, k, v, decay=np.full(length, 0.5))


@pytest.mark.parametrize("name", WITH_DECAY)
def test_decay_of_wrong_length_as_torch_tensor(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"^decay must have one value per head: expected length {HEADS}, got length 2$"):
        call(name, q, k, v, decay=torch.tensor([0.5, 0.5], dtype=torch.float64))


@pytest.mark.parametrize("name", WITH_DECAY)
def test_decay_two_dimensional(name):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^decay must be a scalar or 1-D with one value per head, got shape \(1, 3\)$"):
        call(name, q, k, v, decay=np.full((1, HEADS), 0.5))


@pytest.mark.parametrize("name", WITH_DECAY)
@pytest.mark.parametrize("decay", [True, False])
def test_decay_bool(name, decay):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"^decay must be a float in \(0, 1\] or one value per head, got bool {decay}$"):
        call(name, q, k, v, decay=decay)


@pytest.mark.parametrize("name", WITH_DECAY)
def test_decay_bool_array_and_tensor(name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^decay must be a float in \(0, 1\] or one value per head, got ndarray of dtype bool$"):
        call(name, q, k, v, decay=np.ones(HEADS, dtype=bool))
    with pytest.raises(TypeError, match=r"^decay must hold floats in \(0, 1\], got a tensor of dtype torch.bool$"):
        call(name, q, k, v, decay=torch.ones(HEADS, dtype=torch.bool))


@pytest.mark.parametrize("name", WITH_DECAY)
@pytest.mark.parametrize("decay, given", [("0.5", r"str of dtype <U3"), (None, "NoneType None")])
def test_decay_not_a_number(name, decay, given):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"^decay must be a float in \(0, 1\] or one value per head, got {given}$"):
        call(name, q, k, v, decay=decay)


def test_validate_decay_normalises_every_accepted_form():
    # Independent expectations: the accepted forms and the float64 (heads,) array each must become.
    expected = np.array([0.5, 0.5, 0.5])
    for decay in (0.5, np.float32(0.5), np.array(0.5)):
        out = validate_decay(decay, 3)
        assert out.dtype == np.float64 and out.shape == (3,) and np.array_equal(out, expected)
    per_head = [1.0, 0.25, 0.05]
    for decay in (per_head, np.array(per_head), torch.tensor(per_head, dtype=torch.float64)):
        assert np.array_equal(validate_decay(decay, 3), np.array(per_head))
    assert np.array_equal(validate_decay(1, 2), np.ones(2))  # the integer 1 is a valid lambda
    assert validate_decay(0.9, None).shape == (1,)


# ---------------------------------------------------------------- block_size


@pytest.mark.parametrize("name", WITH_BLOCK)
@pytest.mark.parametrize("block_size", [0, -1, np.int64(0)])
def test_block_size_not_positive(name, block_size):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=rf"^block_size must be a positive integer, got {int(block_size)}$"):
        call(name, q, k, v, block_size=block_size)


@pytest.mark.parametrize("name", WITH_BLOCK)
@pytest.mark.parametrize("block_size, given", [(2.5, "float 2.5"), (True, "bool True"), ("64", "str '64'"), (64.0, "float 64.0")])
def test_block_size_not_an_integer(name, block_size, given):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=rf"^block_size must be a positive integer or None, got {given}$"):
        call(name, q, k, v, block_size=block_size)


@pytest.mark.parametrize("block_size, given", [(None, "NoneType None"), (2.5, "float 2.5"), (True, "bool True")])
def test_a_required_block_size_refuses_none_and_says_so(block_size, given):
    with pytest.raises(TypeError, match=rf"^block_size must be a positive integer, got {given}$"):
        validate_block_size(block_size, required=True)
    assert validate_block_size(np.int64(48), required=True) == 48


def test_validate_block_size_accepts_integers_and_none():
    assert validate_block_size(None) is None
    assert validate_block_size(1) == 1
    out = validate_block_size(np.int32(16))
    assert out == 16 and type(out) is int


# ---------------------------------------------------------------- backend


@pytest.mark.parametrize("name", WITH_BACKEND)
@pytest.mark.parametrize("backend, given", [("jax", "'jax'"), ("NUMPY", "'NUMPY'")])
def test_unknown_backend(name, backend, given):
    q, k, v = qkv()
    pattern = rf"^backend must be one of \('auto', 'numpy', 'torch', 'triton'\), got {given}$"
    with pytest.raises(ValueError, match=pattern):
        call(name, q, k, v, backend=backend)


@pytest.mark.parametrize("name", WITH_BACKEND)
@pytest.mark.parametrize("backend, given", [(None, "NoneType None"), (3, "int 3"), (b"numpy", "bytes b'numpy'")])
def test_backend_not_a_string(name, backend, given):
    q, k, v = qkv()
    pattern = rf"^backend must be a string, one of \('auto', 'numpy', 'torch', 'triton'\), got {given}$"
    with pytest.raises(TypeError, match=pattern):
        call(name, q, k, v, backend=backend)


# ---------------------------------------------------------------- inputs the checks used to let through


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_masked_arrays_are_refused(name, which):
    # np.asarray would silently drop the mask and compute with the hidden values.
    args = dict(zip("qkv", qkv()))
    args[which] = np.ma.masked_array(args[which], mask=np.zeros_like(args[which], dtype=bool))
    with pytest.raises(TypeError, match=rf"^{which} must be a plain numpy array, got a numpy masked array .*\.filled\(\)$"):
        call(name, args["q"], args["k"], args["v"])


@pytest.mark.parametrize("name", WITH_DO)
def test_masked_do_and_decay_are_refused(name):
    q, k, v = qkv()
    do = np.ma.masked_array(np.ones((BATCH, HEADS, N, D_V)), mask=False)
    with pytest.raises(TypeError, match=r"^do must be a plain numpy array, got a numpy masked array"):
        call(name, q, k, v, do=do)
    with pytest.raises(TypeError, match=r"^decay must be a plain array, got a numpy masked array"):
        call(name, q, k, v, decay=np.ma.masked_array(np.full(HEADS, 0.5), mask=[0, 1, 0]))


@pytest.mark.parametrize("call_backward, as_torch", [
    (lambda q, k, v: lightning_attention_backward(q, k, v, None), False),
    (lambda q, k, v: lightning_attention_backward(q, k, v, None, backend="torch"), True),
    (lambda q, k, v: nb.blockwise_backward(q, k, v, None), False),
], ids=["api-numpy", "api-torch", "blockwise_backward"])
def test_backward_without_do(call_backward, as_torch):
    q, k, v = qkv()
    if as_torch:
        q, k, v = (torch.from_numpy(x) for x in (q, k, v))
    with pytest.raises(TypeError, match=r"^do \(the gradient dL/do, shaped like the output o\) is required .*, got None$"):
        call_backward(q, k, v)


def test_chunked_backward_without_do():
    from lightning_edu import torch_chunked as tc

    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(TypeError, match=r"^do \(the gradient dL/do, shaped like the output o\) is required"):
        tc.chunked_backward(q, k, v, None)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decay_that_requires_grad_is_learned_by_the_forward_and_refused_by_the_explicit_backward(backend):
    # The forward's autograd returns dL/dlambda (tests/test_decay_grad.py checks its value); the explicit
    # backward returns dq, dk, dv only, so it refuses rather than leave decay.grad at None silently.
    q, k, v = (torch.from_numpy(x).float() for x in qkv(d_k=16, d_v=16))
    decay = torch.full((HEADS,), 0.9, requires_grad=True)
    lightning_attention(q, k, v, decay, backend=backend).sum().backward()
    assert decay.grad is not None and decay.grad.shape == (HEADS,) and bool(torch.isfinite(decay.grad).all())
    with pytest.raises(TypeError, match=r"^decay requires grad, but this call computes no gradient .*decay.detach\(\)"):
        lightning_attention_backward(q, k, v, torch.ones_like(v), decay, backend=backend)
    with torch.no_grad():  # no graph is built, so nothing is dropped
        lightning_attention_backward(q, k, v, torch.ones_like(v), decay, backend=backend)
    lightning_attention_backward(q, k, v, torch.ones_like(v), decay.detach(), backend=backend)


def test_decay_that_requires_grad_is_checked_like_any_other():
    q, k, v = (torch.from_numpy(x).float() for x in qkv(d_k=16, d_v=16))
    with pytest.raises(ValueError, match=r"^decay must lie in \(0, 1\] \(head 1\), got 1.5"):
        lightning_attention(q, k, v, torch.tensor([0.5, 1.5, 0.9][:HEADS], requires_grad=True), backend="torch")
    with pytest.raises(ValueError, match=r"^decay must have one value per head"):
        lightning_attention(q, k, v, torch.full((HEADS + 1,), 0.5, requires_grad=True), backend="torch")


# ---------------------------------------------------------------- initial_state, do, d_final_state


@pytest.mark.parametrize("name", WITH_STATE)
@pytest.mark.parametrize("shape", [(BATCH, HEADS, D_V, D_K), (BATCH, HEADS, D_K), (1, HEADS, D_K, D_V)])
def test_initial_state_of_wrong_shape(name, shape):
    q, k, v = qkv()
    want = re.escape(str((BATCH, HEADS, D_K, D_V)))
    with pytest.raises(ValueError, match=rf"^initial_state must have shape {want}, got {re.escape(str(shape))}$"):
        call(name, q, k, v, initial_state=np.zeros(shape))


@pytest.mark.parametrize("name", WITH_STATE)
def test_initial_state_of_wrong_type(name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^initial_state must hold floating-point numbers, got dtype int64$"):
        call(name, q, k, v, initial_state=np.zeros((BATCH, HEADS, D_K, D_V), dtype=np.int64))
    with pytest.raises(TypeError, match=r"^initial_state must be the same array type as q \(numpy\), got torch.Tensor"):
        call(name, q, k, v, initial_state=torch.zeros(BATCH, HEADS, D_K, D_V))
    with pytest.raises(TypeError, match=r"^initial_state must be a numpy.ndarray or torch.Tensor, got float$"):
        call(name, q, k, v, initial_state=0.0)


@pytest.mark.parametrize("name", WITH_DO)
@pytest.mark.parametrize("shape", [(BATCH, HEADS, N, D_K), (BATCH, HEADS, N + 1, D_V), (HEADS, N, D_V)])
def test_do_of_wrong_shape(name, shape):
    q, k, v = qkv()
    want = re.escape(str((BATCH, HEADS, N, D_V)))
    with pytest.raises(ValueError, match=rf"^do must have shape {want}, got {re.escape(str(shape))}$"):
        call(name, q, k, v, do=np.ones(shape))


@pytest.mark.parametrize("name", WITH_DO)
def test_do_of_wrong_type(name):
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^do must hold floating-point numbers, got dtype int64$"):
        call(name, q, k, v, do=np.ones((BATCH, HEADS, N, D_V), dtype=np.int64))
    with pytest.raises(TypeError, match=r"^do must be the same array type as q \(numpy\), got torch.Tensor"):
        call(name, q, k, v, do=torch.ones(BATCH, HEADS, N, D_V))


@pytest.mark.parametrize("name", WITH_DO)
def test_d_final_state_of_wrong_shape(name):
    q, k, v = qkv()
    want = re.escape(str((BATCH, HEADS, D_K, D_V)))
    with pytest.raises(ValueError, match=rf"^d_final_state must have shape {want}, got \(2, 3, 6, 4\)$"):
        call(name, q, k, v, d_final_state=np.zeros((BATCH, HEADS, D_V, D_K)))


def test_torch_do_dtype_mismatch():
    q, k, v = (torch.from_numpy(x) for x in qkv())
    do = torch.ones(BATCH, HEADS, N, D_V, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"^do must have the same dtype as q \(torch.float64\), got torch.float32$"):
        validate_attention_args(q, k, v, backend="torch", do=do)


def test_validate_attention_args_normalises():
    # What the backends receive: shapes read off q and v, decay as float64 per head, auto -> numpy.
    q, k, v = qkv()
    args = validate_attention_args(q, k, v, 0.5)
    assert (args.batch, args.heads, args.seq_len, args.d_k, args.d_v) == (BATCH, HEADS, N, D_K, D_V)
    assert args.backend == "numpy" and args.kind == "numpy" and args.block_size is None
    assert np.array_equal(args.decay, np.full(HEADS, 0.5))
    targs = validate_attention_args(*(torch.from_numpy(x) for x in (q, k, v)))
    assert targs.kind == "torch" and targs.backend == "torch"  # CPU tensors: auto picks torch


# ---------------------------------------------------------------- decay_mask


@pytest.mark.parametrize("n", [0, -3])
def test_decay_mask_rejects_non_positive_n(n):
    with pytest.raises(ValueError, match=rf"^n must be a positive integer \(>= 1\), got {n}$"):
        nr.decay_mask(n, 0.5)


@pytest.mark.parametrize("n", [2.0, True, "4", None])
def test_decay_mask_rejects_n_of_the_wrong_type(n):
    with pytest.raises(TypeError, match=rf"^n must be a positive integer, got {type(n).__name__} {re.escape(repr(n))}$"):
        nr.decay_mask(n, 0.5)


@pytest.mark.parametrize("causal", [1, "yes", None])
def test_softmax_causal_must_be_a_bool(causal):
    with pytest.raises(TypeError, match=rf"^causal must be True or False, got {type(causal).__name__}"):
        nr.softmax_attention(*qkv(), causal=causal)


@pytest.mark.parametrize("scale, error", [("x", TypeError), (True, TypeError), (1j, TypeError),
                                          (float("nan"), ValueError), (float("inf"), ValueError),
                                          (-float("inf"), ValueError)])
def test_softmax_scale_must_be_a_finite_number(scale, error):
    # the wrong type is a TypeError, the right type with a non-finite value a ValueError
    with pytest.raises(error, match=r"^scale must be a finite real number, got"):
        nr.softmax_attention(*qkv(), scale=scale)


@pytest.mark.parametrize("flag", [1, "yes", None])
def test_return_state_must_be_a_bool(flag):
    with pytest.raises(TypeError, match=rf"^return_state must be True or False, got {type(flag).__name__}"):
        lightning_attention(*qkv(), return_state=flag)


def test_triton_backend_refuses_float64():
    q, k, v = (torch.from_numpy(x) for x in qkv())
    with pytest.raises(TypeError, match=r"^q \(backend='triton'\) must be float32, float16 or bfloat16 .* got float64$"):
        lightning_attention(q, k, v, backend="triton")


def test_decay_mask_rejects_bad_decay():
    with pytest.raises(ValueError, match=r"^decay must lie in \(0, 1\], got 1.5$"):
        nr.decay_mask(4, 1.5)
    with pytest.raises(ValueError, match=r"^decay must lie in \(0, 1\] \(head 1\), got 0.0$"):
        nr.decay_mask(4, [0.5, 0.0])
