"""Rung 1, recompute-heavy backward: the "Lightning Attention-3" schedule, with decay, in float64 numpy. (Chapter 09.)

Algorithm 2 (:mod:`lightning_edu.numpy_blockwise`) treats a block of B rows as one tile: its intra part
forms B x B score matrices such as (Q_i K_i^T) * M. The "Lightning Attention-3" design note keeps the
chunk of C rows for the states but cuts each chunk again into micro-chunks of c rows, and computes the
intra-chunk part tile by tile on c x c tiles, recomputing every tile where it is needed instead of keeping a
C x C matrix. Why: on a GPU those score matrices live in SRAM (shared memory and registers). In float32 a
64 x 64 tile takes 16 KB, and the backward needs three of them per chunk (Q K^T, dO V^T and the causal
index): 48 KB of a streaming multiprocessor's few hundred KB, before q, k, v and their gradients. A 16 x 16
tile takes 1 KB, (C / c)^2 = 16 times less, which leaves room for wider heads or more pipeline stages; the
price is that the tiles dO_i V_j^T are formed twice (for dQ and for dK) and that more, smaller matrix
products run.

Notation as in chapters 04-05. A sequence is cut into chunks of C rows (the last may be shorter, C_b rows);
each chunk into micro-chunks of c rows (the last one of a chunk may be shorter, and c need not divide C).
r, s number the rows of a chunk (queries and keys); i, j number its micro-chunks (queries and keys), and
Lam_ij[r', s'] = lambda^(t_r' - t_s') is the decay between the query at position t_r' and the key at t_s',
kept only where t_r' >= t_s' (which matters on the diagonal tiles i = j only).

* dQ, forward sweep over chunks, with KV the state of the chunks before this one:
  dQ_i = sum_{j <= i} [(dO_i V_j^T) * Lam_ij] K_j  +  diag(lambda^(r+1)) dO_i KV^T,
  then KV = lambda^(C_b) KV + (diag(lambda^(C_b-1-s)) K_c)^T V_c.
* dK, dV, reverse sweep over chunks, with dKV the gradient of the state after this chunk:
  dV_j = sum_{i >= j} [(Q_i K_j^T) * Lam_ij]^T dO_i  +  diag(lambda^(C_b-1-s)) K_j dKV,
  dK_j = sum_{i >= j} [(dO_i V_j^T) * Lam_ij]^T Q_i  +  diag(lambda^(C_b-1-s)) V_j dKV^T,
  then dKV = lambda^(C_b) dKV + (diag(lambda^(r+1)) Q_c)^T dO_c.

Each state is read before the chunk's own contribution is added (the note updates dkv_state first, which
counts the chunk's pairs twice; chapter 05 measures that slip). The dKV left after the first chunk is
dL / d initial_state. Every decay factor is lambda raised to a non-negative power (:func:`tile_decay`),
and the causal entries of a diagonal tile are selected, never multiplied by zeros
(:func:`~lightning_edu.numpy_reference.masked_product`), so a NaN at a later token never reaches an
earlier row. The result equals Algorithm 2 to rounding.
"""

from __future__ import annotations

import numpy as np

from .numpy_blockwise import _float64, block_slices
from .numpy_reference import masked_product
from .validation import validate_attention_args, validate_block_size, validate_decay

__all__ = ["DEFAULT_CHUNK", "DEFAULT_MICRO", "tile_decay", "intra_dq", "intra_dv", "micro_schedule", "la3_backward"]

DEFAULT_CHUNK = 64
DEFAULT_MICRO = 16


def tile_decay(lam, start_i: int, rows_i: int, start_j: int, rows_j: int):
    """The decay factor Lam_ij of one tile and which of its entries exist. (Chapter 09.)

    The tile pairs query micro-chunk i (rows start_i .. start_i + rows_i - 1) with key micro-chunk j
    (rows start_j .. start_j + rows_j - 1); only the difference of the starts matters, so they may count
    from the start of the chunk or of the sequence. ``lam`` is lambda per head, shape (heads,) (a float
    counts as one head). Returns (factor, keep): factor[h, r, s] = lambda_h^gap with
    gap = (start_i - start_j) + r - s, shape (heads, rows_i, rows_j), and keep = gap >= 0, shape
    (rows_i, rows_j).

    No negative power of lambda is ever formed. The exponent is the distance between two tokens, an integer
    computed before lambda is raised to it. On an off-diagonal tile (start_i >= start_j + rows_j) it is at
    least 1 everywhere; on a diagonal tile the entries with s > r (a key after its query) have gap < 0: they
    are clamped to exponent 0 and marked False in ``keep``, and the caller selects with ``keep`` rather than
    using them. The tempting factorisation lambda^(r+1) * lambda^(-s-1), a query scale times a key scale,
    would need lambda^(-c): for lambda = 1e-3 and c = 128 that is 1e384, past float64's largest number.
    A kernel that wants the factor as an outer product of two vectors uses non-negative pieces instead,
    lambda^(r+1) * lambda^(start_i - start_j - rows_j) * lambda^(rows_j - 1 - s) on an off-diagonal tile.
    """
    lam = np.asarray(lam, dtype=np.float64).reshape(-1)
    gap = (start_i - start_j) + np.arange(rows_i)[:, None] - np.arange(rows_j)[None, :]
    keep = gap >= 0
    return lam[:, None, None] ** np.maximum(gap, 0), keep


def _length(rows: slice) -> int:
    return rows.stop - rows.start


def _intra_query_side(a, b, x, lam, micro: int) -> np.ndarray:
    """sum_{j <= i} [(A_i B_j^T) * Lam_ij] X_j for each query micro-chunk i of one chunk, i-outer.

    With (A, B, X) = (dO, V, K) this is the intra-chunk dQ. a: (..., C_b, p), b: (..., C_b, p),
    x: (..., C_b, d); lam: (heads,). Only c x c tiles are formed. Returns (..., C_b, d).
    """
    tiles = block_slices(a.shape[-2], micro)
    out = np.empty(a.shape[:-1] + x.shape[-1:])
    for n_i, i in enumerate(tiles):
        acc = np.zeros(a.shape[:-2] + (_length(i), x.shape[-1]))
        for j in tiles[: n_i + 1]:
            factor, keep = tile_decay(lam, i.start, _length(i), j.start, _length(j))
            scores = (a[..., i, :] @ b[..., j, :].swapaxes(-1, -2)) * factor
            acc += masked_product(scores, keep, x[..., j, :])
        out[..., i, :] = acc
    return out


def _intra_key_side(a, b, x, lam, micro: int) -> np.ndarray:
    """sum_{i >= j} [(A_i B_j^T) * Lam_ij]^T X_i for each key micro-chunk j of one chunk, j-outer.

    With (A, B, X) = (Q, K, dO) this is the intra-chunk dV; with (dO, V, Q) the intra-chunk dK.
    a, x: (..., C_b, p), (..., C_b, d); b: (..., C_b, p); lam: (heads,). Returns (..., C_b, d).
    """
    tiles = block_slices(a.shape[-2], micro)
    out = np.empty(b.shape[:-1] + x.shape[-1:])
    for n_j, j in enumerate(tiles):
        acc = np.zeros(b.shape[:-2] + (_length(j), x.shape[-1]))
        for i in tiles[n_j:]:
            factor, keep = tile_decay(lam, i.start, _length(i), j.start, _length(j))
            scores = (a[..., i, :] @ b[..., j, :].swapaxes(-1, -2)) * factor
            # Row s of the transposed tile meets the queries r with r >= s: keep transposes with it.
            acc += masked_product(scores.swapaxes(-1, -2), keep.T, x[..., i, :])
        out[..., j, :] = acc
    return out


def _chunk_factors(rows: int, lam: np.ndarray):
    """lambda^(r+1), lambda^(C_b-1-s) as (heads, C_b, 1) and lambda^(C_b) as (heads, 1, 1), for C_b = rows.

    Algorithm 1's block factors (:func:`~lightning_edu.numpy_blockwise.block_factors`) without the C x C mask.
    """
    lam = lam[:, None, None]
    r = np.arange(rows, dtype=np.float64)[None, :, None]
    return lam ** (r + 1), lam ** (rows - 1 - r), lam**rows


def _micro_size(micro_size, chunk: int) -> int:
    """The micro-chunk size c: a positive integer <= the chunk size C; None gives min(DEFAULT_MICRO, C)."""
    micro = validate_block_size(micro_size, "micro_size")
    if micro is None:
        return min(DEFAULT_MICRO, chunk)
    if micro > chunk:
        raise ValueError(f"micro_size must be <= the chunk size {chunk} (a micro-chunk lies in one chunk), got {micro}")
    return micro


def micro_schedule(args, d_final_state=None, micro_size=None, **options):
    """The recompute-heavy backward on checked arguments, with dL/do = ``args.do``. (Chapter 09.)

    ``args.block_size`` is the chunk size C (:data:`DEFAULT_CHUNK` if None), ``micro_size`` the micro-chunk
    size c <= C (min(:data:`DEFAULT_MICRO`, C) if None). ``d_final_state`` starts dKV (zeros if None).
    Returns (dq, dk, dv, d_initial_state) in float64, the same as
    :func:`~lightning_edu.numpy_blockwise.algorithm2`.
    """
    chunk = args.block_size or DEFAULT_CHUNK
    micro = _micro_size(micro_size, chunk)
    q, k, v, kv = _float64(args)
    do = np.asarray(args.do, dtype=np.float64)
    lam = args.decay
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    chunks = block_slices(args.seq_len, chunk)
    for rows in chunks:  # forward sweep: KV holds the chunks before this one
        kc, vc, doc = k[:, :, rows], v[:, :, rows], do[:, :, rows]
        q_scale, k_scale, chunk_decay = _chunk_factors(_length(rows), lam)
        dq[:, :, rows] = _intra_query_side(doc, vc, kc, lam, micro) + q_scale * (doc @ kv.swapaxes(-1, -2))
        kv = chunk_decay * kv + (k_scale * kc).swapaxes(-1, -2) @ vc
    dkv = np.zeros_like(kv) if d_final_state is None else np.array(d_final_state, dtype=np.float64)
    for rows in reversed(chunks):  # reverse sweep: dKV holds the chunks after this one
        qc, kc, vc, doc = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
        q_scale, k_scale, chunk_decay = _chunk_factors(_length(rows), lam)
        dv[:, :, rows] = _intra_key_side(qc, kc, doc, lam, micro) + k_scale * (kc @ dkv)
        dk[:, :, rows] = _intra_key_side(doc, vc, qc, lam, micro) + k_scale * (vc @ dkv.swapaxes(-1, -2))
        dkv = chunk_decay * dkv + (q_scale * qc).swapaxes(-1, -2) @ doc
    return dq, dk, dv, dkv


def la3_backward(q, k, v, do, decay=1.0, chunk_size: int | None = None, micro_size: int | None = None,
                 initial_state=None, d_final_state=None):
    """Gradients of L with dL/do = ``do`` by the recompute-heavy micro-chunk schedule. (Chapter 09.)

    q, k: (batch, heads, n, d_k); v, do: (batch, heads, n, d_v); states (batch, heads, d_k, d_v); decay:
    lambda in (0, 1], a float or one value per head. ``chunk_size`` is C (:data:`DEFAULT_CHUNK` if None),
    ``micro_size`` is c, at most C (min(:data:`DEFAULT_MICRO`, C) if None). Checks the arguments, then runs
    :func:`micro_schedule`. Returns (dq, dk, dv, d_initial_state) in float64.
    """
    chunk_size = validate_block_size(chunk_size, "chunk_size")  # checked here so that its error names it
    args = validate_attention_args(q, k, v, decay, backend="numpy", block_size=chunk_size, initial_state=initial_state,
                                   do=do, d_final_state=d_final_state, who="la3_backward", need_do=True)
    micro = _micro_size(micro_size, args.block_size or DEFAULT_CHUNK)
    return micro_schedule(args, d_final_state, micro_size=micro)


def _one_chunk(named: dict, pair: tuple, decay, micro_size):
    """Check the arguments of :func:`intra_dq` / :func:`intra_dv`: 2-D float arrays of one chunk of one head.

    All have the same rows; the two named in ``pair`` meet in one product and must have the same width.
    Returns the arrays as (1, 1, C, d) float64 (batch = heads = 1), lambda of shape (1,) and c.
    """
    for name, x in named.items():
        if not isinstance(x, np.ndarray) or isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"{name} must be a numpy.ndarray holding one chunk of one head, got {type(x).__name__}")
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(f"{name} must hold floating-point numbers, got dtype {x.dtype}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be 2-D (rows, d) for one chunk of one head, got {x.ndim}-D shape {x.shape}")
    first, *others = named
    for name in others:
        if named[name].shape[0] != named[first].shape[0]:
            raise ValueError(f"{name} must have as many rows as {first}: expected {named[first].shape[0]}, "
                             f"got {named[name].shape[0]}")
    left, right = pair
    if named[right].shape[1] != named[left].shape[1]:
        raise ValueError(f"{right} must have the same width as {left} (axis 1): expected {named[left].shape[1]}, "
                         f"got {named[right].shape[1]}")
    lam = validate_decay(decay, 1)
    micro = validate_block_size(micro_size, "micro_size")
    arrays = [np.asarray(x, dtype=np.float64)[None, None] for x in named.values()]
    return arrays, lam, DEFAULT_MICRO if micro is None else micro


def intra_dq(do, v, k, decay=1.0, micro_size: int | None = None) -> np.ndarray:
    """The intra-chunk dQ of one chunk of one head, on micro-chunk tiles. (Chapter 09.)

    dQ_i = sum_{j <= i} [(dO_i V_j^T) * Lam_ij] K_j, i-outer, never forming a C x C matrix. do: (C, d_v),
    v: (C, d_v), k: (C, d_k); decay: a float lambda in (0, 1]; micro_size: c (:data:`DEFAULT_MICRO` if
    None; a chunk shorter than c is one tile, like the last chunk of a sequence). Returns (C, d_k) float64.
    """
    (do, v, k), lam, micro = _one_chunk({"do": do, "v": v, "k": k}, ("do", "v"), decay, micro_size)
    return _intra_query_side(do, v, k, lam, micro)[0, 0]


def intra_dv(q, k, do, decay=1.0, micro_size: int | None = None) -> np.ndarray:
    """The intra-chunk dV of one chunk of one head, on micro-chunk tiles. (Chapter 09.)

    dV_j = sum_{i >= j} [(Q_i K_j^T) * Lam_ij]^T dO_i, j-outer, never forming a C x C matrix. q, k: (C, d_k),
    do: (C, d_v); decay and micro_size as in :func:`intra_dq`. Returns (C, d_v) float64.
    """
    (q, k, do), lam, micro = _one_chunk({"q": q, "k": k, "do": do}, ("q", "k"), decay, micro_size)
    return _intra_key_side(q, k, do, lam, micro)[0, 0]
