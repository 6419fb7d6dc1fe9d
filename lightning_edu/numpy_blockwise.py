"""Rung 1, blockwise: the paper's Algorithms 1 and 2 in float64 numpy. (Chapters 04-05.)

Notation (the book's table): a sequence of n tokens is cut into blocks of B rows; the last block may be
shorter (b <= B rows). Inside a block, rows are numbered r = 0 .. b-1 (0-based), so the token at row r is
r + 1 steps after the end of the previous block. For a block of b rows:

* ``M[r, s] = lambda^(r-s)`` for r >= s, else 0 (intra-block decay mask);
* ``lambda^(r+1)`` scales q_r against the state carried in from earlier blocks (the paper's
  Lambda = diag(lambda, ..., lambda^B) of Algorithm 1 -- not eq. 9's diag(1, ..., lambda^(B-1)));
* ``lambda^(b-1-r)`` scales k_r when it is folded into the state (the paper's lambda^B Lambda^-1, formed
  directly: Lambda^-1 holds lambda^-B, which overflows float64 for lambda = 0.05 and B = 256).

Every factor is lambda raised to a non-negative power, so nothing overflows for any lambda in (0, 1].
"""

from __future__ import annotations

import numpy as np

from .numpy_reference import decay_mask, masked_product
from .validation import validate_attention_args

__all__ = ["DEFAULT_BLOCK_SIZE", "block_factors", "block_slices", "blockwise_forward", "blockwise_backward", "algorithm1",
           "algorithm2"]

DEFAULT_BLOCK_SIZE = 64


def block_factors(b: int, decay: np.ndarray):
    """Decay factors for a block of b rows and per-head lambda of shape (heads,).

    Returns (M, q_scale, k_scale, block_decay) with shapes (heads, b, b), (heads, b, 1), (heads, b, 1),
    (heads, 1, 1): the intra mask, lambda^(r+1), lambda^(b-1-r) and lambda^b.
    """
    lam = np.asarray(decay, dtype=np.float64)[:, None, None]
    r = np.arange(b, dtype=np.float64)[None, :, None]
    return decay_mask(b, decay), lam ** (r + 1), lam ** (b - 1 - r), lam**b


def _causal(b: int) -> np.ndarray:
    """The (b, b) boolean tile r >= s: which entries of M exist. Selected with, never multiplied by."""
    return np.tril(np.ones((b, b), dtype=bool))


def block_slices(n: int, block_size: int) -> list[slice]:
    """The rows of each block of a sequence of n tokens: full blocks of B rows, the last one possibly shorter."""
    return [slice(start, min(start + block_size, n)) for start in range(0, n, block_size)]


def blockwise_forward(q, k, v, decay=1.0, block_size: int | None = None, initial_state=None):
    """Algorithm 1: o = causal decayed linear attention, computed block by block. (Chapter 04.)

    Checks the arguments, then runs :func:`algorithm1`. Returns (o, KV_final); o has shape
    (batch, heads, n, d_v), KV (batch, heads, d_k, d_v).
    """
    args = validate_attention_args(q, k, v, decay, backend="numpy", block_size=block_size,
                                   initial_state=initial_state, who="blockwise_forward")
    return algorithm1(args)


def blockwise_backward(q, k, v, do, decay=1.0, block_size: int | None = None, initial_state=None, d_final_state=None):
    """Algorithm 2: gradients of L with dL/do = ``do``, block by block. (Chapter 05.)

    ``d_final_state`` is the gradient flowing into the returned final state (zeros if None). Checks the
    arguments, then runs :func:`algorithm2`. Returns (dq, dk, dv, d_initial_state).
    """
    args = validate_attention_args(q, k, v, decay, backend="numpy", block_size=block_size, initial_state=initial_state,
                                   do=do, d_final_state=d_final_state, who="blockwise_backward", need_do=True)
    return algorithm2(args, d_final_state)


def _float64(args):
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (args.q, args.k, args.v))
    state = np.zeros((args.batch, args.heads, args.d_k, args.d_v))
    if args.initial_state is not None:
        state = np.array(args.initial_state, dtype=np.float64)
    return q, k, v, state


def algorithm1(args, **options):
    """Algorithm 1 on checked arguments (an :class:`~lightning_edu.validation.AttentionArgs`). (Chapter 04.)

    Per block i (rows b): O_i = [(Q_i K_i^T) * M] V_i  +  diag(lambda^(r+1)) Q_i KV      (intra + inter)
                          KV  = lambda^b KV  +  (diag(lambda^(b-1-r)) K_i)^T V_i          (state update)
    The mask M selects the causal entries (:func:`~lightning_edu.numpy_reference.masked_product`): it is
    never multiplied in as zeros, so a NaN at a later token cannot reach an earlier row. Returns (o, KV).
    """
    q, k, v, kv = _float64(args)
    out = np.empty((args.batch, args.heads, args.seq_len, args.d_v))
    for rows in block_slices(args.seq_len, args.block_size or DEFAULT_BLOCK_SIZE):
        qi, ki, vi = q[:, :, rows], k[:, :, rows], v[:, :, rows]
        mask, q_scale, k_scale, block_decay = block_factors(qi.shape[2], args.decay)
        intra = masked_product((qi @ ki.swapaxes(-1, -2)) * mask, _causal(qi.shape[2]), vi)
        inter = (q_scale * qi) @ kv
        out[:, :, rows] = intra + inter
        kv = block_decay * kv + (k_scale * ki).swapaxes(-1, -2) @ vi
    return out, kv


def algorithm2(args, d_final_state=None, **options):
    """Algorithm 2 on checked arguments, with dL/do = ``args.do``. (Chapter 05.)

    dQ by a forward sweep that rebuilds the state KV; dK and dV by a reverse sweep over dKV, where
    dKV after block i is d L / d KV_i = sum over later tokens s of lambda^(s - end of block i) q_s^T do_s.
    ``d_final_state`` seeds dKV (zeros if None). Returns (dq, dk, dv, d_initial_state).
    """
    q, k, v, kv = _float64(args)
    do = np.asarray(args.do, dtype=np.float64)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    blocks = block_slices(args.seq_len, args.block_size or DEFAULT_BLOCK_SIZE)
    for rows in blocks:  # forward sweep: dQ_i = [(dO_i V_i^T) * M] K_i + diag(lambda^(r+1)) dO_i KV^T
        qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
        mask, q_scale, k_scale, block_decay = block_factors(qi.shape[2], args.decay)
        dq[:, :, rows] = masked_product((doi @ vi.swapaxes(-1, -2)) * mask, _causal(qi.shape[2]), ki) + q_scale * (doi @ kv.swapaxes(-1, -2))
        kv = block_decay * kv + (k_scale * ki).swapaxes(-1, -2) @ vi
    dkv = np.zeros_like(kv) if d_final_state is None else np.array(d_final_state, dtype=np.float64)
    for rows in reversed(blocks):  # reverse sweep over dKV
        qi, ki, vi, doi = q[:, :, rows], k[:, :, rows], v[:, :, rows], do[:, :, rows]
        mask, q_scale, k_scale, block_decay = block_factors(qi.shape[2], args.decay)
        later = _causal(qi.shape[2]).T  # row s of a transposed score tile meets rows r >= s
        dk[:, :, rows] = masked_product(((doi @ vi.swapaxes(-1, -2)) * mask).swapaxes(-1, -2), later, qi) + k_scale * (vi @ dkv.swapaxes(-1, -2))
        # The intra term pairs this block's scores with this block's dO_i (eq. 19 prints dO_{t} for block t-1).
        dv[:, :, rows] = masked_product(((qi @ ki.swapaxes(-1, -2)) * mask).swapaxes(-1, -2), later, doi) + k_scale * (ki @ dkv)
        dkv = block_decay * dkv + (q_scale * qi).swapaxes(-1, -2) @ doi
    return dq, dk, dv, dkv
