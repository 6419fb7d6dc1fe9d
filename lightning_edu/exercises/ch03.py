"""Checks for the exercises of chapter 03 (decay: lambda, the mask M and the effective context)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from ..checks import random_qkv, relative_error
from ..numpy_reference import causal_linear_recurrent, decay_mask
from ._core import ExerciseError, exercise, expect_close, expect_shape, passed, seeded, without_overflow

__all__ = ["check_decay_mask", "check_decayed_recurrence", "check_tokens_holding"]


@exercise("3.1", reveals=("decay_mask",))
def check_decay_mask(my_decay_mask, seed: int = 0) -> None:
    """``my_decay_mask(n, decay)`` for a float decay must return the (n, n) mask M[i, j] = lambda^(i-j) for i >= j, else 0."""
    cases = [(7, 0.9), (1, 0.5), (37, 1.0), (300, 0.05), (130, 0.99)]
    if seed:  # other sizes and decays; lambda = 1, n = 1 and a small lambda at n = 300 stay
        rng = seeded(seed)
        cases = [(int(rng.integers(2, 40)), float(np.round(rng.uniform(0.5, 0.99), 3))), (1, float(np.round(rng.uniform(0.1, 1), 3))),
                 (int(rng.integers(2, 80)), 1.0), (300, float(np.round(rng.uniform(0.01, 0.1), 3))),
                 (int(rng.integers(80, 200)), float(np.round(rng.uniform(0.9, 0.999), 3)))]
    for n, lam in cases:
        ref = decay_mask(n, lam)
        name = f"my_decay_mask({n}, {lam})"
        got = expect_shape(name, without_overflow(name, lambda: my_decay_mask(n, lam)), ref.shape)
        if not np.all(np.isfinite(got)):
            raise ExerciseError(
                f"{name} contains inf or NaN: you formed a negative power such as lambda**(-j) (0.05**-299 overflows "
                "float64). Form lambda**(i - j) only where i >= j, e.g. lambda ** np.maximum(i - j, 0)"
            )
        if np.allclose(got, ref, rtol=1e-12, atol=0):
            continue
        if n > 1 and np.allclose(got, ref.T, rtol=1e-12, atol=0):
            raise ExerciseError(f"{name} is the transpose of M: row i is the query position, so M[i, j] is nonzero for j <= i (lower triangle)")
        if n > 1 and np.any(np.triu(got, 1) != 0):
            i, j = np.argwhere(np.triu(got, 1) != 0)[0]
            raise ExerciseError(f"{name}[{i}, {j}] = {got[i, j]:.3g} but j > i: a query must not see later keys; set the upper triangle to 0")
        expect_close(name, got, ref, rtol=1e-12, hint="M[i, j] = lambda**(i - j): 1 on the diagonal, lambda just below it")
    passed(f"decay mask right on {len(cases)} sizes, lambda = 0.05 at n = 300 included (no overflow)")


def _recurrence(q, k, v, step, weight=None, out=None):
    """o_t = out(t) q_t KV_t with KV_t = step(t) KV_{t-1} + weight(t) k_t^T v_t; each factor a (heads,) array.

    With step = lambda, weight = out = 1 it is the right answer; the usual mistakes are other factors."""
    batch, heads, n, d_k = q.shape
    kv = np.zeros((batch, heads, d_k, v.shape[-1]))
    o = np.empty((batch, heads, n, v.shape[-1]))
    one = np.ones(heads)
    for t in range(n):
        w = one if weight is None else weight(t)
        kv = step(t)[None, :, None, None] * kv + w[None, :, None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
        o[:, :, t] = (one if out is None else out(t))[None, :, None] * np.einsum("bhk,bhkv->bhv", q[:, :, t], kv)
    return o


def _decay_mistakes(q, k, v, lam):
    """(message, answer) for the usual mistakes of the decayed recurrence, most specific first."""
    b, h, _, _ = q.shape
    yield ("you multiply the state by lambda^t at step t, a power counted from the start of the sequence. The decay "
           "per step is lambda whatever t is: KV_t = lambda KV_{t-1} + k_t^T v_t; the powers lambda^(t-s) build up "
           "by themselves", [_recurrence(q, k, v, lambda t, p=p: lam ** (t + p)) for p in (0, 1)])
    yield ("token s enters the state with weight lambda^s, counted from the start of the sequence, so o_t weighs it "
           "lambda^s instead of lambda^(t-s). Decay the carried state by lambda at every step and add k_t^T v_t with "
           "weight 1", [_recurrence(q, k, v, lambda t: np.ones(h), weight=lambda t, p=p: lam ** (t + p)) for p in (0, 1)])
    yield ("you scale o_t by lambda^t, a power counted from the start of the sequence, instead of decaying the state "
           "step by step: KV_t = lambda KV_{t-1} + k_t^T v_t, o_t = q_t KV_t",
           [_recurrence(q, k, v, lambda t: np.ones(h), out=lambda t, p=p: lam ** (t + p)) for p in (0, 1)])
    yield ("the state decays by lambda^2 per step: did you multiply it by lambda twice (say, once before and once "
           "after adding k_t^T v_t)? One factor lambda per token", [_recurrence(q, k, v, lambda t: lam**2)])
    yield ("each head has its own lambda: you used decay[0] for every head; broadcast decay as decay[None, :, None, None]",
           [_recurrence(q, k, v, lambda t: np.full(h, lam[0]))])
    yield ("each head has its own lambda: you used decay[-1] for every head; broadcast decay as decay[None, :, None, None]",
           [_recurrence(q, k, v, lambda t: np.full(h, lam[-1]))])
    if b == h and b > 1:  # decay[:, None, None, None] lines up with the batch axis
        def batch_decay(q=q, k=k, v=v):
            return np.stack([_recurrence(q[i:i + 1], k[i:i + 1], v[i:i + 1], lambda t, i=i: np.full(h, lam[i]))[0]
                             for i in range(b)])

        yield ("each head has its own lambda, but yours line up with the batch axis (decay[:, None, None, None]): "
               "broadcast decay as decay[None, :, None, None]", [batch_decay()])


@exercise("3.2", reveals=("causal_linear_recurrent",))
def check_decayed_recurrence(decayed_recurrence, seed: int = 0) -> None:
    """``decayed_recurrence(q, k, v, decay)``: KV_t = lambda KV_{t-1} + k_t^T v_t, o_t = q_t KV_t, decay of shape (heads,)."""
    cases = [((1, 3, 37, 5, 3), [1.0, 0.9, 0.05]), ((2, 2, 7, 4, 6), [0.5, 0.99]), ((1, 1, 1, 3, 2), [0.3])]
    if seed:  # fresh decays; the head with lambda = 1 stays
        rng = seeded(seed)
        cases = [(shape, [1.0 if (i == 0 and j == 0) else float(np.round(rng.uniform(0.05, 0.99), 3)) for j in range(len(d))])
                 for i, (shape, d) in enumerate(cases)]
    for i, (shape, decay) in enumerate(cases):
        b, h, n, dk, dv = shape
        q, k, v = random_qkv(b, h, n, dk, dv, seed=50 + i + seed)
        lam = np.array(decay)
        ref = causal_linear_recurrent(q, k, v, lam)
        name = f"decayed_recurrence on q {q.shape}, decay {decay}"
        got = expect_shape(name, decayed_recurrence(q, k, v, lam), ref.shape)
        if relative_error(got, ref) <= 1e-9:
            continue
        if not np.isfinite(got).all():
            expect_close(name, got, ref, rtol=1e-9, hint="only non-negative powers of lambda appear")
        if relative_error(got, ref * lam[None, :, None, None]) <= 1e-9:
            raise ExerciseError(
                f"{name} is lambda times the answer: you decayed after adding, lambda (KV_{{t-1}} + k_t^T v_t). "
                "Only the old state decays: KV_t = lambda KV_{t-1} + k_t^T v_t"
            )
        if n > 1 and relative_error(got, causal_linear_recurrent(q, k, v)) <= 1e-9:
            raise ExerciseError(f"{name} ignores the decay: multiply the old state by lambda before adding k_t^T v_t")
        if n > 1:
            for message, answers in _decay_mistakes(q, k, v, lam):
                if any(relative_error(got, wrong) <= 1e-9 and relative_error(wrong, ref) > 1e-9 for wrong in answers):
                    raise ExerciseError(f"{name}: {message}")
        bad = [j for j in range(h) if relative_error(got[:, j], ref[:, j]) > 1e-9]
        heads = ", ".join(f"head {j} (lambda = {decay[j]})" for j in bad)
        expect_close(name, got, ref, rtol=1e-9, axis=2,
                     hint=f"wrong in {heads}. KV_0 = 0; for each t: KV = lambda KV + outer(k_t, v_t); o_t = q_t KV")
    passed(f"decayed recurrence matches on {len(cases)} shapes with one lambda per head")


def _tokens_holding(decay: float, fraction: float) -> float:
    """The exact answer for the floats given: the smallest m >= 0 with lambda^m <= 1 - fraction, in rational
    arithmetic (no rounding at all), so it is right at the boundaries fraction = 1 - lambda^m too."""
    if decay == 1.0:
        return math.inf
    if fraction <= 0:
        return 0
    lam, target = Fraction(decay), 1 - Fraction(fraction)
    m = max(0, int(math.log1p(-fraction) / math.log(decay)) - 2)
    power = lam**m
    while power > target:
        power *= lam
        m += 1
    while m > 0 and power / lam <= target:
        power /= lam
        m -= 1
    return m


def _float_answers(decay: float, fraction: float) -> set:
    """What a correct float64 program may return at a boundary where rounding decides: the guarded closed form and
    a running product."""
    answers = set()
    m = math.ceil(math.log(1.0 - fraction) / math.log(decay))
    while 1.0 - decay**m < fraction:
        m += 1
    while m > 0 and 1.0 - decay ** (m - 1) >= fraction:
        m -= 1
    answers.add(m)
    m, power = 0, 1.0
    while 1.0 - power < fraction:
        power *= decay
        m += 1
    answers.add(m)
    return answers


def _holding_cases(seed: int):
    # (0.9, 0.19) and (0.5, 1 - 2^-29) sit on boundaries fraction = 1 - lambda^m, where the closed form
    # ceil(log(1 - f) / log(lambda)) lands on the wrong side of a whole number (one below, one above).
    cases = [(0.9, 0.5), (0.99, 0.9), (0.5, 0.99), (0.999, 0.632), (0.05, 0.9), (0.8, 0.999), (1.0, 0.9),
             (0.9, 0.19), (0.5, 1 - 2.0**-29)]
    if seed:
        rng = seeded(seed)
        lams = [float(np.round(rng.uniform(lo, hi), 3)) for lo, hi in ((0.5, 0.99), (0.9, 0.999), (0.05, 0.5), (0.99, 0.9999))]
        cases = [(lams[0], float(rng.uniform(0.1, 0.9))), (lams[1], float(rng.uniform(0.5, 0.99))),
                 (lams[2], float(rng.uniform(0.9, 0.9999))), (lams[3], 0.632), (lams[2], float(rng.uniform(0.01, 0.5))),
                 (lams[0], float(rng.uniform(0.99, 0.99999))), (1.0, float(rng.uniform(0.1, 0.99))),
                 (lams[0], 1 - lams[0] ** int(rng.integers(2, 30))), (lams[1], 1 - lams[1] ** int(rng.integers(2, 60)))]
    return cases


@exercise("3.3")
def check_tokens_holding(tokens_holding, seed: int = 0) -> None:
    """``tokens_holding(decay, fraction)``: the fewest most-recent tokens whose weights hold ``fraction`` of the total mass.

    The weights of the tokens 0, 1, 2, ... steps back are lambda^0, lambda^1, ...; for lambda = 1 return math.inf.
    """
    cases = _holding_cases(seed)
    for lam, frac in cases:
        want = _tokens_holding(lam, frac)
        got = tokens_holding(lam, frac)
        where = f"tokens_holding({lam}, {frac!r})"
        if got is None:
            raise ExerciseError(f"{where} returned None -- did you forget `return`?")
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, float, np.integer, np.floating)):
            raise ExerciseError(f"{where} returned {got!r} of type {type(got).__name__}: a number of tokens is an int "
                                "(or math.inf)")
        if want == math.inf:
            if got != math.inf:
                raise ExerciseError(f"{where} returned {got}: with lambda = 1 nothing decays, the mass is infinite; return math.inf")
            continue
        if not math.isfinite(got):
            raise ExerciseError(f"{where} returned {got}: for lambda < 1 the answer is a finite whole number")
        if got == want or got in _float_answers(lam, frac):
            continue
        horizon = 1.0 / (1.0 - lam)
        closed = math.ceil(math.log(1 - frac) / math.log(lam))
        if got == closed:
            share = 1.0 - lam ** int(got)
            side = "below" if share < frac else "at or above"
            raise ExerciseError(
                f"{where} returned {got}, expected {want}: this fraction sits on a boundary 1 - lambda^m, and "
                f"ceil(log(1 - fraction) / log(lambda)) lands on the wrong side of a whole number through rounding in "
                f"the logs ({got} tokens hold 1 - {lam}**{got} = {share!r}, {side} {frac!r}). Keep the closed form as a "
                "first guess, then check it: step m up while 1 - lambda^m < fraction, and down while m - 1 tokens are enough"
            )
        if abs(got - horizon) < 1.0:
            raise ExerciseError(
                f"{where} returned {got}, about the horizon 1/(1-lambda) = {horizon:.4g}: that window holds only "
                f"1 - lambda^h (about 63 % for lambda near 1), not {frac:.3g}. Solve 1 - lambda^m >= fraction for the smallest integer m"
            )
        if got in (want - 1, want + 1):
            raise ExerciseError(
                f"{where} returned {got}, expected {want}: off by one. The first m tokens carry lambda^0 .. lambda^(m-1), "
                "whose share is 1 - lambda^m; take the smallest integer m with 1 - lambda^m >= fraction (ceil, not floor)"
            )
        raise ExerciseError(f"{where} returned {got}, expected {want}: m = ceil(log(1 - fraction) / log(lambda))")
    passed(f"tokens_holding right on {len(cases)} cases, lambda = 1 and two boundaries fraction = 1 - lambda^m included")
