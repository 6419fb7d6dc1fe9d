"""One decoding step, ``lightning_attention_step``: the recurrence advanced by one token.

Checked against one step of the recurrence written out below, against a prefill followed by steps (which must
give the outputs and the final state of one parallel call over all the tokens), through autograd, in 16-bit
dtypes, with a NaN in one head, for every argument error, and through its three registry records.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import lightning_edu as le
from lightning_edu import registry
from lightning_edu.checks import relative_error
from lightning_edu.validation import validate_attention_args, validate_step_args

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TRITON_DEVICE = DEVICES[-1]  # with CUDA present the interpreter is off: the kernels take CUDA tensors only
BATCH, HEADS, D_K, D_V = 2, 3, 5, 7
DECAY = [1.0, 0.9, 1e-3]  # no decay, a typical one, and one that forgets almost everything at once
STEP_RECORDS = ("numpy.step", "torch.step", "triton.decode")


def one_step(q, k, v, state, decay):
    """The recurrence's step, per batch and head: S = lambda S + outer(k, v), o = q S (float64)."""
    batch, heads, d_k = q.shape
    d_v = v.shape[-1]
    o, new_state = np.zeros((batch, heads, d_v)), np.zeros((batch, heads, d_k, d_v))
    for b in range(batch):
        for h in range(heads):
            previous = np.zeros((d_k, d_v)) if state is None else state[b, h]
            new_state[b, h] = decay[h] * previous + np.outer(k[b, h], v[b, h])
            o[b, h] = q[b, h] @ new_state[b, h]
    return o, new_state


def step_inputs(seed=0, batch=BATCH, heads=HEADS, d_k=D_K, d_v=D_V):
    """float64 q, k (batch, heads, d_k), v (batch, heads, d_v) and a state (batch, heads, d_k, d_v)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, heads, d_k)), rng.standard_normal((batch, heads, d_k)),
            rng.standard_normal((batch, heads, d_v)), rng.standard_normal((batch, heads, d_k, d_v)))


def _torch(x, dtype, device="cpu"):
    return None if x is None else torch.from_numpy(x).to(device, dtype)


# ---------------------------------------------------------------- the numpy step is the recurrence's step


@pytest.mark.parametrize("with_state", [False, True], ids=["state None", "state given"])
@pytest.mark.parametrize("decay", [DECAY, 0.5, 1.0], ids=["per head", "0.5", "1.0"])
def test_numpy_step_is_one_step_of_the_recurrence(with_state, decay):
    q, k, v, state = step_inputs()
    state = state if with_state else None
    per_head = np.broadcast_to(np.asarray(decay, dtype=np.float64), (HEADS,))
    want_o, want_state = one_step(q, k, v, state, per_head)
    o, new_state = le.lightning_attention_step(q, k, v, state, decay)  # "auto": numpy for numpy arrays
    assert isinstance(o, np.ndarray) and o.dtype == np.float64 and o.shape == (BATCH, HEADS, D_V)
    assert new_state.dtype == np.float64 and new_state.shape == (BATCH, HEADS, D_K, D_V)
    assert relative_error(o, want_o) < 1e-14
    assert relative_error(new_state, want_state) < 1e-14


def test_numpy_step_returns_float64_for_float32_arrays():
    q, k, v, state = (x.astype(np.float32) for x in step_inputs())
    o, new_state = le.lightning_attention_step(q, k, v, state, DECAY, backend="numpy")
    assert o.dtype == np.float64 and new_state.dtype == np.float64
    want_o, want_state = one_step(*(x.astype(np.float64) for x in (q, k, v, state)), DECAY)
    assert relative_error(o, want_o) < 1e-14 and relative_error(new_state, want_state) < 1e-14


def test_numpy_step_does_not_change_the_state_it_is_given():
    q, k, v, state = step_inputs()
    before = state.copy()
    le.lightning_attention_step(q, k, v, state, DECAY)
    assert np.array_equal(state, before)


# ---------------------------------------------------------------- prefill, then decode = the parallel form

PREFILL_CASES = [
    pytest.param("numpy", "float64", 1e-12, id="numpy-float64"),
    pytest.param("torch", "float64", 1e-12, id="torch-float64"),
    pytest.param("torch", "float32", 1e-5, id="torch-float32"),
    pytest.param("triton", "float32", 1e-5, id="triton-float32"),
]


@pytest.mark.parametrize("backend, dtype, tol", PREFILL_CASES)
@pytest.mark.parametrize("n, m", [(0, 3), (1, 4), (13, 5)], ids=lambda x: str(x))
def test_prefill_then_decode_equals_one_parallel_call(backend, dtype, tol, n, m):
    rng = np.random.default_rng(n + m)
    shapes = [(BATCH, HEADS, n + m, D_K)] * 2 + [(BATCH, HEADS, n + m, D_V)]
    # Rounded to the dtype under test first: the float64 reference sees exactly the inputs the backend sees.
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).to(getattr(torch, dtype)).double().numpy() for s in shapes)
    if backend == "numpy":
        data = (q, k, v)
    else:
        device = TRITON_DEVICE if backend == "triton" else "cpu"
        data = tuple(_torch(x, getattr(torch, dtype), device) for x in (q, k, v))
    dq, dk, dv = data

    state, outputs = None, []
    if n > 0:  # lightning_attention needs at least one token: with n = 0 decoding starts from state None
        _, state = le.lightning_attention(dq[:, :, :n], dk[:, :, :n], dv[:, :, :n], DECAY, backend=backend,
                                          return_state=True)
    for t in range(n, n + m):
        o_t, state = le.lightning_attention_step(dq[:, :, t], dk[:, :, t], dv[:, :, t], state, DECAY, backend=backend)
        outputs.append(o_t)
    stack = np.stack if backend == "numpy" else torch.stack
    decoded = stack(outputs, 2)

    truth_o, truth_state = le.lightning_attention(q, k, v, DECAY, backend="numpy", return_state=True)
    assert relative_error(decoded, truth_o[:, :, n:]) < tol, "o against the float64 parallel form"
    assert relative_error(state, truth_state) < tol, "final state against the float64 parallel form"
    same_o, same_state = le.lightning_attention(dq, dk, dv, DECAY, backend=backend, return_state=True)
    assert relative_error(decoded, same_o[:, :, n:]) < tol, f"o against the {backend} parallel form"
    assert relative_error(state, same_state) < tol, f"final state against the {backend} parallel form"


# ---------------------------------------------------------------- torch: autograd and dtypes


@pytest.mark.parametrize("with_state", [False, True], ids=["state None", "state given"])
def test_torch_step_is_differentiable(with_state):
    q, k, v, state = (_torch(x, torch.float64).requires_grad_() for x in step_inputs(batch=1, heads=2, d_k=3, d_v=2))
    decay = [0.7, 1.0]
    if with_state:
        fn = lambda q, k, v, s: le.lightning_attention_step(q, k, v, s, decay, backend="torch")  # noqa: E731
        inputs = (q, k, v, state)
    else:
        fn = lambda q, k, v: le.lightning_attention_step(q, k, v, None, decay, backend="torch")  # noqa: E731
        inputs = (q, k, v)
    assert torch.autograd.gradcheck(fn, inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_16_bit_step_keeps_the_state_in_float32(dtype):
    q, k, v, state = step_inputs()
    tq, tk, tv = (_torch(x, dtype) for x in (q, k, v))
    q, k, v = (x.double().numpy() for x in (tq, tk, tv))  # the inputs as rounded
    o, new_state = le.lightning_attention_step(tq, tk, tv, None, DECAY, backend="torch")
    assert o.dtype == dtype and new_state.dtype == torch.float32
    want_o, want_state = one_step(q, k, v, None, DECAY)
    assert relative_error(o, want_o) < registry.TOLERANCES[str(dtype).replace("torch.", "")]
    assert relative_error(new_state, want_state) < 1e-6
    # The float32 state goes into the next step as it is, and comes out float32 again.
    o2, state2 = le.lightning_attention_step(tq, tk, tv, new_state, DECAY, backend="torch")
    assert o2.dtype == dtype and state2.dtype == torch.float32
    want_o2, want_state2 = one_step(q, k, v, new_state.double().numpy(), DECAY)
    assert relative_error(state2, want_state2) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_32_and_64_bit_step_keeps_the_input_dtype(dtype):
    q, k, v, state = (_torch(x, dtype) for x in step_inputs())
    o, new_state = le.lightning_attention_step(q, k, v, state, DECAY)  # "auto": torch for CPU tensors
    assert o.dtype == dtype and new_state.dtype == dtype


# ---------------------------------------------------------------- non-finite values stay in their head


def _nonfinite_backends():
    yield pytest.param("numpy", None, id="numpy")
    yield pytest.param("torch", torch.float64, id="torch-float64")
    yield pytest.param("torch", torch.float32, id="torch-float32")
    yield pytest.param("triton", torch.float32, id="triton-float32")


@pytest.mark.parametrize("backend, dtype", list(_nonfinite_backends()))
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_non_finite_k_in_one_head_leaves_the_other_heads_alone(backend, dtype, bad):
    q, k, v, state = step_inputs()
    k_bad = k.copy()
    k_bad[:, 1, 2] = bad  # head 1, one entry of k

    def run(k_):
        if backend == "numpy":
            return le.lightning_attention_step(q, k_, v, state, DECAY, backend=backend)
        device = TRITON_DEVICE if backend == "triton" else "cpu"
        o, s = le.lightning_attention_step(*(_torch(x, dtype, device) for x in (q, k_, v, state)), DECAY,
                                           backend=backend)
        return o.double().cpu().numpy(), s.double().cpu().numpy()

    o, new_state = run(k_bad)
    clean_o, clean_state = run(k)
    others = [0, 2]
    assert np.isfinite(o[:, others]).all() and np.isfinite(new_state[:, others]).all()
    assert np.array_equal(o[:, others], clean_o[:, others])
    assert np.array_equal(new_state[:, others], clean_state[:, others])
    # In head 1, row 2 of k^T v is non-finite, and every output meets it through q.
    assert not np.isfinite(new_state[:, 1, 2]).any()
    assert np.isfinite(np.delete(new_state[:, 1], 2, axis=1)).all()
    assert not np.isfinite(o[:, 1]).any()


# ---------------------------------------------------------------- every argument error names the argument


def _np():
    return step_inputs(d_k=4, d_v=6)  # q, k (2, 3, 4); v (2, 3, 6); state (2, 3, 4, 6)


def _t(dtype=torch.float64, device="cpu"):
    return [_torch(x, dtype, device) for x in _np()]


def _with(i, x, base=None):
    """The valid numpy (or given) q, k, v, state with argument i replaced by x."""
    args = list(_np() if base is None else base)
    args[i] = x
    return args


Q, K, V, S = range(4)
BAD = [
    # label, the argument the message must name, build -> (positional args, keywords), exception, pattern
    ("q 2-D", "q", lambda: (_with(Q, _np()[Q][0]), {}), ValueError,
     r"^q must be 3-D \(batch, heads, d_k\), got 2-D shape \(3, 4\)$"),
    ("v 2-D", "v", lambda: (_with(V, _np()[V][0]), {}), ValueError,
     r"^v must be 3-D \(batch, heads, d_v\), got 2-D shape \(3, 6\)$"),
    ("q with a sequence axis of length 1", "q", lambda: (_with(Q, _np()[Q][:, :, None]), {}), ValueError,
     r"^q must be 3-D \(batch, heads, d_k\), got 4-D shape \(2, 3, 1, 4\): .*drop it \(q\[:, :, 0\]\)$"),
    ("k with a sequence axis of length 1", "k", lambda: (_with(K, _np()[K][:, :, None]), {}), ValueError,
     r"^k must be 3-D \(batch, heads, d_k\), got 4-D shape \(2, 3, 1, 4\): .*drop it \(k\[:, :, 0\]\)$"),
    ("v with a sequence axis of length 5", "v", lambda: (_with(V, np.zeros((2, 3, 5, 6))), {}), ValueError,
     r"^v must be 3-D \(batch, heads, d_v\), got 4-D shape \(2, 3, 5, 6\): .*call lightning_attention$"),
    ("k batch mismatch", "k", lambda: (_with(K, np.zeros((4, 3, 4))), {}), ValueError,
     r"^k must match q in batch \(axis 0\): expected 2, got 4 \(shape \(4, 3, 4\)\)$"),
    ("v heads mismatch", "v", lambda: (_with(V, np.zeros((2, 6, 6))), {}), ValueError,
     r"^v must match q in heads \(axis 1\): expected 3, got 6 \(shape \(2, 6, 6\)\)$"),
    ("k d_k mismatch", "k", lambda: (_with(K, np.zeros((2, 3, 3))), {}), ValueError,
     r"^k must have the same d_k as q \(axis 2\): expected 4, got 3$"),
    ("state transposed", "state", lambda: (_with(S, np.zeros((2, 3, 6, 4))), {}), ValueError,
     r"^state must have shape \(batch, heads, d_k, d_v\) = \(2, 3, 4, 6\), got \(2, 3, 6, 4\)$"),
    ("state 3-D", "state", lambda: (_with(S, np.zeros((2, 3, 4))), {}), ValueError,
     r"^state must have shape \(batch, heads, d_k, d_v\) = \(2, 3, 4, 6\), got \(2, 3, 4\)$"),
    ("state of another batch", "state", lambda: (_with(S, np.zeros((1, 3, 4, 6))), {}), ValueError,
     r"^state must have shape .* = \(2, 3, 4, 6\), got \(1, 3, 4, 6\)$"),
    ("an empty batch", "q", lambda: ([x[:0] for x in _np()], {}), ValueError,
     r"^every axis must have length >= 1, got q \(0, 3, 4\) and v \(0, 3, 6\)$"),
    ("q of integers", "q", lambda: (_with(Q, _np()[Q].astype(np.int64)), {}), TypeError,
     r"^q must hold floating-point numbers, got dtype int64$"),
    ("v of complex numbers", "v", lambda: (_with(V, _np()[V].astype(np.complex128)), {}), TypeError,
     r"^v must hold floating-point numbers, got dtype complex128$"),
    ("state of integers", "state", lambda: (_with(S, _np()[S].astype(np.int32)), {}), TypeError,
     r"^state must hold floating-point numbers, got dtype int32$"),
    ("torch q of integers", "q", lambda: ([x.long() for x in _t()], {}), TypeError,
     r"^q must hold floating-point numbers, got dtype torch.int64$"),
    ("q a list", "q", lambda: (_with(Q, _np()[Q].tolist()), {}), TypeError,
     r"^q must be a numpy.ndarray or torch.Tensor, got list$"),
    ("q a masked array", "q", lambda: (_with(Q, np.ma.masked_array(_np()[Q], mask=False)), {}), TypeError,
     r"^q must be a plain numpy array, got a numpy masked array .*\.filled\(\)$"),
    ("decay 0", "decay", lambda: (_np(), {"decay": 0.0}), ValueError, r"^decay must lie in \(0, 1\], got 0.0$"),
    ("decay 1.5", "decay", lambda: (_np(), {"decay": 1.5}), ValueError, r"^decay must lie in \(0, 1\], got 1.5$"),
    ("decay NaN", "decay", lambda: (_np(), {"decay": float("nan")}), ValueError,
     r"^decay must lie in \(0, 1\], got nan$"),
    ("decay above 1 in head 2", "decay", lambda: (_np(), {"decay": [0.5, 1.0, 1.01]}), ValueError,
     r"^decay must lie in \(0, 1\] \(head 2\), got 1.01$"),
    ("decay of the wrong length", "decay", lambda: (_np(), {"decay": [0.5, 0.5]}), ValueError,
     r"^decay must have one value per head: expected length 3, got length 2$"),
    ("decay a bool", "decay", lambda: (_np(), {"decay": True}), TypeError,
     r"^decay must be a float in \(0, 1\] or one value per head, got bool True$"),
    ("decay requires grad", "decay", lambda: (_np(), {"decay": torch.full((3,), 0.5, requires_grad=True),
                                                     "backend": "numpy"}), TypeError,
     r"^decay requires grad, but this call computes no gradient .*backend 'torch', do\); pass decay.detach\(\)"),
    ("numpy q, torch k", "k", lambda: (_with(K, _t()[K]), {}), TypeError,
     r"^k must be the same array type as q \(numpy\), got torch.Tensor of shape \(2, 3, 4\).*do not mix numpy "
     r"and torch$"),
    ("numpy q, torch state", "state", lambda: (_with(S, _t()[S]), {}), TypeError,
     r"^state must be the same array type as q \(numpy\), got torch.Tensor .*do not mix numpy and torch$"),
    ("torch q, numpy state", "state", lambda: (_with(S, _np()[S], _t()), {}), TypeError,
     r"^state must be the same array type as q \(torch\), got numpy.ndarray of shape \(2, 3, 4, 6\)"),
    ("torch k of another dtype", "k", lambda: (_with(K, _t()[K].float(), _t()), {}), TypeError,
     r"^k must have the same dtype as q \(torch.float64\), got torch.float32$"),
    ("torch v on another device", "v", lambda: (_with(V, _t()[V].to("meta"), _t()), {}), ValueError,
     r"^v must be on the same device as q \(cpu\), got meta$"),
    ("torch state on another device", "state", lambda: (_with(S, _t()[S].to("meta"), _t()), {}), ValueError,
     r"^state must be on the same device as q \(cpu\), got meta$"),
    ("unknown backend", "backend", lambda: (_np(), {"backend": "jax"}), ValueError,
     r"^backend must be one of \('auto', 'numpy', 'torch', 'triton'\), got 'jax'$"),
    ("backend not a string", "backend", lambda: (_np(), {"backend": 3}), TypeError,
     r"^backend must be a string, one of \('auto', 'numpy', 'torch', 'triton'\), got int 3$"),
    ("numpy backend, torch tensors", "backend", lambda: (_t(), {"backend": "numpy"}), TypeError,
     r"^backend='numpy' takes numpy arrays, got q as torch.Tensor"),
    ("torch backend, numpy arrays", "backend", lambda: (_np(), {"backend": "torch"}), TypeError,
     r"^backend='torch' takes torch tensors, got q as numpy.ndarray"),
    ("triton backend, numpy arrays", "backend", lambda: (_np(), {"backend": "triton"}), TypeError,
     r"^backend='triton' takes torch tensors, got q as numpy.ndarray"),
    ("triton backend, float64", "q", lambda: (_t(torch.float64, TRITON_DEVICE), {"backend": "triton"}), TypeError,
     r"^q \(backend='triton'\) must be float32, float16 or bfloat16 for the Triton kernels, got float64$"),
    ("triton backend, d_v 272", "d_v",
     lambda: (_with(V, torch.zeros(2, 3, 272, device=TRITON_DEVICE), _t(torch.float32, TRITON_DEVICE))[:3],
              {"backend": "triton"}), ValueError,
     r"^backend='triton' supports d_k, d_v <= 256 \(its state lives on chip\), got d_k=4, d_v=272$"),
]


@pytest.mark.parametrize("label, name, build, exc, pattern", BAD, ids=[row[0] for row in BAD])
def test_every_argument_error_names_the_argument(label, name, build, exc, pattern):
    args, kwargs = build()
    with pytest.raises(exc, match=pattern) as info:
        le.lightning_attention_step(*args, **kwargs)
    assert name in str(info.value)
    # The checks live in validation.py: the validator itself raises the same error.
    decay = kwargs.get("decay", 1.0)
    with pytest.raises(exc, match=pattern):
        validate_step_args(*args, *([None] * (4 - len(args))), decay, kwargs.get("backend", "auto"))


def test_triton_backend_refused_on_cpu_without_the_interpreter(monkeypatch):
    # _resolve_backend reads TRITON_INTERPRET at call time; "0" stands for a machine where nobody set it.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, state = _t(torch.float32)
    pattern = r"^backend='triton' needs CUDA tensors \(or TRITON_INTERPRET=1 .*\), got q on cpu$"
    with pytest.raises(ValueError, match=pattern):
        le.lightning_attention_step(q, k, v, state, backend="triton")


def test_validate_step_args_normalises():
    q, k, v, state = _np()
    args = validate_step_args(q, k, v, None, 0.5)
    assert (args.backend, args.kind, args.batch, args.heads, args.d_k, args.d_v) == ("numpy", "numpy", 2, 3, 4, 6)
    assert args.state is None and args.decay.dtype == np.float64 and np.array_equal(args.decay, np.full(3, 0.5))
    targs = validate_step_args(*_t(torch.float32), [1.0, 0.5, 0.1], "auto")  # CPU tensors
    assert targs.backend == "torch" and targs.kind == "torch" and targs.state is not None


# ---------------------------------------------------------------- the registry records


def test_the_step_records_are_registered_as_backends_of_op_step():
    for name in STEP_RECORDS:
        impl = registry.get(name)
        assert impl.op == "step" and impl.backend, name
        assert impl.initial_state and impl.final_state and not impl.has_backward, name
        assert registry.backend_for(impl.rung, op="step") is impl
    assert registry.backend_for("triton", op="step").name == "triton.decode"
    assert registry.get("numpy.step").checked_against is None  # the ground truth of the step
    assert registry.get("torch.step").checked_against == "numpy.step" and registry.get("torch.step").differentiable
    assert registry.get("torch.step").dtypes == ("float64", "float32", "float16", "bfloat16")
    decode = registry.get("triton.decode")
    assert decode.checked_against == "torch.step" and decode.dtypes == ("float32", "float16", "bfloat16")
    assert decode.bench is None and decode.max_head_dim == 256
    assert decode.forward_path == "lightning_edu.triton_kernels.hooks:decode_from_args"
    # The sequence backends are unchanged, and stay the default op.
    backends = [registry.backend_for(rung).name for rung in registry.RUNGS]
    assert backends == ["numpy.blockwise", "torch.chunked", "triton.la2_fast"]
    assert all(registry.backend_for(r, op="attention").op == "attention" for r in registry.RUNGS)
    with pytest.raises(ValueError, match=r"^\(rung, op\) must be one of .*got \('numpy', 'decode'\)$"):
        registry.backend_for("numpy", op="decode")


def _record_cases():
    for impl in registry.IMPLEMENTATIONS.values():
        if impl.op != "step" or impl.checked_against is None:
            continue
        for device in DEVICES:
            if device == "cuda" and impl.rung == "numpy":
                continue
            if device == "cpu" and impl.rung == "triton" and "cuda" in DEVICES:
                continue  # with CUDA present the interpreter is off: kernels take CUDA tensors only
            for dtype in impl.dtypes:
                yield pytest.param(impl.name, device, dtype, id=f"{impl.name}-{device}-{dtype}")


def _run_record(impl, q, k, v, state, device, dtype):
    if impl.rung != "numpy":
        q, k, v = (_torch(x, getattr(torch, dtype), device) for x in (q, k, v))
        state_dtype = torch.float32 if dtype in ("float16", "bfloat16") else getattr(torch, dtype)
        state = _torch(state, state_dtype, device)  # states are float32 at least
    args = validate_step_args(q, k, v, state, DECAY, impl.rung)
    registry.check_supports(impl, args)
    return impl.forward(args)


@pytest.mark.parametrize("name, device, dtype", list(_record_cases()))
@pytest.mark.parametrize("with_state", [False, True], ids=["state None", "state given"])
def test_step_record_matches_the_one_it_is_checked_against(name, device, dtype, with_state):
    impl = registry.get(name)
    ref = registry.get(impl.checked_against)
    q, k, v, state = step_inputs(seed=1, d_k=16, d_v=24)
    state_dtype = "float32" if dtype in ("float16", "bfloat16") else dtype
    # Rounded to the dtype under test first: the float64 reference sees exactly the inputs the record sees.
    q, k, v = (_torch(x, getattr(torch, dtype)).double().numpy() for x in (q, k, v))
    state = _torch(state, getattr(torch, state_dtype)).double().numpy() if with_state else None
    o, new_state = _run_record(impl, q, k, v, state, device, dtype)
    want_o, want_state = _run_record(ref, q, k, v, state, "cpu", "float64")
    assert o.shape == (BATCH, HEADS, 24) and tuple(new_state.shape) == (BATCH, HEADS, 16, 24)
    if impl.rung != "numpy":
        assert o.dtype == getattr(torch, dtype) and new_state.dtype == getattr(torch, state_dtype)
    tol = registry.TOLERANCES[dtype]
    assert relative_error(o, want_o) < tol, "o"
    assert relative_error(new_state, want_state) < tol, "new state"


def test_the_api_runs_the_step_record_of_the_chosen_backend(monkeypatch):
    from lightning_edu import numpy_reference, torch_chunked
    from lightning_edu.triton_kernels import hooks

    calls = []
    for module, name in ((numpy_reference, "numpy.step"), (torch_chunked, "torch.step"), (hooks, "triton.decode")):
        real = getattr(module, "step_from_args" if module is not hooks else "decode_from_args")

        def spy(args, _real=real, _name=name, **kw):
            calls.append(_name)
            if _name == "triton.decode":  # records the dispatch only: the kernel is tested above
                return args.q, args.state
            return _real(args, **kw)

        monkeypatch.setattr(module, "step_from_args" if module is not hooks else "decode_from_args", spy)
    q, k, v, state = _np()
    le.lightning_attention_step(q, k, v, state)
    le.lightning_attention_step(*_t(torch.float32))
    le.lightning_attention_step(*_t(torch.float32, TRITON_DEVICE), backend="triton")
    assert calls == ["numpy.step", "torch.step", "triton.decode"]  # "auto" with numpy, "auto" with CPU tensors


def test_check_supports_keeps_steps_and_sequences_apart():
    q, k, v, state = _t(torch.float32)
    step_args = validate_step_args(q, k, v, state, 0.5, "torch")
    seq = torch.ones(1, 1, 4, 16)
    seq_args = validate_attention_args(seq, seq, seq, backend="torch")
    with pytest.raises(TypeError, match=r"^implementation 'torch.step' computes op 'step', so it takes StepArgs, "
                                        r"got AttentionArgs$"):
        registry.check_supports(registry.get("torch.step"), seq_args)
    with pytest.raises(TypeError, match=r"^implementation 'torch.chunked' computes op 'attention', so it takes "
                                        r"AttentionArgs, got StepArgs$"):
        registry.check_supports(registry.get("torch.chunked"), step_args)
    f64 = validate_step_args(*_t(torch.float64), 0.5, "torch")
    with pytest.raises(TypeError, match=r"must be float32, float16 or bfloat16 for the Triton kernels, got float64$"):
        registry.check_supports(registry.get("triton.decode"), f64)
    wide = validate_step_args(*(_torch(x, torch.float32) for x in step_inputs(d_k=4, d_v=272)), 0.5, "torch")
    with pytest.raises(ValueError, match=r"^implementation 'triton.decode' supports d_k, d_v <= 256"):
        registry.check_supports(registry.get("triton.decode"), wide)


def test_register_keeps_one_step_backend_per_rung_and_one_op_per_chain():
    step = registry.get("numpy.step")
    with pytest.raises(ValueError, match=r"^rung 'numpy' already has a backend implementation of op 'step'$"):
        registry.register(registry.Implementation(**{**step.__dict__, "name": "numpy.step2"}))
    with pytest.raises(ValueError, match=r"^op must be one of \('attention', 'step'\), got 'decode' for 'numpy.x'$"):
        registry.register(registry.Implementation(**{**step.__dict__, "name": "numpy.x", "op": "decode"}))
    with pytest.raises(ValueError, match=r"computes op 'step' but is checked against 'numpy.recurrent', which"):
        registry.register(registry.Implementation(**{**step.__dict__, "name": "numpy.y", "backend": False,
                                                     "checked_against": "numpy.recurrent"}))
    assert not {"numpy.step2", "numpy.x", "numpy.y"} & set(registry.IMPLEMENTATIONS)
