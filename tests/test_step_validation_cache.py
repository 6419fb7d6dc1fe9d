"""A decoding step's arguments, checked once per signature (validation._step_signature): a step whose signature
passed before gets what a full check would give, and anything a full check refuses is refused every time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from lightning_edu import lightning_attention_step
from lightning_edu import validation
from lightning_edu.validation import _validate_step, validate_step_args


def _outcome(fn, *args):
    try:
        a = fn(*args)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    decay = a.decay.tolist() if isinstance(a.decay, np.ndarray) else a.decay
    return (id(a.q), id(a.k), id(a.v), id(a.state), decay, a.backend, a.kind, a.batch, a.heads, a.d_k, a.d_v)


decays = st.one_of(st.sampled_from([0.9, 1.0, 0.0, 1.5, float("nan"), True, 1, -0.0]),
                   st.lists(st.sampled_from([0.5, 1.0, 0.0, 2.0]), min_size=1, max_size=4),
                   st.lists(st.sampled_from([0.5, 1]), min_size=2, max_size=2))  # an int among floats: not cached


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), d_k=st.sampled_from([1, 4]), d_v=st.sampled_from([2, 4]),
       k_heads=st.integers(1, 3), state_shape=st.sampled_from(["right", "none", "wrong"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int64]), decay=decays,
       backend=st.sampled_from(["auto", "torch", "numpy", "triton", "tpu"]), grad=st.booleans())
def test_a_cached_check_answers_as_the_full_check(batch, heads, d_k, d_v, k_heads, state_shape, dtype, decay,
                                                  backend, grad):
    q = torch.zeros(batch, heads, d_k, dtype=dtype)
    k = torch.zeros(batch, k_heads, d_k, dtype=dtype)
    v = torch.zeros(batch, heads, d_v, dtype=dtype)
    state = {"right": torch.zeros(batch, heads, d_k, d_v, dtype=dtype), "none": None,
             "wrong": torch.zeros(batch, heads, d_v, d_k + 1, dtype=dtype)}[state_shape]
    with torch.set_grad_enabled(grad):
        want = _outcome(_validate_step, q, k, v, state, decay, backend, "lightning_attention_step")
        for _ in range(2):  # the first call fills the cache, the second reads it
            assert _outcome(validate_step_args, q, k, v, state, decay, backend) == want


def test_a_passed_signature_is_read_from_the_cache_and_its_decay_is_a_fresh_copy(monkeypatch):
    q, k, v = (torch.randn(2, 3, 4) for _ in range(3))
    first = validate_step_args(q, k, v, None, [0.5, 0.9, 1.0], "torch")
    calls = []
    monkeypatch.setattr(validation, "_validate_step", lambda *a: calls.append(a) or _validate_step(*a))
    again = validate_step_args(q, k, v, None, [0.5, 0.9, 1.0], "torch")
    assert calls == [] and again.q is q and again.decay.tolist() == [0.5, 0.9, 1.0]
    assert again.decay is not first.decay
    again.decay[0] = 7.0  # the caller's copy: the cache keeps its own
    assert validate_step_args(q, k, v, None, [0.5, 0.9, 1.0], "torch").decay[0] == 0.5
    # other values of the decay, another signature: checked in full
    validate_step_args(q, k, v, None, [0.5, 0.9, 0.8], "torch")
    assert len(calls) == 1


def test_the_interpreter_switch_is_part_of_the_signature(monkeypatch):
    q, k, v = (torch.randn(1, 2, 16) for _ in range(3))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate_step_args(q, k, v, None, 0.9, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        validate_step_args(q, k, v, None, 0.9, "triton")


def test_a_cpu_tensor_decay_is_checked_every_time():
    q, k, v = (torch.randn(1, 2, 4) for _ in range(3))
    decay = torch.tensor([0.5, 0.9])
    lightning_attention_step(q, k, v, None, decay, backend="torch")
    decay[1] = 1.5  # the same tensor, now out of range: its values are read again
    with pytest.raises(ValueError, match=r"decay must lie in \(0, 1\] \(head 1\), got 1.5"):
        lightning_attention_step(q, k, v, None, decay, backend="torch")


def test_the_step_gives_the_same_result_from_the_cache():
    q, k, v = (torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(3))
    state = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    first = lightning_attention_step(q, k, v, state, [0.5, 0.9, 1.0], backend="torch")
    second = lightning_attention_step(q, k, v, state, [0.5, 0.9, 1.0], backend="torch")
    for a, b in zip(first, second):
        assert torch.equal(a, b)
