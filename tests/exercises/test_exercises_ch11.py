"""Chapter 11's checkers: right answers pass, each planted mistake is named, broken answers never crash a check."""

import numpy as np
import pytest

import lightning_edu as le
from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch11 import check_hybrid_weights, check_normalized_via_ones
from lightning_edu.numpy_reference import elu_plus_one


def _linear(phi_q, phi_k, v, lam):
    one = lambda x: x[None, None]  # noqa: E731
    return le.lightning_attention(one(phi_q), one(phi_k), one(v), lam)[0, 0]


def via_ones(phi_q, phi_k, v, lam, eps):
    out = _linear(phi_q, phi_k, np.concatenate([v, np.ones((v.shape[0], 1))], axis=1), lam)
    return out[:, :-1] / (out[:, -1:] + eps)


def no_eps(phi_q, phi_k, v, lam, eps):
    return via_ones(phi_q, phi_k, v, lam, 0.0)


def z_without_decay(phi_q, phi_k, v, lam, eps):
    num = _linear(phi_q, phi_k, v, lam)
    return num / (np.einsum("tf,tf->t", phi_q, np.cumsum(phi_k, axis=0))[:, None] + eps)


def z_late(phi_q, phi_k, v, lam, eps):
    num = _linear(phi_q, phi_k, v, lam)
    z, den = np.zeros(phi_k.shape[1]), np.zeros(len(phi_q))
    for t in range(len(phi_q)):
        den[t] = phi_q[t] @ z
        z = lam * z + phi_k[t]
    return num / (den[:, None] + eps)


def test_normalized_via_ones_passes_and_names_each_mistake():
    check_normalized_via_ones(via_ones)
    for fn, words in ((no_eps, "eps is missing"), (z_without_decay, "no decay"), (z_late, "one token late")):
        with pytest.raises(ExerciseError, match=words):
            check_normalized_via_ones(fn)


@pytest.mark.parametrize("fn, words", [
    (lambda *a: None, "returned None"), (lambda *a: [[0.0]], "must return a numpy array"),
    (lambda *a: np.zeros(3), "shape"), (lambda *a: 1 / 0, "ZeroDivisionError"),
    (lambda phi_q, phi_k, v, lam, eps: np.full(v.shape, np.nan), "NaN or inf in row 0"),
    (lambda *a: "text", "not an array|shape"),
])
def test_normalized_via_ones_reports_broken_answers(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_normalized_via_ones(fn)


def _hybrid(q, k, block, *, separate=False, subtract_max=True, causal=True, joint=True):
    n, d = q.shape
    scores = q @ k.T / np.sqrt(d)
    t = np.arange(n)
    same = (t[:, None] // block) == (t[None, :] // block)
    keep = (t[:, None] >= t[None, :]) if causal else np.ones((n, n), bool)
    earlier = t[None, :] < (t[:, None] // block) * block
    lin = np.where(earlier, elu_plus_one(q) @ elu_plus_one(k).T, 0.0)
    intra = np.where(same & keep, scores, -np.inf)
    m = intra.max(axis=1, keepdims=True) if subtract_max else np.zeros((n, 1))
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp(intra - m)
        if separate:
            return e / e.sum(axis=1, keepdims=True) + lin / np.maximum(lin.sum(axis=1, keepdims=True), 1e-6)
        if joint and subtract_max:  # one scale M = max(m, log a) for both parts, a the linear part's size
            a = lin.max(axis=1, keepdims=True)
            big = np.maximum(m, np.log(np.where(a > 0, a, 1.0)))
            e = np.exp(intra - big)
            m = big
        w = e + lin * np.exp(-m)
        return w / w.sum(axis=1, keepdims=True)


def test_hybrid_weights_passes_and_names_each_mistake():
    check_hybrid_weights(_hybrid)
    with pytest.raises(ExerciseError, match="sum to 2"):
        check_hybrid_weights(lambda q, k, b: _hybrid(q, k, b, separate=True))
    with pytest.raises(ExerciseError, match="overflows"):
        check_hybrid_weights(lambda q, k, b: _hybrid(q, k, b, subtract_max=False))
    with pytest.raises(ExerciseError, match="in-block maximum m alone is not enough.*joint"):
        check_hybrid_weights(lambda q, k, b: _hybrid(q, k, b, joint=False))
    with pytest.raises(ExerciseError, match="later keys"):
        check_hybrid_weights(lambda q, k, b: _hybrid(q, k, b, causal=False))
    with pytest.raises(ExerciseError, match="causal softmax over every earlier key"):
        check_hybrid_weights(_causal_softmax)
    with pytest.raises(ExerciseError, match="calls lightning_edu.feature_maps.attention_weights: write the algorithm"):
        check_hybrid_weights(lambda q, k, b: le.feature_maps.attention_weights(q, k, "softmax"))


def _causal_softmax(q, k, block_size):
    n, d = q.shape
    scores = np.where(np.tri(n, dtype=bool), q @ k.T / np.sqrt(d), -np.inf)
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("fn, words", [
    (lambda *a: None, "returned None"), (lambda q, k, b: np.zeros((2, 2)), "shape"),
    (lambda *a: {}["x"], "KeyError"), (lambda q, k, b: np.full((len(q), len(q)), np.inf), "NaN or inf"),
])
def test_hybrid_weights_reports_broken_answers(fn, words):
    with pytest.raises(ExerciseError, match=words):
        check_hybrid_weights(fn)
