"""Exercise checkers of chapters 01-03: right solutions pass, typical mistakes fail with a message that teaches."""

import math

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises import ch01, ch02, ch03
from lightning_edu.numpy_reference import elu_plus_one


def _raises(check, fn, *fragments):
    with pytest.raises(ExerciseError) as info:
        check(fn)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---------------------------------------------------------------- chapter 01

def right_ok(q, k, v):
    return q @ (k.swapaxes(-1, -2) @ v)


def test_right_product_passes(capsys):
    ch01.check_right_product(right_ok)
    assert capsys.readouterr().out.startswith("Correct:")


def test_right_product_left_order_fails_on_memory():
    _raises(ch01.check_right_product, lambda q, k, v: (q @ k.swapaxes(-1, -2)) @ v, "n x n matrix", "Q (K^T V)")


def test_right_product_k_dot_T_gets_swapaxes_hint():
    _raises(ch01.check_right_product, lambda q, k, v: q @ (k.T @ v), "swapaxes", "reverses all four axes")


def test_right_product_wrong_values_and_none():
    _raises(ch01.check_right_product, lambda q, k, v: 2 * right_ok(q, k, v), "differs first in rows", "contract k and v")
    _raises(ch01.check_right_product, lambda q, k, v: None, "forget `return`")


def test_flop_counts():
    ch01.check_flop_counts(lambda n, dk, dv: (2 * n * n * (dk + dv), 4 * n * dk * dv))
    _raises(ch01.check_flop_counts, lambda n, dk, dv: (4 * n * dk * dv, 2 * n * n * (dk + dv)), "swapped")
    _raises(ch01.check_flop_counts, lambda n, dk, dv: (n * n * (dk + dv), 2 * n * dk * dv), "multiply-add as 2 FLOPs")
    _raises(ch01.check_flop_counts, lambda n, dk, dv: (4 * n * n * dk, 4 * n * dk * dk), "d_k and d_v differ")
    _raises(ch01.check_flop_counts, lambda n, dk, dv: (2 * n * n * (dk + dv), 2 * n * dk * dv + 1), "K^T V costs 2 n d_k d_v")
    _raises(ch01.check_flop_counts, lambda n, dk, dv: None, "forget")


def _normalized_ok(q, k, v):
    pq, pk = elu_plus_one(q), elu_plus_one(k)
    num = pq @ (pk.swapaxes(-1, -2) @ v)
    den = pq @ pk.sum(axis=-2)[..., None]
    return num / den


def test_normalized_linear_attention():
    ch01.check_normalized_linear_attention(_normalized_ok)

    def numerator_only(q, k, v):
        pq, pk = elu_plus_one(q), elu_plus_one(k)
        return pq @ (pk.swapaxes(-1, -2) @ v)

    def no_feature_map(q, k, v):
        return (q @ (k.swapaxes(-1, -2) @ v)) / (q @ k.sum(axis=-2)[..., None])

    def wrong_denominator(q, k, v):
        pq, pk = elu_plus_one(q), elu_plus_one(k)
        return (pq @ (pk.swapaxes(-1, -2) @ v)) / pq.sum(axis=-1, keepdims=True)

    _raises(ch01.check_normalized_linear_attention, numerator_only, "numerator", "divide each row")
    _raises(ch01.check_normalized_linear_attention, no_feature_map, "without the feature map")
    _raises(ch01.check_normalized_linear_attention, wrong_denominator, "denominator of row i")

    def left_product(q, k, v):  # the right values through the n x n weights the exercise forbids
        w = elu_plus_one(q) @ elu_plus_one(k).swapaxes(-1, -2)
        return (w / w.sum(axis=-1, keepdims=True)) @ v

    _raises(ch01.check_normalized_linear_attention, left_product, "right numbers but allocated", "n x n matrix")


# ---------------------------------------------------------------- chapter 02

def _recurrent(q, k, v, decay=None, exclusive=False, decay_after=False):
    b, h, n, dk = q.shape
    lam = np.ones(h) if decay is None else np.asarray(decay, dtype=float)
    lam = lam[None, :, None, None]
    kv = np.zeros((b, h, dk, v.shape[-1]))
    o = np.empty((b, h, n, v.shape[-1]))
    for t in range(n):
        outer = k[:, :, t, :, None] * v[:, :, t, None, :]
        if exclusive:
            o[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], kv)
        kv = lam * (kv + outer) if decay_after else lam * kv + outer
        if not exclusive:
            o[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], kv)
    return o


def test_causal_recurrent():
    ch02.check_causal_recurrent(_recurrent)
    _raises(ch02.check_causal_recurrent, right_ok, "NON-causal", "s <= t")
    _raises(ch02.check_causal_recurrent, lambda q, k, v: _recurrent(q, k, v, exclusive=True), "before adding token t")
    _raises(ch02.check_causal_recurrent, lambda q, k, v: 0.5 * _recurrent(q, k, v), "differs first in rows")


def _scan(q, k, v, decay, power=True, use_decay=True):
    states = k[..., :, None] * v[..., None, :]
    lam = np.asarray(decay, dtype=float)[None, :, None, None, None] if use_decay else 1.0
    stride = 1
    while stride < q.shape[2]:
        shifted = states[:, :, :-stride] * (lam**stride if power else lam)
        states[:, :, stride:] = states[:, :, stride:] + shifted
        stride *= 2
    return np.einsum("bhtk,bhtkv->bhtv", q, states)


def test_doubling_scan():
    ch02.check_doubling_scan(_scan)
    _raises(ch02.check_doubling_scan, lambda q, k, v, d: _scan(q, k, v, d, use_decay=False), "ignores the decay", "lambda**s")
    message = _raises(ch02.check_doubling_scan, lambda q, k, v, d: _scan(q, k, v, d, power=False), "lambda**stride")
    assert "head 0 (lambda = 1.0) right" in message and "head 1 (lambda = 0.9)" in message
    _raises(ch02.check_doubling_scan, lambda q, k, v, d: np.full(q.shape[:-1] + (v.shape[-1],), np.inf), "inf or NaN")

    # the right values, one step per token (this file's _recurrent): the recurrence, not the scan
    _raises(ch02.check_doubling_scan, lambda q, k, v, d: _recurrent(q, k, v, d), "right values", "lines of Python",
            "ceil(log2 n) = 10 steps")


def test_reader_lines_counts_the_readers_code_only_and_restores_a_tracer():
    import sys

    from lightning_edu.exercises._core import reader_lines

    def five_lines():
        a = np.zeros(3)
        for _ in range(2):
            a = np.cumsum(a)  # numpy's Python wrappers (np.cumsum) count nothing
        return a

    seen = []

    def outer(frame, event, arg):
        seen.append(event)

    sys.settrace(outer)
    try:
        result, lines = reader_lines(five_lines)
        after = sys.gettrace()
    finally:
        sys.settrace(None)
    assert after is outer and np.array_equal(result, np.zeros(3))
    # a = ..., the for line three times (two passes and the exit), the body twice, return: 7 lines, give or take the
    # interpreter version's way of counting a loop's exit; np.cumsum's own Python lines (numpy's wrapper) add none
    assert 5 <= lines <= 8, lines
    _, loop_lines = reader_lines(lambda: [float(x) for x in np.arange(100)])
    assert loop_lines >= 100, loop_lines  # a comprehension's every pass is a line of the reader's


def test_cumsum_bytes():
    ch02.check_cumsum_bytes(lambda n, dk, dv, h, e: n * dk * dv * h * e)
    _raises(ch02.check_cumsum_bytes, lambda n, dk, dv, h, e: n * dk * dv * e, "multiply by heads")
    _raises(ch02.check_cumsum_bytes, lambda n, dk, dv, h, e: n * dk * dv * h, "counts elements")
    _raises(ch02.check_cumsum_bytes, lambda n, dk, dv, h, e: n * dk * h * e, "MATRIX, not a vector")
    _raises(ch02.check_cumsum_bytes, lambda n, dk, dv, h, e: 2 * n * dk * dv * h * e, "expected")


# ---------------------------------------------------------------- chapter 03

def _mask(n, lam):
    t = np.arange(n)
    gap = t[:, None] - t[None, :]
    return np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0)


def test_decay_mask():
    ch03.check_decay_mask(_mask)
    _raises(ch03.check_decay_mask, lambda n, lam: _mask(n, lam).T, "transpose of M")

    def negative_powers(n, lam):
        t = np.arange(n, dtype=float)
        with np.errstate(over="ignore", invalid="ignore"):
            return np.tril(np.outer(lam**t, lam ** (-t)))

    _raises(ch03.check_decay_mask, negative_powers, "inf or NaN", "negative power")

    def discarded_overflow(n, lam):  # right values, but lambda ** gap is formed for gap < 0 and then thrown away
        t = np.arange(n)
        gap = t[:, None] - t[None, :]
        return np.where(gap >= 0, lam ** gap.astype(float), 0.0)

    _raises(ch03.check_decay_mask, discarded_overflow, "overflowed", "np.maximum")

    def symmetric(n, lam):
        t = np.arange(n)
        return lam ** np.abs(t[:, None] - t[None, :]).astype(float)

    _raises(ch03.check_decay_mask, symmetric, "j > i", "upper triangle")
    _raises(ch03.check_decay_mask, lambda n, lam: _mask(n, lam) * 0.5, "differs")


def test_decayed_recurrence():
    ch03.check_decayed_recurrence(lambda q, k, v, d: _recurrent(q, k, v, d))
    _raises(ch03.check_decayed_recurrence, lambda q, k, v, d: _recurrent(q, k, v, d, decay_after=True), "lambda times the answer")
    _raises(ch03.check_decayed_recurrence, lambda q, k, v, d: _recurrent(q, k, v), "ignores the decay")
    _raises(ch03.check_decayed_recurrence, lambda q, k, v, d: _recurrent(q, k, v, np.full(len(d), d[-1])), "each head has its own lambda")


def _holding(lam, frac):
    if lam == 1.0:
        return math.inf
    m = 0
    while 1 - lam**m < frac:
        m += 1
    return m


def test_tokens_holding():
    ch03.check_tokens_holding(_holding)
    # The unguarded closed form is wrong at the boundaries fraction = 1 - lambda^m (rounding in the logs).
    _raises(ch03.check_tokens_holding, lambda lam, f: math.inf if lam == 1 else math.ceil(math.log(1 - f) / math.log(lam)),
            "tokens_holding(0.9, 0.19) returned 2, expected 3", "wrong side of a whole number")
    _raises(ch03.check_tokens_holding, lambda lam, f: _holding(lam, f) - 1 if lam < 1 else math.inf, "off by one")
    _raises(ch03.check_tokens_holding, lambda lam, f: 1 / (1 - lam) if lam < 1 else math.inf, "horizon")
    _raises(ch03.check_tokens_holding, lambda lam, f: _holding(lam, f) if lam < 1 else 10**9, "math.inf")


def test_tokens_holding_reference_against_closed_form():
    # The checker's brute-force reference agrees with ceil(log(1 - f) / log(lambda)) away from rounding ties.
    for lam, frac in [(0.9, 0.5), (0.99, 0.9), (0.5, 0.99), (0.999, 0.632), (0.05, 0.9), (0.8, 0.999)]:
        assert ch03._tokens_holding(lam, frac) == math.ceil(math.log(1 - frac) / math.log(lam))
