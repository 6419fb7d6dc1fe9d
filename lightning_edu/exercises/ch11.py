"""Checks for the exercises of chapter 11 (feature maps, the normaliser, the hybrid block).

:func:`check_normalized_via_ones` calls the reader's numpy function for normalized linear attention of one
head, built from plain linear attention on a value matrix with a column of ones appended, and compares it with
:func:`lightning_edu.normalized_attention` (float64, "identity" map on features the check has already made
positive). :func:`check_hybrid_weights` compares the reader's (n, n) weight matrix of the hybrid block with
:func:`lightning_edu.feature_maps.attention_weights`. Failures name the first wrong row and recognise the usual
mistakes: eps left out, a normaliser without decay or one token late, the two parts of the hybrid normalised
separately, a softmax without its row maximum subtracted.
"""

from __future__ import annotations

import numpy as np

from ..api import normalized_attention
from ..feature_maps import attention_weights
from ..numpy_reference import elu_plus_one
from ._core import ExerciseError, exercise, expect_shape, passed, wrong_rows

__all__ = ["check_normalized_via_ones", "check_hybrid_weights"]

_RTOL = 1e-9


def _call(fn, name: str, args, shape):
    try:
        out = fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in args))
    except ExerciseError:
        raise
    except NotImplementedError:
        raise ExerciseError(f"{name} is not implemented yet (it raised NotImplementedError)") from None
    except Exception as exc:  # the reader's bug, reported, never a crash of the check
        raise ExerciseError(f"your {name} raised {type(exc).__name__}: {exc}") from exc
    if out is None:
        raise ExerciseError(f"{name} returned None -- did you forget the return statement?")
    if isinstance(out, (list, tuple)):
        raise ExerciseError(f"{name} must return a numpy array, got a {type(out).__name__}")
    try:
        return expect_shape(name, out, shape).astype(np.float64)
    except ExerciseError:
        raise
    except Exception as exc:
        raise ExerciseError(f"{name} returned {type(out).__name__}, which is not an array of numbers: {exc}") from exc


def _first_wrong(got, ref) -> str:
    rows = wrong_rows(got, ref, rtol=_RTOL, axis=0)
    first = int(rows[0])
    return f"row {first} is the first wrong one ({len(rows)} of {ref.shape[0]} rows differ)"


def _same(got, ref) -> bool:
    return got.shape == ref.shape and not wrong_rows(got, ref, rtol=_RTOL, axis=0).size


# ---------------------------------------------------------------------------------------------- 11.1

_ONES_CASES = [  # (n, d', d_v, lambda, eps)
    (37, 6, 4, 0.9, 1e-3),
    (20, 3, 5, 1.0, 1e-6),
    (45, 8, 2, 0.5, 0.1),
]


def _normalized(phi_q, phi_k, v, lam, eps, *, z: str = "right", use_eps: bool = True):
    """Normalized linear attention of one head (features given), with the numerator right and the normaliser
    computed as asked: "right", "no decay" (a plain cumulative sum) or "late" (z_{t-1}: one token late)."""
    n = phi_q.shape[0]
    t = np.arange(n)
    gap = t[:, None] - t[None, :]
    weights = np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0) * (phi_q @ phi_k.T)
    num = weights @ v
    if z == "right":
        den = weights.sum(axis=1)
    elif z == "no decay":
        den = np.einsum("tf,tf->t", phi_q, np.cumsum(phi_k, axis=0))
    else:  # late: z_{t-1}, decayed
        z_state = np.zeros(phi_k.shape[1])
        den = np.zeros(n)
        for i in range(n):
            den[i] = phi_q[i] @ z_state
            z_state = lam * z_state + phi_k[i]
    with np.errstate(divide="ignore", invalid="ignore"):
        return num / (den + (eps if use_eps else 0.0))[:, None]


@exercise("11.1", reveals=("normalized_attention", "append_ones", "divide_by_normaliser"),
          allowed=("lightning_edu.api.lightning_attention",))
def check_normalized_via_ones(normalized_via_ones, seed: int = 0) -> None:
    """Check ``normalized_via_ones(phi_q, phi_k, v, lam, eps)``: phi_q, phi_k (n, d') positive features, v (n, d_v),
    lam a float in (0, 1], eps >= 0; returns o (n, d_v) = phi(q_t) S_t / (phi(q_t) . z_t + eps)."""
    for case, (n, d_f, d_v, lam, eps) in enumerate(_ONES_CASES):
        rng = np.random.default_rng(1100 + case + seed)
        phi_q, phi_k = elu_plus_one(rng.standard_normal((2, n, d_f)))
        v = rng.standard_normal((n, d_v))
        ref = normalized_attention(phi_q[None, None], phi_k[None, None], v[None, None], lam, feature_map="identity",
                                   eps=eps, backend="numpy")[0, 0]
        got = _call(normalized_via_ones, "normalized_via_ones", (phi_q, phi_k, v, lam, eps), (n, d_v))
        where = f"for n = {n}, d' = {d_f}, d_v = {d_v}, lambda = {lam}, eps = {eps}"
        if _same(got, ref):
            continue
        if not np.isfinite(got).all():
            bad = int(np.flatnonzero(~np.isfinite(got).all(axis=1))[0])
            raise ExerciseError(f"normalized_via_ones has NaN or inf in row {bad} {where}: with positive features every "
                                "denominator is positive, so a non-finite output means a division by the wrong thing")
        hints = (
            (_normalized(phi_q, phi_k, v, lam, eps, use_eps=False), "eps is missing from the denominator: divide by "
             "(phi(q_t) . z_t + eps)"),
            (_normalized(phi_q, phi_k, v, lam, eps, z="no decay"), "the normaliser has no decay: z_t = lambda z_(t-1) + "
             "phi(k_t) decays like the state; the ones column gets it for free"),
            (_normalized(phi_q, phi_k, v, lam, eps, z="late"), "the normaliser is one token late (z_(t-1)): token t's "
             "key enters z_t before its query reads it, as in the state"),
        )
        for wrong, hint in hints:
            if _same(got, wrong):
                raise ExerciseError(f"normalized_via_ones differs {where}: {_first_wrong(got, ref)}. Hint: {hint}")
        raise ExerciseError(f"normalized_via_ones differs {where}: {_first_wrong(got, ref)}. Hint: run linear attention "
                            "on [v | 1] (v with a column of ones appended); its last output column is phi(q_t) . z_t, "
                            "divide the first d_v columns by it plus eps")
    passed(f"normalized_via_ones matches normalized_attention on {len(_ONES_CASES)} cases "
                  "(lambda = 1, 0.9, 0.5; eps from 1e-6 to 0.1)")


# ---------------------------------------------------------------------------------------------- 11.2

_HYBRID_CASES = [  # (n, d, block, scale of q and k, k_t = -q_t at each block's first row)
    (24, 4, 8, 1.0, False),
    (30, 5, 7, 1.0, False),  # a block size that does not divide n
    (16, 4, 16, 1.0, False),  # one block: causal softmax
    (20, 4, 6, 30.0, False),  # large scores: exp overflows unless the row maximum is subtracted
    # A block's first row sees one in-block key, its own, at score -|q_t|^2 / sqrt(d), about -1800: its in-block
    # maximum m is that score, and the linear part scaled by exp(-m) overflows. Only a joint scale survives.
    (20, 4, 5, 30.0, True),
]


@exercise("11.2", reveals=("joint_normalise", "attention_weights"),
          allowed=("lightning_edu.numpy_reference.elu_plus_one",))
def check_hybrid_weights(hybrid_weights, seed: int = 0) -> None:
    """Check ``hybrid_weights(q, k, block_size)``: q, k (n, d); returns the (n, n) weights of the hybrid block with
    lambda = 1, scale d^-0.5 and the elu+1 map: exp(scores) inside the row's block (causal), phi(q_t) . phi(k_s)
    for keys in earlier blocks, each row divided by its one joint sum."""
    for case, (n, d, block, scale, opposed) in enumerate(_HYBRID_CASES):
        rng = np.random.default_rng(1110 + case + seed)
        q, k = rng.standard_normal((2, n, d)) * scale
        if opposed:
            k[::block] = -q[::block]
        ref = attention_weights(q, k, "hybrid", block_size=block)
        got = _call(hybrid_weights, "hybrid_weights", (q, k, block), (n, n))
        where = (f"for n = {n}, d = {d}, block_size = {block}" + (f", q and k scaled by {scale:g}" if scale != 1 else "")
                 + (", k_t = -q_t at each block's first row" if opposed else ""))
        if _same(got, ref):
            continue
        if not np.isfinite(got).all():
            bad = int(np.flatnonzero(~np.isfinite(got).all(axis=1))[0])
            if opposed:
                hint = ("the in-block maximum m alone is not enough: at a block's first row every in-block score is "
                        "about -1800, so the linear part times exp(-m) overflows. Scale both parts by one joint e^-M, "
                        "M = max(m, log a) with a the size of the linear part (section 11.5)")
            elif scale > 1:
                hint = ("exp of a large score overflows: subtract the row's largest in-block score before exp, and put "
                        "the linear part on the same scale")
            else:
                hint = "check every division"
            raise ExerciseError(f"hybrid_weights has NaN or inf in row {bad} {where}. Hint: {hint}")
        if np.any(np.triu(got, 1) != 0):
            raise ExerciseError(f"hybrid_weights gives weight to later keys {where} (entries above the diagonal): the "
                                "in-block softmax must be causal -- select s <= t with a mask before exp")
        if _same(got, attention_weights(q, k, "hybrid_separate", block_size=block)):
            raise ExerciseError(f"hybrid_weights differs {where}: {_first_wrong(got, ref)}, and your rows after the first "
                                "block sum to 2. Hint: the softmax part and the linear part are normalised separately and "
                                "added; put both kinds of weight in one row and divide by their one sum")
        if _same(got, attention_weights(q, k, "softmax")):
            raise ExerciseError(f"hybrid_weights differs {where}: {_first_wrong(got, ref)}. Hint: this is causal softmax "
                                "over every earlier key; keys in earlier blocks get phi(q_t) . phi(k_s), not exp(score)")
        raise ExerciseError(f"hybrid_weights differs {where}: {_first_wrong(got, ref)}")
    passed(f"hybrid_weights matches the joint hybrid on {len(_HYBRID_CASES)} cases (one block = causal softmax, "
           "a block size that does not divide n, scores large enough to overflow a plain exp, in-block scores so "
           "negative that only a joint scale survives)")
