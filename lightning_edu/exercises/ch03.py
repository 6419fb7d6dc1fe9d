"""Checks for the exercises of chapter 03 (decay: lambda, the mask M and the effective context)."""

from __future__ import annotations

import math

import numpy as np

from ..checks import random_qkv, relative_error
from ..numpy_reference import causal_linear_recurrent, decay_mask
from ._core import ExerciseError, expect_close, expect_shape, passed

__all__ = ["check_decay_mask", "check_decayed_recurrence", "check_tokens_holding"]


def check_decay_mask(my_decay_mask) -> bool:
    """``my_decay_mask(n, decay)`` for a float decay must return the (n, n) mask M[i, j] = lambda^(i-j) for i >= j, else 0."""
    cases = [(7, 0.9), (1, 0.5), (37, 1.0), (300, 0.05), (130, 0.99)]
    for n, lam in cases:
        ref = decay_mask(n, lam)
        name = f"my_decay_mask({n}, {lam})"
        got = expect_shape(name, my_decay_mask(n, lam), ref.shape)
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
    return passed(f"decay mask right on {len(cases)} sizes, lambda = 0.05 at n = 300 included (no overflow)")


def check_decayed_recurrence(decayed_recurrence) -> bool:
    """``decayed_recurrence(q, k, v, decay)``: KV_t = lambda KV_{t-1} + k_t^T v_t, o_t = q_t KV_t, decay of shape (heads,)."""
    cases = [((1, 3, 37, 5, 3), [1.0, 0.9, 0.05]), ((2, 2, 7, 4, 6), [0.5, 0.99]), ((1, 1, 1, 3, 2), [0.3])]
    for i, (shape, decay) in enumerate(cases):
        b, h, n, dk, dv = shape
        q, k, v = random_qkv(b, h, n, dk, dv, seed=50 + i)
        lam = np.array(decay)
        ref = causal_linear_recurrent(q, k, v, lam)
        name = f"decayed_recurrence on q {q.shape}, decay {decay}"
        got = expect_shape(name, decayed_recurrence(q, k, v, lam), ref.shape)
        if relative_error(got, ref) <= 1e-9:
            continue
        scaled = ref * lam[None, :, None, None]
        if relative_error(got, scaled) <= 1e-9:
            raise ExerciseError(
                f"{name} is lambda times the answer: you decayed after adding, lambda (KV_{{t-1}} + k_t^T v_t). "
                "Only the old state decays: KV_t = lambda KV_{t-1} + k_t^T v_t"
            )
        if n > 1 and relative_error(got, causal_linear_recurrent(q, k, v)) <= 1e-9:
            raise ExerciseError(f"{name} ignores the decay: multiply the old state by lambda before adding k_t^T v_t")
        per_head = [relative_error(got[:, j], ref[:, j]) for j in range(h)]
        bad = [f"head {j} (lambda = {decay[j]})" for j in range(h) if per_head[j] > 1e-9]
        if len(bad) < h:
            raise ExerciseError(f"{name}: wrong in {', '.join(bad)} only: each head has its own lambda; broadcast decay as decay[None, :, None, None]")
        expect_close(name, got, ref, rtol=1e-9, hint="KV_0 = 0; for each t: KV = lambda KV + outer(k_t, v_t); o_t = q_t KV")
    return passed(f"decayed recurrence matches on {len(cases)} shapes with one lambda per head")


def _tokens_holding(decay: float, fraction: float) -> float:
    # Brute force on purpose (independent of the closed form the reader may use): the first m weights
    # lambda^0 .. lambda^(m-1) hold the share 1 - lambda^m of the total mass 1 / (1 - lambda).
    if decay == 1.0:
        return math.inf
    m, power = 0, 1.0
    while 1.0 - power < fraction:
        power *= decay
        m += 1
    return m


def check_tokens_holding(tokens_holding) -> bool:
    """``tokens_holding(decay, fraction)``: the fewest most-recent tokens whose weights hold ``fraction`` of the total mass.

    The weights of the tokens 0, 1, 2, ... steps back are lambda^0, lambda^1, ...; for lambda = 1 return math.inf.
    """
    cases = [(0.9, 0.5), (0.99, 0.9), (0.5, 0.99), (0.999, 0.632), (0.05, 0.9), (0.8, 0.999), (1.0, 0.9)]
    for lam, frac in cases:
        want = _tokens_holding(lam, frac)
        got = tokens_holding(lam, frac)
        where = f"tokens_holding({lam}, {frac})"
        if got is None:
            raise ExerciseError(f"{where} returned None -- did you forget `return`?")
        if want == math.inf:
            if got != math.inf:
                raise ExerciseError(f"{where} returned {got}: with lambda = 1 nothing decays, the mass is infinite; return math.inf")
            continue
        if got == want:
            continue
        horizon = 1.0 / (1.0 - lam)
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
    return passed(f"tokens_holding right on {len(cases)} cases, lambda = 1 included")
