"""What the public normalised variants run: the named feature maps, [v | 1] and its division, the hybrid. (Chapter 11.)

:func:`lightning_edu.normalized_attention`, :func:`lightning_edu.normalized_attention_step` and
:func:`lightning_edu.hybrid_attention` (in :mod:`lightning_edu.api`) call these functions. They sit below
:mod:`lightning_edu.feature_maps`, which re-exports every one of them, because that module also measures those
entry points (:func:`lightning_edu.feature_maps.eps_table`): api imports this module, feature_maps imports
api, and neither imports the other back. Import them from :mod:`lightning_edu.feature_maps`; the chapter and
its formulas are described there.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .numpy_reference import elu_plus_one, masked_product
from .torch_chunked import chunk_factors, compute_dtype, masked_product as torch_masked_product, scan_states, to_blocks
from .validation import device_decay, validate_feature_map, validate_feature_output

__all__ = [
    "relu_squared", "NUMPY_FEATURE_MAPS", "TORCH_FEATURE_MAPS", "resolve_feature_map", "apply_feature_map",
    "append_ones", "divide_by_normaliser", "joint_normalise", "hybrid_numpy", "hybrid_torch",
]


# --------------------------------------------------------------------------------------------------
# The maps.
# --------------------------------------------------------------------------------------------------

def relu_squared(x: np.ndarray) -> np.ndarray:
    """phi(x) = ReLU(x)^2: non-negative, zero on the whole negative half-space (so phi(q) can be all zero)."""
    x = np.asarray(x, dtype=np.float64)
    return np.maximum(x, 0.0) ** 2


#: The named maps for numpy arrays (float64).
NUMPY_FEATURE_MAPS = {"identity": lambda x: np.asarray(x, dtype=np.float64), "elu+1": elu_plus_one,
                      "relu2": relu_squared}
#: The same maps for torch tensors (differentiable, any float dtype and device).
TORCH_FEATURE_MAPS = {"identity": lambda x: x, "elu+1": lambda x: F.elu(x) + 1.0, "relu2": lambda x: F.relu(x) ** 2}


def resolve_feature_map(feature_map, kind: str):
    """The function behind a validated ``feature_map``: a name's numpy or torch map, or the callable itself."""
    feature_map = validate_feature_map(feature_map, kind)
    if isinstance(feature_map, str):
        return (NUMPY_FEATURE_MAPS if kind == "numpy" else TORCH_FEATURE_MAPS)[feature_map]
    return feature_map


def apply_feature_map(feature_map, q, k, kind: str):
    """(phi(q), phi(k), d'): the map applied to q and k (..., d_k), each output checked.

    numpy inputs are mapped in float64 (the numpy rung's precision). A callable must keep the leading axes,
    return the same kind of array (and, for torch, the same dtype and device), and give phi(q) and phi(k) the
    same last axis d', which may differ from d_k.
    """
    fn = resolve_feature_map(feature_map, kind)
    if kind == "numpy":
        q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    phi_q = fn(q)
    d_feature = validate_feature_output("feature_map(q)", phi_q, q, kind)
    phi_k = fn(k)
    validate_feature_output("feature_map(k)", phi_k, k, kind, d_feature)
    if kind == "numpy":
        phi_q, phi_k = np.asarray(phi_q, dtype=np.float64), np.asarray(phi_k, dtype=np.float64)
    return phi_q, phi_k, d_feature


def append_ones(v):
    """[v | 1]: v (..., d_v) with a column of ones appended, (..., d_v + 1), in v's dtype (and device).

    Linear attention run on [v | 1] carries S and z in one state: its last column is sum lambda^(t-s) phi(k_s),
    the normaliser z_t, exactly (a value of 1 per key).
    """
    if isinstance(v, np.ndarray):
        return np.concatenate([v, np.ones(v.shape[:-1] + (1,), dtype=v.dtype)], axis=-1)
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


def divide_by_normaliser(out, eps: float):
    """o = numerator / (denominator + eps) from the output of linear attention on [v | 1] (..., d_v + 1).

    No clamp: a denominator that is 0 or negative (the "identity" map, or any map that is not positive)
    gives inf, NaN or a sign flip, visibly. 16-bit tensors are divided in float32 and rounded once.
    """
    if isinstance(out, np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            return out[..., :-1] / (out[..., -1:] + eps)
    dtype = out.dtype
    work = out.to(compute_dtype(dtype))
    return (work[..., :-1] / (work[..., -1:] + eps)).to(dtype)


# --------------------------------------------------------------------------------------------------
# The hybrid: causal softmax inside each block, linear attention to earlier blocks, one joint normaliser.
# --------------------------------------------------------------------------------------------------

def joint_normalise(m, U, A, N, L, xp=np):
    """Combine the two parts of a hybrid row on one scale and divide once; returns o.

    The row's unnormalised weights are e^{s_ts} for the keys of its block (``U`` = sum e^{s - m} v, ``A`` =
    sum e^{s - m}, ``m`` the row's largest in-block score s) and w_ts = lambda^(t-s) phi(q_t) . phi(k_s) for
    earlier keys (``N`` = sum w v, ``L`` = sum w, read off the state). The answer is
    (e^m U + N) / (e^m A + L). To evaluate it without overflow, numerator and denominator are multiplied by
    e^{-M}, M = max(m, log a), a = max(|L|, max_j |N_j|) the size of the linear part (a = 0: no linear part,
    log a = -inf):

        o = (e^{m-M} U + e^{log a - M} N / a) / (e^{m-M} A + e^{log a - M} L / a).

    Both exponents are <= 0 and |N| / a, |L| / a <= 1: nothing overflows, whatever the scores. m, M and a
    are treated as constants for autograd (o does not depend on them: they cancel). Shapes: m, A, L
    (..., 1); U, N (..., d_v). ``xp`` is numpy or torch.
    """
    if xp is np:
        a = np.maximum(np.abs(L), np.abs(N).max(axis=-1, keepdims=True))
        has = a > 0
        a_safe = np.where(has, a, 1.0)
        log_a = np.where(has, np.log(a_safe), -np.inf)
        M = np.maximum(m, log_a)
        w_soft, w_lin = np.exp(m - M), np.exp(log_a - M)
    else:
        m = m.detach()
        a = torch.maximum(L.detach().abs(), N.detach().abs().amax(dim=-1, keepdim=True))
        has = a > 0
        a_safe = torch.where(has, a, torch.ones_like(a))
        log_a = torch.where(has, a_safe.log(), torch.full_like(a, -math.inf))
        M = torch.maximum(m, log_a)
        w_soft, w_lin = (m - M).exp(), (log_a - M).exp()
    return (w_soft * U + w_lin * (N / a_safe)) / (w_soft * A + w_lin * (L / a_safe))


def hybrid_numpy(args, phi_q, phi_k, block_size: int, scale: float):
    """The hybrid in float64 numpy, block by block: the reference. (Chapter 11.)

    ``args``: checked :class:`~lightning_edu.validation.AttentionArgs`; phi_q, phi_k (batch, heads, n, d').
    Per block: in-block scores s_ts = scale q_t . k_s + (t - s) log lambda (s <= t), the inter part from the
    state of [v | 1] entering the block, then :func:`joint_normalise`; the state advances like
    lightning_attention's: S <- lambda^b S + sum_r lambda^(b-1-r) phi(k_r)^T [v_r | 1].
    Returns o (batch, heads, n, d_v) in float64.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (args.q, args.k, args.v))
    lam = np.asarray(args.decay, dtype=np.float64)[None, :, None, None]  # (1, heads, 1, 1)
    log_lam = np.log(lam)
    v1 = append_ones(v)
    d_v, n = args.d_v, args.seq_len
    state = np.zeros((args.batch, args.heads, phi_q.shape[-1], d_v + 1))
    out = np.empty((args.batch, args.heads, n, d_v))
    for start in range(0, n, block_size):
        rows = slice(start, min(start + block_size, n))
        b = rows.stop - start
        r = np.arange(b)
        gap = r[:, None] - r[None, :]
        keep = gap >= 0
        with np.errstate(invalid="ignore"):  # inf scores give NaN below, as they should
            scores = np.where(keep, (q[:, :, rows] @ k[:, :, rows].swapaxes(-1, -2)) * scale + gap * log_lam, -np.inf)
            m = scores.max(axis=-1, keepdims=True)  # the diagonal is always kept: finite for finite inputs
            e = np.exp(scores - m)
        U = masked_product(e, keep, v[:, :, rows])
        A = e.sum(axis=-1, keepdims=True)
        inter = lam ** (r + 1)[:, None] * (phi_q[:, :, rows] @ state)  # lambda^(r+1) phi(q) [S | z]
        with np.errstate(invalid="ignore", over="ignore"):
            out[:, :, rows] = joint_normalise(m, U, A, inter[..., :d_v], inter[..., d_v:])
        state = lam**b * state + (lam ** (b - 1 - r)[:, None] * phi_k[:, :, rows]).swapaxes(-1, -2) @ v1[:, :, rows]
    return out


def hybrid_torch(args, phi_q, phi_k, block_size: int, scale: float):
    """The hybrid in torch, all blocks at once, differentiable by autograd (decay too). (Chapter 11.)

    Same formula as :func:`hybrid_numpy`. n is zero-padded to a multiple of the block size (padded keys sit
    after every real query, so the causal mask and the state order keep them out); the states entering each
    block come from the log-depth scan of :func:`lightning_edu.torch_chunked.scan_states`. float16/bfloat16
    inputs compute in float32; o comes back in v's dtype.
    """
    v = args.v
    dtype = compute_dtype(v.dtype)
    n, d_v, B = args.seq_len, args.d_v, block_size
    lam = device_decay(args.decay, v.device, torch.float64)
    q, k, v, phi_q, phi_k = (x.to(dtype) for x in (args.q, args.k, v, phi_q, phi_k))
    qb, kb, vb = (to_blocks(x, B) for x in (q, k, v))
    pqb, pkb, v1b = (to_blocks(x, B) for x in (phi_q, phi_k, append_ones(v)))
    r = torch.arange(B, device=v.device)
    gap = (r[:, None] - r[None, :]).to(torch.float64)
    keep = gap >= 0
    bias = (gap * lam.log()[:, None, None]).to(dtype)[:, None]  # (heads, 1, B, B): (t - s) log lambda
    scores = torch.where(keep, (qb @ kb.transpose(-1, -2)) * scale + bias, -math.inf)
    m = scores.amax(dim=-1, keepdim=True).detach()
    e = (scores - m).exp()
    U = torch_masked_product(e, keep, vb)
    A = e.sum(dim=-1, keepdim=True)
    _, q_scale, k_scale, block_decay = chunk_factors(n, B, lam, dtype)
    states = scan_states((k_scale * pkb).transpose(-1, -2) @ v1b, block_decay, scan="log")[:, :, :-1]
    inter = (q_scale * pqb) @ states  # lambda^(r+1) phi(q) [S | z], the state entering each block
    o = joint_normalise(m, U, A, inter[..., :d_v], inter[..., d_v:], xp=torch)
    return o.reshape(args.batch, args.heads, -1, d_v)[:, :, :n].to(args.v.dtype)
