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
from ._core import ExerciseError, exercise, expect_close, expect_shape, passed, without_overflow, wrong_rows

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


def _variant(q, k, v, lam, block, *, inter_power=1, update_first=False, k_power="b-1-r", state_power="b",
             inter=True):
    """Algorithm 1 with one classic mistake (for diagnosis only). Right: inter factor lambda^(r + 1), the state
    updated after the block's output as lambda^b KV + (diag(lambda^(b-1-r)) K_i)^T V_i."""
    out = np.empty((len(q), v.shape[1]))
    kv = np.zeros((q.shape[1], v.shape[1]))

    def update(kv, ki, vi):
        b = len(ki)
        r = np.arange(b)[:, None]
        k_scale = {"b-1-r": lam ** (b - 1 - r), "none": np.ones((b, 1)), "r+1": lam ** (r + 1), "b-r": lam ** (b - r)}[k_power]
        carried = {"b": lam**b, "1": lam, "none": 1.0}[state_power]
        return carried * kv + (k_scale * ki).T @ vi

    for start, stop in ((r.start, r.stop) for r in block_slices(len(q), block)):
        qi, ki, vi = q[start:stop], k[start:stop], v[start:stop]
        if update_first:
            kv = update(kv, ki, vi)
        r = np.arange(stop - start)[:, None]
        out[start:stop] = _ref_intra(qi, ki, vi, lam) + (inter * (lam ** (r + inter_power) * qi) @ kv)
        if not update_first:
            kv = update(kv, ki, vi)
    return out


# (variant, first block it shows in, message), most specific first
_ALGORITHM1_MISTAKES = [
    (dict(inter=False), 1, "you left out the inter part: from block 1 on, row r also sees the state carried from the "
     "blocks before it, lambda^(r+1) Q_i KV"),
    (dict(inter_power=0), 1, "each block's rows see the carried state through lambda^r: that is eq. 9's Lambda = "
     "diag(1, ..., lambda^(B-1)), one power short for a state that ends one row before the block; use lambda^(r+1)"),
    (dict(update_first=True), 0, "you updated the state with block i before computing block i's inter part, so the "
     "block sees itself twice; compute O_i from the old state, then update it"),
    (dict(k_power="none"), 1, "the state update leaves out the keys' decay (k_scale): key row r of a block is b-1-r "
     "steps before the block's end, so it enters the state as lambda^(b-1-r) k_r, not k_r (the inter factor "
     "lambda^(r+1) on the queries is right)"),
    (dict(k_power="r+1"), 1, "the state update scales key row r by lambda^(r+1), the queries' factor; keys need "
     "lambda^(b-1-r) (the last row of the block is not decayed at all)"),
    (dict(k_power="b-r"), 1, "the state update scales key row r by lambda^(b-r), one power too many: the last row "
     "(r = b-1) enters with lambda^0 = 1"),
    (dict(state_power="none"), 2, "the carried state is not decayed in the update: KV = lambda^b KV + ..., b rows "
     "have passed"),
    (dict(state_power="1"), 2, "the carried state is decayed by lambda once per block; a block of b rows is b "
     "steps: lambda^b KV"),
]


@exercise("4.1", reveals=("block_factors", "algorithm1"))
def check_intra_block(intra_block, seed: int = 0) -> None:
    """``intra_block(q_i, k_i, v_i, decay)`` must return [(Q_i K_i^T) * M] V_i for one block: shape (b, d_v)."""
    cases = [(37, 8, 5, 3, 0.8, 40), (20, 20, 4, 6, 1.0, 41), (300, 300, 3, 2, 0.05, 42)]
    for n, block, d_k, d_v, lam, case_seed in cases:
        q, k, v = _one_head(n, d_k, d_v, case_seed + seed)
        for index, (start, stop) in enumerate((r.start, r.stop) for r in block_slices(n, block)):
            qi, ki, vi = q[start:stop], k[start:stop], v[start:stop]
            ref = _ref_intra(qi, ki, vi, lam)
            name = f"intra_block on block {index} (rows {start}-{stop - 1}, lambda = {lam})"
            got = expect_shape(name, without_overflow(name, lambda: intra_block(qi.copy(), ki.copy(), vi.copy(), lam)),
                               ref.shape)
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
    passed(f"intra part right on every block of {len(cases)} sequences, lambda = 0.05 with a 300-row block included")


@exercise("4.2", reveals=("block_factors", "algorithm1"))
def check_state_update(update_state, seed: int = 0) -> None:
    """``update_state(kv, k_i, v_i, decay)`` must return lambda^b KV + (diag(lambda^(b-1-r)) K_i)^T V_i:
    the d_k x d_v state after a block of b rows, from the state before it."""
    cases = [(37, 8, 5, 3, 0.8, 60), (45, 16, 4, 4, 1.0, 61), (600, 300, 3, 2, 0.05, 62)]
    for n, block, d_k, d_v, lam, case_seed in cases:
        _, k, v = _one_head(n, d_k, d_v, case_seed + seed)
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
    passed(f"state update right after every block of {len(cases)} sequences (partial last blocks, lambda = 0.05 with b = 300)")


def _book_intra_block(q_i, k_i, v_i, decay):
    """Exercise 4.1's answer, used by the check of 4.3 in place of the reader's (4.1 is graded on its own)."""
    return _ref_intra(np.asarray(q_i, dtype=np.float64), np.asarray(k_i, dtype=np.float64),
                      np.asarray(v_i, dtype=np.float64), decay)


def _book_update_state(kv, k_i, v_i, decay):
    """Exercise 4.2's answer, used by the check of 4.3 in place of the reader's (4.2 is graded on its own)."""
    return _ref_state(np.asarray(kv, dtype=np.float64), np.asarray(k_i, dtype=np.float64),
                      np.asarray(v_i, dtype=np.float64), decay)


@exercise("4.3", reveals=("algorithm1", "blockwise_forward"),
          substitutes={"intra_block": _book_intra_block, "update_state": _book_update_state})
def check_blockwise_attention(blockwise_attention, seed: int = 0) -> None:
    """``blockwise_attention(q, k, v, decay, block_size)`` must return o (n, d_v) by Algorithm 1 (any n, any B).

    While it runs, the names ``intra_block`` and ``update_state`` of the reader's notebook (exercises 4.1 and
    4.2) hold the book's answers, so a mistake there is not counted again here.
    """
    cases = [(37, 8, 5, 3, 0.8, 70), (130, 37, 4, 6, 0.99, 71), (7, 16, 3, 3, 1.0, 72), (650, 300, 2, 3, 0.05, 73)]
    for n, block, d_k, d_v, lam, case_seed in cases:
        q, k, v = _one_head(n, d_k, d_v, case_seed + seed)
        ref = blockwise_forward(q[None, None], k[None, None], v[None, None], lam, block)[0][0, 0]
        name = f"blockwise_attention(n = {n}, d_k = {d_k}, d_v = {d_v}, lambda = {lam}, block_size = {block})"
        got = expect_shape(name, blockwise_attention(q.copy(), k.copy(), v.copy(), lam, block), ref.shape)
        if relative_error(got, ref) <= 1e-10:
            continue
        if not np.isfinite(got).all():
            expect_close(name, got, ref, rtol=1e-10, axis=0, block_size=block,
                         hint="Algorithm 1 forms only non-negative powers of lambda: lambda^(r+1), lambda^(b-1-r), lambda^b")
        for variant, first_block, message in _ALGORITHM1_MISTAKES:
            wrong = _variant(q, k, v, lam, block, **variant)
            if relative_error(wrong, ref) > 1e-10 and relative_error(got, wrong) <= 1e-10:
                raise ExerciseError(f"{name} is wrong from block {first_block} on: {message}")
        rows = wrong_rows(got, ref, rtol=1e-10, axis=0)
        if rows.size and rows[0] < block:
            hint = "block 0 has no carried state, so this is the intra part: check M and the masked product"
        else:
            hint = (
                "block 0 is right, so the intra part is; what carries information between blocks is wrong: the "
                "inter part (row r sees the carried state through lambda^(r+1); eq. 9's lambda^r is one power "
                "short) or the state update (lambda^b KV + (diag(lambda^(b-1-r)) K_i)^T V_i, done after the "
                "block's output is computed)"
            )
        expect_close(name, got, ref, rtol=1e-10, axis=0, block_size=block, hint=hint)
    passed(f"Algorithm 1 matches the package on {len(cases)} cases (n not a multiple of B, B > n, lambda = 0.05 with B = 300)")
