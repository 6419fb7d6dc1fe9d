"""Feature maps phi, the normaliser z, and the softmax/linear hybrid. (Chapter 11.)

Softmax attention weighs key s for query t by exp(q_t . k_s / sqrt(d)) and divides by the row's sum.
Linear attention replaces the exponential by a product of features, phi(q_t) . phi(k_s), so that the sums
factor through a d' x d_v state (chapter 01). Keeping the softmax's division gives *normalized* linear
attention, the form of the explainer on feature maps and decoding, "Inference: No KV Cache":

    S_t = lambda S_{t-1} + phi(k_t)^T v_t,   z_t = lambda z_{t-1} + phi(k_t),
    o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps).

Lightning Attention itself (the function this book computes, :func:`lightning_edu.lightning_attention`) has
no z: the model it was written for, TransNormerLLM, puts a norm layer on the output instead of dividing by
phi(q) . z. This module holds what the normalised variants need (what the public entry points run is
defined one module down, in :mod:`.feature_core`, and re-exported here):

* the maps by name (:data:`~lightning_edu.validation.FEATURE_MAP_NAMES`: "identity", "elu+1", "relu2"),
  for numpy and torch, and a learned one, :class:`LearnedReLU2` (torch) with its numpy twin
  :class:`ReLU2Projection`;
* the hybrid's two implementations, :func:`hybrid_numpy` and :func:`hybrid_torch` (the public entry is
  :func:`lightning_edu.hybrid_attention`): causal softmax inside each block, linear attention to the blocks
  before it, one joint normaliser;
* the explicit weight matrix of each method for one head (:func:`attention_weights`), so the chapter can
  plot rows and check their sums;
* two measurements: how far each map's weights land from softmax's (:func:`approximation_table`) and
  what eps does to a small denominator in float32 and bfloat16 (:func:`eps_table`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

# What the public entry points run lives one module down, in feature_core (api imports it; this module imports
# api for eps_table), and is re-exported here, where the chapter finds it.
from .feature_core import (
    NUMPY_FEATURE_MAPS, TORCH_FEATURE_MAPS, append_ones, apply_feature_map, divide_by_normaliser, hybrid_numpy,
    hybrid_torch, joint_normalise, relu_squared, resolve_feature_map,
)
from .validation import (
    FEATURE_MAP_NAMES, WEIGHT_METHODS, check_finite_scalar, validate_choice, validate_decay, validate_eps,
    validate_feature_input, validate_positive_int, validate_single_head,
)

__all__ = [
    "FEATURE_MAP_NAMES", "WEIGHT_METHODS", "relu_squared", "NUMPY_FEATURE_MAPS", "TORCH_FEATURE_MAPS",
    "resolve_feature_map", "apply_feature_map", "append_ones", "divide_by_normaliser",
    "ReLU2Projection", "LearnedReLU2", "joint_normalise", "hybrid_numpy", "hybrid_torch",
    "attention_weights", "approximation_table", "eps_table",
]


# --------------------------------------------------------------------------------------------------
# The learned map (the named maps, [v | 1] and its division live in lightning_edu.feature_core).
# --------------------------------------------------------------------------------------------------

class ReLU2Projection:
    """phi(x) = ReLU(x W)^2 in float64 numpy, W of shape (d, d'): the numpy twin of :class:`LearnedReLU2`."""

    def __init__(self, W):
        W = np.array(W, dtype=np.float64)
        if W.ndim != 2:
            raise ValueError(f"W must be 2-D (d, d_feature), got shape {W.shape}")
        self.W = W

    def __call__(self, x):
        x = np.asarray(x, dtype=np.float64)
        validate_feature_input("x", x, self.W.shape[0])
        return np.maximum(x @ self.W, 0.0) ** 2

    def __repr__(self) -> str:
        return f"ReLU2Projection(d={self.W.shape[0]}, d_feature={self.W.shape[1]})"


class LearnedReLU2(torch.nn.Module):
    """A learned feature map phi(x) = ReLU(x W)^2, W a (d, d_feature) parameter; d_feature may differ from d.

    The map the explainer on feature maps and decoding, "Inference: No KV Cache" proposes, without its
    ``+ 1e-6`` floor on every feature: here phi(x) is exactly 0 where every projection is negative, so the
    normaliser of :func:`lightning_edu.normalized_attention` relies on its own ``eps`` (one guard, in one
    place). W starts as N(0, init_scale^2), init_scale = d^-0.5 by default (the explainer uses 0.1);
    ``generator`` makes it reproducible. :meth:`numpy` returns the float64 twin, :class:`ReLU2Projection`.
    """

    def __init__(self, d: int, d_feature: int | None = None, *, init_scale: float | None = None, generator=None,
                 dtype=None, device=None):
        super().__init__()
        self.d = validate_positive_int("d", d)
        self.d_feature = self.d if d_feature is None else validate_positive_int("d_feature", d_feature)
        scale = self.d ** -0.5 if init_scale is None else check_finite_scalar("init_scale", init_scale)
        W = torch.randn(self.d, self.d_feature, generator=generator, dtype=dtype or torch.float32, device=device)
        self.W = torch.nn.Parameter(W * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        validate_feature_input("x", x, self.d, self.W)
        # In x's dtype even under CUDA autocast, which computes x @ W in 16 bits and ** 2 in float32.
        return (F.relu(x @ self.W) ** 2).to(x.dtype)

    def numpy(self) -> ReLU2Projection:
        return ReLU2Projection(self.W.detach().cpu().double().numpy())

    def extra_repr(self) -> str:
        return f"d={self.d}, d_feature={self.d_feature}"


# --------------------------------------------------------------------------------------------------
# Explicit weights of one head, and the measurements.
# --------------------------------------------------------------------------------------------------

def attention_weights(q, k, method: str, *, feature_map="elu+1", decay=1.0, block_size: int | None = None,
                      scale: float | None = None, eps: float = 1e-6) -> np.ndarray:
    """The (n, n) matrix W with o = W v for one head, in float64: what each method does to each row.

    q, k: (n, d_k), numpy arrays or tensors (copied to float64). Entries are 0 above the diagonal.

    * "softmax": W_ts proportional to lambda^(t-s) exp(scale q_t . k_s), rows summing to 1 (causal
      softmax at lambda = 1; lambda < 1 adds the bias (t - s) log lambda to the scores);
    * "linear": W_ts = lambda^(t-s) phi(q_t) . phi(k_s), unnormalised: lightning_attention on phi(q), phi(k);
    * "normalized": the "linear" row divided by (its sum + eps): :func:`lightning_edu.normalized_attention`;
      rows sum to den / (den + eps), 1 at eps = 0;
    * "hybrid": :func:`lightning_edu.hybrid_attention` (``block_size`` required): softmax weights in the
      row's block, linear weights before it, divided by their joint sum: rows sum to 1;
    * "hybrid_separate": the explainer's chunked module: the in-block softmax normalised on its own plus
      the linear part divided by max(its own sum, eps) (the explainer's clamp at 1e-6): rows sum to 1 in
      the first block and to 2 after it.

    ``scale`` (default d_k^-0.5) is used by the softmax parts, ``feature_map`` and ``eps`` by the others,
    ``block_size`` by the two hybrids only.
    """
    q, k = validate_single_head(q, k)
    method = validate_choice("method", method, WEIGHT_METHODS)
    lam = float(validate_decay(decay, 1)[0])
    eps = validate_eps(eps)
    scale = q.shape[1] ** -0.5 if scale is None else check_finite_scalar("scale", scale)
    n = q.shape[0]
    t = np.arange(n)
    gap = t[:, None] - t[None, :]
    keep = gap >= 0
    decay_mask = np.where(keep, lam ** np.maximum(gap, 0), 0.0)
    scores = q @ k.T * scale + gap * math.log(lam)
    if method == "softmax":
        return _row_softmax(np.where(keep, scores, -np.inf))
    phi_q, phi_k, _ = apply_feature_map(feature_map, q, k, "numpy")
    linear = np.where(keep, (phi_q @ phi_k.T) * decay_mask, 0.0)
    if method == "linear":
        return linear
    if method == "normalized":
        with np.errstate(divide="ignore", invalid="ignore"):
            return linear / (linear.sum(axis=1, keepdims=True) + eps)
    if block_size is None:
        raise TypeError(f"block_size must be a positive integer for method {method!r}, got None")
    block_size = validate_positive_int("block_size", block_size)
    same_block = (t[:, None] // block_size) == (t[None, :] // block_size)
    earlier = t[None, :] < (t[:, None] // block_size) * block_size
    intra = np.where(keep & same_block, scores, -np.inf)
    inter = np.where(earlier, linear, 0.0)
    if method == "hybrid_separate":
        return _row_softmax(intra) + inter / np.maximum(inter.sum(axis=1, keepdims=True), eps)
    m = intra.max(axis=1, keepdims=True)
    e = np.exp(intra - m)
    a = np.abs(inter).sum(axis=1, keepdims=True)  # the size of the linear part (its weights only, no v here)
    has = a > 0
    a_safe = np.where(has, a, 1.0)
    log_a = np.where(has, np.log(a_safe), -np.inf)
    M = np.maximum(m, log_a)
    num = np.exp(m - M) * e + np.exp(log_a - M) * inter / a_safe
    return num / num.sum(axis=1, keepdims=True)


def _row_softmax(scores):
    e = np.exp(scores - scores.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def approximation_table(scales=(0.5, 1, 2, 4), d: int = 16, n: int = 128, seed: int = 0,
                        maps=("elu+1", "relu2", "identity")) -> list[dict]:
    """How close phi-attention's weights come to causal softmax's, per map and input scale. (Chapter 11.)

    For each scale sigma: q, k of shape (n, d) with entries N(0, sigma^2), drawn once from ``seed`` (the same
    draw, rescaled, for every sigma), so the softmax logits q . k / sqrt(d) have standard deviation sigma^2:
    flat at sigma = 0.5, sharp at sigma = 4. For each map, the rows of "normalized" weights (eps = 0) are
    compared with the rows of "softmax" weights (same q, k, scale d^-0.5) by the total variation distance
    TV_t = 1/2 sum_s |W_ts - P_ts|, which is 0 for equal rows and 1 for disjoint ones (it can exceed 1 when a
    map that is not positive makes weights negative). Row 0 is left out (both put weight 1 on key 0).

    Each row of the result: map, scale, mean_tv, max_tv, and the denominator phi(q_t) . z_t, z_t = sum_{s<=t}
    phi(k_s): min_denominator (its smallest value over rows), nonpositive_rows (how many rows have it <= 0:
    their weights are not a probability distribution).
    """
    d, n = validate_positive_int("d", d), validate_positive_int("n", n)
    rng = np.random.default_rng(seed)
    q0, k0 = rng.standard_normal((2, n, d))
    rows = []
    for sigma in scales:
        sigma = check_finite_scalar("scale", sigma)
        q, k = sigma * q0, sigma * k0
        softmax = attention_weights(q, k, "softmax")
        for name in maps:
            weights = attention_weights(q, k, "normalized", feature_map=name, eps=0.0)
            tv = 0.5 * np.abs(weights - softmax).sum(axis=1)[1:]
            phi_q, phi_k, _ = apply_feature_map(name, q, k, "numpy")
            den = np.einsum("tf,tf->t", phi_q, np.cumsum(phi_k, axis=0))
            rows.append({"map": name if isinstance(name, str) else repr(name), "scale": sigma,
                         "mean_tv": float(tv.mean()) if tv.size else 0.0, "max_tv": float(tv.max()) if tv.size else 0.0,
                         "min_denominator": float(den.min()), "nonpositive_rows": int(np.sum(den <= 0))})
    return rows


def eps_table(eps_values=(0.0, 1e-9, 1e-6, 1e-3), dtypes=("float32", "float16", "bfloat16"), *,
              feature_map="relu2", q_scale: float = 1e-3, n: int = 64, d: int = 16, seed: int = 0) -> list[dict]:
    """What eps does to :func:`lightning_edu.normalized_attention` in low precision, on small denominators.

    One head, q, k, v with N(0, 1) entries (q times ``q_scale``), float64 numpy as the judge. The default,
    "relu2" with q scaled by 1e-3, makes every feature of q about 1e-6 and every denominator phi(q_t) . z_t
    small (down to about 2e-7), though the ratio itself is harmless: the output does not change when phi(q)
    is scaled, but eps does not scale with it, so eps = 1e-6 pulls the outputs towards 0 by tens of percent.
    The rounding alone stays at the dtype's level for float32 and bfloat16 (same exponent range), while
    float16 loses digits to subnormals. The other face: ``feature_map="identity"`` (try n = 512), whose
    denominators q_t . sum_{s<=t} k_s take either sign and pass near 0, a pole that amplifies rounding and
    that eps moves but does not remove.

    For each dtype (torch backend, CPU) and eps, a row: dtype, eps, rel_error (against float64 with the same
    eps: the rounding alone), rel_error_exact (against float64 with eps = 0: rounding and eps's bias together),
    min_abs_denominator (float64, over rows) and max_abs_output (of the low-precision result).
    """
    from .api import normalized_attention
    from .checks import relative_error

    n, d = validate_positive_int("n", n), validate_positive_int("d", d)
    q_scale = check_finite_scalar("q_scale", q_scale)
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((3, 1, 1, n, d))
    q = q * q_scale
    phi_q, phi_k, _ = apply_feature_map(feature_map, q, k, "numpy")
    den = np.einsum("bhtf,bhtf->bht", phi_q, np.cumsum(phi_k, axis=2))
    exact = normalized_attention(q, k, v, feature_map=feature_map, eps=0.0, backend="numpy")
    rows = []
    for dtype_name in dtypes:
        dtype = getattr(torch, validate_choice("dtype", dtype_name, ("float64", "float32", "float16", "bfloat16")))
        qt, kt, vt = (torch.from_numpy(x).to(dtype) for x in (q, k, v))
        for eps in eps_values:
            eps = validate_eps(eps)
            ref = normalized_attention(q, k, v, feature_map=feature_map, eps=eps, backend="numpy")
            got = normalized_attention(qt, kt, vt, feature_map=feature_map, eps=eps, backend="torch")
            got64 = got.double().numpy()
            rows.append({"dtype": dtype_name, "eps": eps, "rel_error": relative_error(got64, ref),
                         "rel_error_exact": relative_error(got64, exact),
                         "min_abs_denominator": float(np.abs(den).min()),
                         "max_abs_output": float(np.abs(got64).max())})
    return rows
