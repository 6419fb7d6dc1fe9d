"""Rung 1 of the ladder: float64 numpy references, written as close to the math as possible.

Every function takes q, k of shape (batch, heads, n, d_k) and v of shape (batch, heads, n, d_v) and is
vectorised over batch and heads. ``decay`` is lambda in (0, 1]: one float or one value per head.
Chapters 01-03 derive each of them; later rungs are checked against these.
"""

from __future__ import annotations

import numpy as np

from .validation import check_finite_scalar, validate_attention_args, validate_decay, validate_flag, validate_positive_int

__all__ = [
    "elu_plus_one",
    "decay_mask",
    "masked_product",
    "softmax_attention",
    "linear_attention_left",
    "linear_attention_right",
    "causal_linear_masked",
    "causal_linear_recurrent",
    "causal_linear_cumsum",
]


def _f64(*xs):
    return tuple(np.asarray(x, dtype=np.float64) for x in xs)


def _checked(q, k, v, decay=1.0, initial_state=None, who=None):
    args = validate_attention_args(q, k, v, decay, backend="numpy", initial_state=initial_state, who=who)
    q, k, v = _f64(args.q, args.k, args.v)
    return args, q, k, v


def elu_plus_one(x: np.ndarray) -> np.ndarray:
    """The feature map phi(x) = elu(x) + 1 of Katharopoulos et al. (2020): positive, smooth. (Chapter 01.)"""
    x = np.asarray(x, dtype=np.float64)
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def decay_mask(n: int, decay=1.0) -> np.ndarray:
    """The causal decay mask M with M[..., i, j] = lambda^(i-j) for i >= j, else 0. (Chapter 03.)

    Returns shape (n, n) for a scalar decay and (heads, n, n) for one value per head. Powers are taken
    of non-negative exponents only, so nothing overflows for any lambda in (0, 1].
    """
    n = validate_positive_int("n", n)
    scalar = np.ndim(decay) == 0
    lam = validate_decay(decay, None)
    i = np.arange(n)
    gap = i[:, None] - i[None, :]  # i - j
    mask = np.where(gap >= 0, lam[:, None, None] ** np.maximum(gap, 0), 0.0)
    return mask[0] if scalar else mask


def masked_product(weights, keep, x) -> np.ndarray:
    """``where(keep, weights, 0) @ x`` where the mask *selects*: non-finite values stay where they belong. (Chapter 03.)

    Multiplying by a 0/1 mask is not the same thing: a NaN or inf in a masked-out weight, or in a row of
    ``x`` that a masked-out weight meets, survives as NaN (NaN x 0 = NaN, inf x 0 = NaN), and one bad token
    would poison the outputs before it. Here output[i, j] is non-finite exactly when some kept (i, s) meets
    a non-finite weights[i, s] or x[s, j]; such outputs are NaN. weights, keep: (..., m, p); x: (..., p, d).
    """
    a = np.where(keep, weights, 0.0)
    bad = ~np.isfinite(x)
    if not bad.any():
        return a @ x
    # A dense product meets every x[s] with every row; zero the bad entries for it, then mark as NaN exactly
    # the outputs whose kept weights reach one of them.
    reach = np.asarray(keep, dtype=np.float64) @ bad.astype(np.float64)
    return np.where(reach > 0, np.nan, a @ np.where(bad, 0.0, x))


def softmax_attention(q, k, v, *, causal: bool = False, scale: float | None = None) -> np.ndarray:
    """softmax(q k^T * scale [+ causal mask]) v, the baseline every linear method is compared with. (Chapter 01.)"""
    _, q, k, v = _checked(q, k, v, who="softmax_attention")
    causal = validate_flag("causal", causal)
    scale = q.shape[-1] ** -0.5 if scale is None else check_finite_scalar("scale", scale)
    scores = (q @ k.swapaxes(-1, -2)) * scale
    n = q.shape[-2]
    keep = np.tril(np.ones((n, n), dtype=bool)) if causal else np.ones((n, n), dtype=bool)
    scores = np.where(keep, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)  # the max-shift keeps exp from overflowing
    weights = np.exp(scores)
    return masked_product(weights / weights.sum(axis=-1, keepdims=True), keep, v)


def linear_attention_left(q, k, v) -> np.ndarray:
    """Non-causal linear attention by the left product (Q K^T) V: an n x n matrix, O(n^2 d) work. (Chapter 01.)"""
    _, q, k, v = _checked(q, k, v, who="linear_attention_left")
    return (q @ k.swapaxes(-1, -2)) @ v


def linear_attention_right(q, k, v) -> np.ndarray:
    """Non-causal linear attention by the right product Q (K^T V): a d_k x d_v matrix, O(n d^2) work. (Chapter 01.)"""
    _, q, k, v = _checked(q, k, v, who="linear_attention_right")
    return q @ (k.swapaxes(-1, -2) @ v)


def causal_linear_masked(q, k, v, decay=1.0) -> np.ndarray:
    """Causal linear attention by the masked left product [(Q K^T) * M] V: O(n^2 d). (Chapters 02-03.)"""
    args, q, k, v = _checked(q, k, v, decay, who="causal_linear_masked")
    mask = decay_mask(args.seq_len, args.decay)  # (heads, n, n)
    keep = np.tril(np.ones((args.seq_len, args.seq_len), dtype=bool))
    # Select the causal entries rather than multiply by M's zeros: a NaN at a later token stays there.
    return masked_product((q @ k.swapaxes(-1, -2)) * mask, keep, v)


def causal_linear_recurrent(q, k, v, decay=1.0, *, initial_state=None, return_state: bool = False):
    """The recurrence KV_t = lambda KV_{t-1} + k_t^T v_t, o_t = q_t KV_t, one token at a time. (Chapter 02.)

    O(n d_k d_v) work and O(d_k d_v) memory, but n sequential steps: the cumsum bottleneck.
    ``initial_state`` (batch, heads, d_k, d_v) is KV_0; with ``return_state`` the final KV_n is returned too.
    This Python loop over t is the ground truth every other implementation is tested against.
    """
    args, q, k, v = _checked(q, k, v, decay, initial_state, who="causal_linear_recurrent")
    return_state = validate_flag("return_state", return_state)
    lam = args.decay[None, :, None, None]
    state = np.zeros((args.batch, args.heads, args.d_k, args.d_v))
    if initial_state is not None:
        state = np.array(initial_state, dtype=np.float64)
    out = np.empty((args.batch, args.heads, args.seq_len, args.d_v))
    for t in range(args.seq_len):
        state = lam * state + k[:, :, t, :, None] * v[:, :, t, None, :]  # outer product k_t^T v_t
        out[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], state)
    return (out, state) if return_state else out


def causal_linear_cumsum(q, k, v, decay=1.0) -> np.ndarray:
    """Causal linear attention from all n prefix states, materialised at once. (Chapter 02.)

    Builds every outer product k_t^T v_t, an (n, d_k, d_v) tensor per head, then prefix-sums it with
    decay. With lambda = 1 that is np.cumsum; with decay it is the doubling (Hillis-Steele) scan
    S_t += lambda^step S_{t-step} for step = 1, 2, 4, ...: log2(n) vectorised steps instead of n.
    The price is O(n d_k d_v) memory: at n = 64K and d = 128 that is 8 GiB per head in float64.
    """
    args, q, k, v = _checked(q, k, v, decay, who="causal_linear_cumsum")
    states = k[..., :, None] * v[..., None, :]  # (batch, heads, n, d_k, d_v)
    if np.all(args.decay == 1.0):
        states = np.cumsum(states, axis=2)
    else:
        lam = args.decay[None, :, None, None, None]
        step = 1
        while step < args.seq_len:
            shifted = states[:, :, :-step] * lam**step
            states[:, :, step:] = states[:, :, step:] + shifted
            step *= 2
    return np.einsum("bhtk,bhtkv->bhtv", q, states)


# Registry hooks (lightning_edu.registry): (o, final_state or None) for validated arguments. These
# references are not on any fast path, so they simply call the functions above.

def recurrent_from_args(args, **options):
    return causal_linear_recurrent(args.q, args.k, args.v, args.decay, initial_state=args.initial_state, return_state=True)


def masked_from_args(args, **options):
    return causal_linear_masked(args.q, args.k, args.v, args.decay), None


def cumsum_from_args(args, **options):
    return causal_linear_cumsum(args.q, args.k, args.v, args.decay), None


def step_from_args(args, **options):
    """One step of the recurrence, the ground truth of decoding: (o, new_state) in float64. (Chapter 02.)

    ``args`` is a checked :class:`~lightning_edu.validation.StepArgs`: q, k (batch, heads, d_k), v (batch,
    heads, d_v), state (batch, heads, d_k, d_v) or None for zeros. Per batch and head,
    ``new_state = lambda state + k^T v`` and ``o = q new_state``: the loop body of
    :func:`causal_linear_recurrent`, run once.
    """
    q, k, v = _f64(args.q, args.k, args.v)
    new_state = k[..., :, None] * v[..., None, :]  # outer product k^T v
    if args.state is not None:
        new_state = args.decay[None, :, None, None] * np.asarray(args.state, dtype=np.float64) + new_state
    return np.einsum("bhk,bhkv->bhv", q, new_state), new_state
