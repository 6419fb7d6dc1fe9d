"""Checks for the exercises of chapter 13 (lightning attention in a model: speed and quality).

* :func:`check_fit_tgs` -- the reader's ``fit_tgs(contexts, tgs) -> (a, b)``: the line 1 / TGS = a + b T fitted
  by least squares, a and b in seconds per token. The inputs are made from known (a, b), a flat model (b = 0)
  among them, with 2 % noise, and the answer is numpy's least-squares fit to them, not the package's. It
  recognises a and b swapped, a line fitted to TGS itself instead of its reciprocal, 1 / TGS fitted against
  1 / T, microseconds for seconds, and a line through the first and last points.
* :func:`check_perplexity_gap` -- the reader's ``perplexity_gap(loss, baseline_loss)``: how much larger one
  model's perplexity is than the baseline's, in percent, from two losses in nats. It recognises the ratio of the
  losses taken for the ratio of the perplexities, the ratio left without "- 1", a fraction for a percentage,
  the sign reversed, and 2 ** (difference), which would be right for losses in bits.
"""

from __future__ import annotations

import math

import numpy as np

from ._core import ExerciseError, call_reader, exercise, passed, seeded

__all__ = ["check_fit_tgs", "check_perplexity_gap"]

_CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 81920, 94208]
_LINES = [  # (a seconds per token, b seconds per token of context): softmax-like, LA-1-like, flat
    (11.7e-6, 0.43e-9), (12.5e-6, 0.76e-9), (12.8e-6, 0.0), (26.1e-6, 2.33e-9)]


def _fit_variants(T, x):
    T, x = np.asarray(T, float), np.asarray(x, float)
    b, a = np.polyfit(T, 1 / x, 1)
    b_lin, a_lin = np.polyfit(T, x, 1)
    b_inv, a_inv = np.polyfit(1 / T, 1 / x, 1)
    return {
        "swapped": (b, a),
        "tgs itself": (a_lin, b_lin),
        "against 1/T": (a_inv, b_inv),
        "microseconds": (a * 1e6, b * 1e6),
        "two points": (1 / x[0] - T[0] * (1 / x[-1] - 1 / x[0]) / (T[-1] - T[0]), (1 / x[-1] - 1 / x[0]) / (T[-1] - T[0])),
    }


_FIT_HINTS = {
    "swapped": "a and b are swapped: return (a, b) with a the cost per token at no context and b the slope, "
               "np.polyfit(T, y, 1) returns (slope, intercept)",
    "tgs itself": "the line was fitted to TGS itself: the cost of a token is additive, a + b T seconds, so fit the "
                  "straight line to 1 / TGS (seconds per token), not to TGS",
    "against 1/T": "1 / TGS was fitted against 1 / T: the attention cost of a token grows with T, so the x-axis "
                   "is T itself",
    "microseconds": "a and b are in microseconds: 1 / TGS is already in seconds per token; keep seconds",
    "two points": "the line goes through the first and the last point: measurements scatter, and least squares "
                  "weighs every point (np.polyfit(T, 1 / TGS, 1))",
}


def _read_pair(out, where):
    if out is None:
        raise ExerciseError(f"fit_tgs returned None {where} -- did you forget the return?")
    try:
        a, b = out
        a, b = float(a), float(b)
    except (TypeError, ValueError) as exc:
        raise ExerciseError(f"fit_tgs must return two numbers (a, b) {where}, got {out!r:.80}") from exc
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ExerciseError(f"fit_tgs returned a non-finite number {where}: ({a}, {b})")
    return a, b


def _close(got, ref, rtol=1e-6):
    (a, b), (ra, rb) = got, ref
    return abs(a - ra) <= rtol * abs(ra) + 1e-15 and abs(b - rb) <= rtol * max(abs(rb), 1e-12) + 1e-18


@exercise("13.1", reveals=("lightning_edu.models.tgs.fit_tgs",))
def check_fit_tgs(fit_tgs, seed: int = 0) -> None:
    """``fit_tgs(contexts, tgs) -> (a, b)`` with 1 / TGS = a + b T fitted by least squares, seconds per token."""
    lines = list(_LINES)
    if seed:
        rng = seeded(seed)
        lines = [(rng.uniform(3e-6, 40e-6), rng.uniform(0.0, 3e-9)) for _ in range(4)]
    for i, (a, b) in enumerate(lines):
        T = list(_CONTEXTS)
        # Measured TGS scatters about the line: 2 % noise, so that only a least-squares fit over every point
        # gives the expected (a, b), not a line through two of them.
        noise = 1 + 0.02 * np.random.default_rng([1301, seed, i]).standard_normal(len(T))
        tgs = [float(x) for x in noise / (a + b * np.asarray(T, float))]
        slope, intercept = np.polyfit(np.asarray(T, float), 1 / np.asarray(tgs), 1)
        where = f"for TGS about 1 / ({a:.3g} + {b:.3g} T), 2 % noise, at T = 1K..92K"
        got = _read_pair(call_reader(fit_tgs, "fit_tgs", (list(T), list(tgs)), where), where)
        if _close(got, (intercept, slope)):
            continue
        for name, variant in _fit_variants(T, tgs).items():
            if _close(got, variant):
                raise ExerciseError(f"fit_tgs is wrong {where}: {_FIT_HINTS[name]}")
        raise ExerciseError(f"fit_tgs returned a = {got[0]:.4g}, b = {got[1]:.4g} {where}; expected a = {intercept:.4g} s "
                            f"and b = {slope:.4g} s per token of context, the least-squares line through every point "
                            "(np.polyfit(T, 1 / TGS, 1) gives (b, a))")
    passed("fit_tgs recovers a and b of 1 / TGS = a + b T: a softmax-like, an LA-1-like and a flat model")


_GAP_CASES = [(1.3323, 1.2994), (2.0302, 1.2994), (3.10, 3.05), (1.2994, 1.3323), (2.5, 2.5)]


def _gap_variants(loss, base):
    d = loss - base
    return {
        "loss ratio": 100 * (loss / base - 1),
        "no minus one": 100 * math.exp(d),
        "fraction": math.exp(d) - 1,
        "sign": 100 * (math.exp(-d) - 1),
        "bits": 100 * (2 ** d - 1),
    }


_GAP_HINTS = {
    "loss ratio": "you compared the losses, loss / baseline_loss - 1; perplexity is e**loss, so the ratio of the "
                  "perplexities is e**(loss - baseline_loss)",
    "no minus one": "you returned the ratio of the perplexities in percent (about 100 for equal models); the gap is "
                    "that ratio minus 1, in percent",
    "fraction": "you returned a fraction (0.012 for 1.2 %); the exercise asks for percent",
    "sign": "the sign is reversed: a model whose loss is larger than the baseline's has a positive gap",
    "bits": "you used 2 ** (difference): that is right for losses in bits; these losses are in nats (natural log), "
            "so use e ** (difference)",
}


@exercise("13.2")
def check_perplexity_gap(perplexity_gap, seed: int = 0) -> None:
    """``perplexity_gap(loss, baseline_loss)`` = 100 (e^(loss - baseline_loss) - 1): percent more perplexity."""
    cases = list(_GAP_CASES)
    if seed:
        rng = seeded(seed)
        cases = [(float(rng.uniform(1, 4)), float(rng.uniform(1, 4))) for _ in range(5)]
    for loss, base in cases:
        where = f"for loss = {loss} and baseline_loss = {base} nats"
        out = call_reader(perplexity_gap, "perplexity_gap", (loss, base), where)
        try:
            got = float(out)
        except (TypeError, ValueError) as exc:
            raise ExerciseError(f"perplexity_gap must return a number {where}, got {out!r:.80}") from exc
        ref = 100 * (math.exp(loss - base) - 1)
        if math.isclose(got, ref, rel_tol=1e-9, abs_tol=1e-9):
            continue
        for name, value in _gap_variants(loss, base).items():
            if math.isclose(got, value, rel_tol=1e-9, abs_tol=1e-9):
                raise ExerciseError(f"perplexity_gap is wrong {where}: {_GAP_HINTS[name]}")
        raise ExerciseError(f"perplexity_gap returned {got:.6g} {where}; expected {ref:.6g} percent, "
                            "100 * (e**(loss - baseline_loss) - 1)")
    passed("perplexity_gap turns a difference of losses in nats into percent more perplexity, either sign")
