"""Checks for the exercises of chapter 04 (the intra/inter-block decomposition, Algorithm 1).

The reader's functions work on one head: 2-D arrays q, k of shape (n, d_k) or (b, d_k), v of shape
(n, d_v) or (b, d_v), a float ``decay`` lambda, and a d_k x d_v state ``kv``. Blocks are numbered from 0
and rows inside a block r = 0 .. b-1, as in the package.
"""

from __future__ import annotations

import numpy as np

from ..checks import random_qkv, relative_error
from ..numpy_blockwise import block_slices, blockwise_forward
from ..numpy_reference import causal_linear_masked, causal_linear_recurrent
from ._core import ExerciseError, expect_close, expect_shape, passed, wrong_rows

__all__ = ["check_intra_block", "check_state_update", "check_blockwise_attention"]


def _one_head(n, d_k, d_v, seed):
    q, k, v = random_qkv(1, 1, n, d_k, d_v, seed=seed)
    return q[0, 0], k[0, 0], v[0, 0]


def _ref_intra(q, k, v, lam):
    # The intra part of a block is the masked product on that block alone.
    return causal_linear_masked(q[None, None], k[None, None], v[None, None], lam)[0, 0]


def _ref_state(kv, k, v, lam):
    # The state after a block is the recurrence run over the block from the state before it.
    d_k = k.shape[1]
    q = np.zeros((1, 1, k.shape[0], d_k))
    _, state = causal_linear_recurrent(q, k[None, None], v[None, None], lam, initial_state=kv[None, None], return_state=True)
    return state[0, 0]


def _known_mistake(q, k, v, lam, block, inter_power, update_first):
    """Algorithm 1 with one classic mistake (for diagnosis only): the inter factor lambda^(r + inter_power),
    or the state updated before the block's output."""
    out = np.empty((len(q), v.shape[1]))
    kv = np.zeros((q.shape[1], v.shape[1]))
    for start, stop in ((r.start, r.stop) for r in block_slices(len(q), block)):
        qi, ki, vi = q[start:stop], k[start:stop], v[start:stop]
        if update_first:
            kv = _ref_state(kv, ki, vi, lam)
        r = np.arange(stop - start)[:, None]
        out[start:stop] = _ref_intra(qi, ki, vi, lam) + (lam ** (r + inter_power) * qi) @ kv
        if not update_first:
            kv = _ref_state(kv, ki, vi, lam)
    return out


def check_intra_block(intra_block) -> bool:
    """``intra_block(q_i, k_i, v_i, decay)`` must return [(Q_i K_i^T) * M] V_i for one block: shape (b, d_v)."""
    cases = [(37, 8, 5, 3, 0.8, 40), (20, 20, 4, 6, 1.0, 41), (300, 300, 3, 2, 0.05, 42)]
    for n, block, d_k, d_v, lam, seed in cases:
        q, k, v = _one_head(n, d_k, d_v, seed)
        for index, (start, stop) in enumerate((r.start, r.stop) for r in block_slices(n, block)):
            qi, ki, vi = q[start:stop], k[start:stop], v[start:stop]
            ref = _ref_intra(qi, ki, vi, lam)
            name = f"intra_block on block {index} (rows {start}-{stop - 1}, lambda = {lam})"
            got = expect_shape(name, intra_block(qi.copy(), ki.copy(), vi.copy(), lam), ref.shape)
            if not np.all(np.isfinite(got)):
                raise ExerciseError(f"{name} contains inf or NaN: build M from non-negative powers, lambda ** max(r - s, 0), never lambda ** -s")
            if relative_error(got, ref) <= 1e-10:
                continue
            if relative_error(got, (qi @ ki.T) @ vi) <= 1e-10:
                raise ExerciseError(f"{name}: you left out the mask M, so row r also sees the later rows s > r (and no decay)")
            if relative_error(got, ((qi @ ki.T) * np.tril(np.ones((len(qi), len(qi))))) @ vi) <= 1e-10 and lam != 1.0:
                raise ExerciseError(f"{name}: causal but not decayed: M[r, s] = lambda^(r - s) below the diagonal, not 1")
            r = np.arange(len(qi))
            upper = np.where(r[:, None] <= r[None, :], lam ** np.maximum(r[None, :] - r[:, None], 0), 0.0)
            if relative_error(got, ((qi @ ki.T) * upper) @ vi) <= 1e-10:
                raise ExerciseError(f"{name}: your M is transposed: row r (the query) sees keys s <= r, so the nonzeros are in the lower triangle")
            expect_close(name, got, ref, rtol=1e-10, hint="scores = q_i @ k_i.T; multiply by M elementwise; then @ v_i")
    return passed(f"intra part right on every block of {len(cases)} sequences, lambda = 0.05 with a 300-row block included")


def check_state_update(update_state) -> bool:
    """``update_state(kv, k_i, v_i, decay)`` must return lambda^b KV + (diag(lambda^(b-1-r)) K_i)^T V_i:
    the d_k x d_v state after a block of b rows, from the state before it."""
    cases = [(37, 8, 5, 3, 0.8, 60), (45, 16, 4, 4, 1.0, 61), (600, 300, 3, 2, 0.05, 62)]
    for n, block, d_k, d_v, lam, seed in cases:
        _, k, v = _one_head(n, d_k, d_v, seed)
        kv_mine = np.zeros((d_k, d_v))
        kv_ref = np.zeros((d_k, d_v))
        for index, (start, stop) in enumerate((r.start, r.stop) for r in block_slices(n, block)):
            ki, vi = k[start:stop], v[start:stop]
            b = stop - start
            ref = _ref_state(kv_ref, ki, vi, lam)
            name = f"the state after block {index} (rows {start}-{stop - 1}, b = {b}, lambda = {lam})"
            got = expect_shape(name, update_state(kv_mine.copy(), ki.copy(), vi.copy(), lam), ref.shape)
            if not np.all(np.isfinite(got)):
                raise ExerciseError(
                    f"{name} contains inf or NaN: you formed a negative power. lambda^B Lambda^-1 holds lambda^-{b} "
                    f"= {lam}**-{b}, which overflows float64; form lambda ** (b - 1 - r) directly"
                )
            if relative_error(got, ref) > 1e-10:
                r = np.arange(b)[:, None]
                wrong = {
                    "you scaled k_r by lambda^(r+1) (that is Lambda, the factor of q in the inter part); k_r needs "
                    "lambda^(b-1-r): the last row of the block is not decayed at all": lam**b * kv_ref + (lam ** (r + 1) * ki).T @ vi,
                    "you scaled k_r by lambda^(b-r), one power too many: the last row (r = b-1) gets lambda^0 = 1": lam**b * kv_ref + (lam ** (b - r) * ki).T @ vi,
                    "you forgot to decay the old state: it must be multiplied by lambda^b (b rows have passed)": kv_ref + (lam ** (b - 1 - r) * ki).T @ vi,
                    "you decayed the old state by lambda instead of lambda^b: a whole block of b rows has passed": lam * kv_ref + (lam ** (b - 1 - r) * ki).T @ vi,
                    "you used the block size B for the last, shorter block: its state decays by lambda^b with b its own row count": lam**block * kv_ref + (lam ** (block - 1 - r) * ki).T @ vi,
                }
                for message, candidate in wrong.items():
                    if np.all(np.isfinite(candidate)) and relative_error(got, candidate) <= 1e-10 and relative_error(candidate, ref) > 1e-10:
                        raise ExerciseError(f"{name} is wrong: {message}")
                expect_close(name, got, ref, rtol=1e-10, hint="KV_new = lambda**b * KV + (lambda**(b-1-r)[:, None] * k_i).T @ v_i")
            kv_mine, kv_ref = got, ref
    return passed(f"state update right after every block of {len(cases)} sequences (partial last blocks, lambda = 0.05 with b = 300)")


def check_blockwise_attention(blockwise_attention) -> bool:
    """``blockwise_attention(q, k, v, decay, block_size)`` must return o (n, d_v) by Algorithm 1 (any n, any B)."""
    cases = [(37, 8, 5, 3, 0.8, 70), (130, 37, 4, 6, 0.99, 71), (7, 16, 3, 3, 1.0, 72), (650, 300, 2, 3, 0.05, 73)]
    for n, block, d_k, d_v, lam, seed in cases:
        q, k, v = _one_head(n, d_k, d_v, seed)
        ref = blockwise_forward(q[None, None], k[None, None], v[None, None], lam, block)[0][0, 0]
        name = f"blockwise_attention(n = {n}, d_k = {d_k}, d_v = {d_v}, lambda = {lam}, block_size = {block})"
        got = expect_shape(name, blockwise_attention(q.copy(), k.copy(), v.copy(), lam, block), ref.shape)
        if relative_error(got, ref) <= 1e-10:
            continue
        for message, variant in (
            ("each block's rows see the carried state through lambda^r: that is eq. 9's Lambda = diag(1, ..., "
             "lambda^(B-1)), one power short for a state that ends one row before the block; use lambda^(r+1)",
             dict(inter_power=0, update_first=False)),
            ("you updated the state with block i before computing block i's inter part, so the block sees "
             "itself twice; compute O_i from the old state, then update it", dict(inter_power=1, update_first=True)),
        ):
            if lam != 1.0 or variant["update_first"]:
                wrong = _known_mistake(q, k, v, lam, block, **variant)
                if relative_error(got, wrong) <= 1e-10:
                    raise ExerciseError(f"{name} is wrong from block {1 if not variant['update_first'] else 0} on: {message}")
        rows = wrong_rows(got, ref, rtol=1e-10, axis=0)
        if rows.size and rows[0] < block:
            hint = "block 0 has no carried state, so this is the intra part: check M and the masked product"
        else:
            hint = (
                "the inter part: row r of a block sees the carried state through lambda^(r+1) (Algorithm 1's "
                "Lambda; eq. 9's lambda^r is one power short), and the state must be updated after the block's "
                "output is computed"
            )
        expect_close(name, np.where(np.isnan(got), np.inf, got), ref, rtol=1e-10, block_size=block, hint=hint)
    return passed(f"Algorithm 1 matches the package on {len(cases)} cases (n not a multiple of B, B > n, lambda = 0.05 with B = 300)")
