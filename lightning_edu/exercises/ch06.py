"""Checks for the exercises of chapter 06 (PyTorch: from loops to tensor ops, with a hand-written backward).

Each check draws seeded torch float64 inputs of odd shapes (blocks of 5 and 7 rows, d_k != d_v, one
lambda per head, lambda = 1 and 0.05 among them), calls the reader's function and compares it with the
package's :mod:`lightning_edu.torch_chunked`. On a mismatch it tries the usual mistakes and names the one
it finds.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import torch_chunked as tc
from ..checks import relative_error, to_numpy
from ._core import (
    ExerciseError, exercise, expect_close, expect_shape, lines_by_size, passed, refuse_low_precision, wrong_rows,
)

__all__ = ["check_inter_block_outputs", "check_state_scan", "check_inter_block_dq"]

_CASES = [  # (batch, heads, n_blocks, B, d_k, d_v), decay per head
    ((1, 3, 5, 7, 4, 6), [1.0, 0.9, 0.05]),
    ((2, 2, 1, 5, 3, 2), [0.5, 0.99]),
    ((1, 1, 9, 4, 5, 3), [0.7]),
    # 64-row blocks at lambda = 0.05: a division by a cumulative power of lambda (0.05^-320) overflows here
    ((1, 2, 5, 64, 3, 2), [0.05, 0.9]),
]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _case(i, seed=0):
    (batch, heads, n_blocks, block, d_k, d_v), decay = _CASES[i]
    gen = torch.Generator().manual_seed(600 + i + seed)
    lam = torch.tensor(decay, dtype=torch.float64)
    return gen, lam, batch, heads, n_blocks, block, d_k, d_v


def _first_bad_block(got: np.ndarray, ref: np.ndarray, axis: int = 2) -> int:
    rows = wrong_rows(got, ref, rtol=1e-9, axis=axis)
    return int(rows[0]) if rows.size else 0  # 0: the difference is below 1e-9, but the caller's 1e-10 check failed


def _call(name, fn, *args, shapes=""):
    """The reader's function on clones of the inputs; a torch shape error becomes a message about shapes."""
    try:
        out = fn(*(x.clone() for x in args))
    except RuntimeError as exc:
        raise ExerciseError(f"{name} raised RuntimeError: {str(exc)[:160]}. Shapes: {shapes}") from exc
    refuse_low_precision(name, out)
    return out


def _powers(lam, exponents):
    return lam[:, None, None] ** torch.as_tensor(exponents, dtype=torch.float64)[None, :, None]  # (heads, B, 1)


def _loop_free(name: str, fn, make_args) -> None:
    """The exercises of this chapter ask for every block at once, in tensor operations. Values cannot tell that
    from a Python loop over the blocks (or rows); the lines of Python the reader's code runs can: the same count
    for 1 block and for 16 blocks of 16 rows when the work is batched, at least one more line per block when not."""
    block = {1: 4, 16: 16}  # rows per block at each block count

    def run(n_blocks):
        return _call(name, fn, *make_args(torch.Generator().manual_seed(660 + n_blocks), n_blocks, block[n_blocks]))

    lines = lines_by_size(run, block)
    if lines[16] - lines[1] >= 15:
        raise ExerciseError(
            f"{name} gives the right values, but your code ran {lines[1]} lines of Python on 1 block and {lines[16]} on "
            "16 blocks of 16 rows: a Python loop over the blocks (or the rows). The exercise asks for all blocks at "
            "once: broadcast over the block axis, so that one batched matmul does every block"
        )


@exercise("6.1", reveals=("inter_block_outputs",))
def check_inter_block_outputs(inter_outputs, seed: int = 0) -> None:
    """``inter_outputs(qb, states, lam)`` -> O_inter of every block: diag(lambda^(r+1)) Q_i S_i, batched.

    qb: (batch, heads, n_blocks, B, d_k); states: (batch, heads, n_blocks, d_k, d_v), the state entering
    each block; lam: (heads,). Returns (batch, heads, n_blocks, B, d_v).
    """
    for i in range(len(_CASES)):
        gen, lam, batch, heads, n_blocks, block, d_k, d_v = _case(i, seed)
        qb = _randn(gen, batch, heads, n_blocks, block, d_k)
        states = _randn(gen, batch, heads, n_blocks, d_k, d_v)
        _, q_scale, _, _ = tc.block_factors(block, lam)
        ref = tc.inter_block_outputs(qb, states, q_scale[:, None])
        name = f"inter_outputs on qb {tuple(qb.shape)}, decay {lam.tolist()}"
        shapes = "qb (batch, heads, n_blocks, B, d_k) @ states (batch, heads, n_blocks, d_k, d_v); lam (heads,)"
        got = expect_shape(name, _call(name, inter_outputs, qb, states, lam, shapes=shapes), ref.shape)
        ref_np = to_numpy(ref)
        if relative_error(got, ref_np) <= 1e-10:
            continue
        rows = np.arange(block)
        if relative_error(got, to_numpy((_powers(lam, rows)[:, None] * qb) @ states)) <= 1e-10:
            raise ExerciseError(
                f"{name}: you scaled row r by lambda^r. Row r of a block is r + 1 steps after the state was taken "
                "(the state is the one at the end of the previous block), so the factor is lambda^(r+1)"
            )
        if bool((lam < 1).any()) and relative_error(got, to_numpy(qb @ states)) <= 1e-10:
            raise ExerciseError(f"{name} ignores the decay: scale row r of each block by lambda^(r+1) before multiplying by the state")
        if n_blocks > 1:
            leaving = states.roll(-1, dims=2)
            if relative_error(got[:, :, :-1], to_numpy((q_scale[:, None] * qb) @ leaving)[:, :, :-1]) <= 1e-10:
                raise ExerciseError(f"{name}: block i used the state of block i + 1. states[:, :, i] is already the state entering block i")
        block_id = _first_bad_block(got, ref_np)
        expect_close(
            name, got.reshape(batch, heads, -1, d_v), ref_np.reshape(batch, heads, -1, d_v), rtol=1e-10, block_size=block,
            hint=f"first wrong in block {block_id}. O_inter of block i is (lambda^(r+1) * Q_i) @ states[:, :, i], one batched matmul over all blocks",
        )
    _loop_free("inter_outputs", inter_outputs, lambda gen, nb, b: (_randn(gen, 1, 2, nb, b, 3), _randn(gen, 1, 2, nb, 3, 2),
                                                                  torch.tensor([0.9, 0.5], dtype=torch.float64)))
    passed(f"inter-block outputs match on {len(_CASES)} shapes (one lambda per head, 1 and 0.05 included), all blocks "
           "at once")


@exercise("6.2", reveals=("scan_states",))
def check_state_scan(state_scan, seed: int = 0) -> None:
    """``state_scan(local, block_decay, initial)`` -> the states between blocks.

    local: (batch, heads, n_blocks, d_k, d_v), the L_i; block_decay: (heads, n_blocks), lambda^(b_i);
    initial: (batch, heads, d_k, d_v). Returns (batch, heads, n_blocks + 1, d_k, d_v): S_0 = initial,
    S_(i+1) = lambda^(b_i) S_i + L_i.
    """
    for i in range(len(_CASES)):
        gen, lam, batch, heads, n_blocks, block, d_k, d_v = _case(i, seed)
        local = _randn(gen, batch, heads, n_blocks, d_k, d_v)
        # every block full except a short last one (3 rows), as chunk_factors gives it
        lengths = torch.full((n_blocks,), block, dtype=torch.float64)
        lengths[-1] = 3
        block_decay = lam[:, None] ** lengths[None, :]
        initial = _randn(gen, batch, heads, d_k, d_v)
        ref = tc.scan_states(local, block_decay, initial)
        name = f"state_scan on local {tuple(local.shape)}, decay {lam.tolist()}"
        shapes = "local (batch, heads, n_blocks, d_k, d_v), block_decay (heads, n_blocks), initial (batch, heads, d_k, d_v)"
        got_raw = _call(name, state_scan, local, block_decay, initial, shapes=shapes)
        if tuple(getattr(got_raw, "shape", ())) == (batch, heads, n_blocks, d_k, d_v):
            raise ExerciseError(
                f"{name} returned {n_blocks} states, expected {n_blocks + 1}: include S_0 = initial first, so that entry i is "
                "the state entering block i and the last entry the final state"
            )
        got = expect_shape(name, got_raw, ref.shape)
        ref_np = to_numpy(ref)
        if relative_error(got, ref_np) <= 1e-10:
            continue
        if not np.isfinite(got).all():
            bad = int(np.flatnonzero(~np.isfinite(np.moveaxis(got, 2, 0)).reshape(n_blocks + 1, -1).all(axis=1))[0])
            raise ExerciseError(f"{name}: state {bad} (the one entering block {bad}) holds NaN or inf; with finite "
                                "inputs every state is finite: S_(i+1) = block_decay[:, i] * S_i + local[:, :, i]")
        if relative_error(got[:, :, 0], to_numpy(initial)) > 1e-12:
            raise ExerciseError(f"{name}: entry 0 must be the initial state itself (the state entering block 0)")
        a = block_decay[:, :, None, None]
        wrong = [initial]
        for j in range(n_blocks):
            wrong.append(a[:, j] * (wrong[-1] + local[:, :, j]))
        if relative_error(got, to_numpy(torch.stack(wrong, dim=2))) <= 1e-10:
            raise ExerciseError(
                f"{name}: you decayed L_i too, lambda^b (S_i + L_i). L_i already carries its own decay (k_r enters with "
                "lambda^(b-1-r)); only the carried state decays: S_(i+1) = lambda^(b_i) S_i + L_i"
            )
        if relative_error(got, to_numpy(tc.scan_states(local, torch.ones_like(block_decay), initial))) <= 1e-10:
            raise ExerciseError(f"{name} ignores block_decay: multiply the carried state by block_decay[:, i] (shape (heads,)) at each step")
        if n_blocks > 1:
            full = lam[:, None] ** torch.full((n_blocks,), float(block), dtype=torch.float64)[None, :]
            if relative_error(got, to_numpy(tc.scan_states(local, full, initial))) <= 1e-10:
                raise ExerciseError(
                    f"{name}: the last state is off: use block_decay[:, i] for each block, not lambda^B; the last block is shorter"
                )
        bad = _first_bad_block(got, ref_np)
        raise ExerciseError(
            f"{name}: state {bad} (the one entering block {bad}) differs first; max |difference| "
            f"{float(np.max(np.abs(got - ref_np))):.2g}. Check S_(i+1) = block_decay[:, i] * S_i + local[:, :, i], with "
            "block_decay broadcast as [:, i, None, None]"
        )
    passed(f"state scan matches on {len(_CASES)} shapes, a short last block and one lambda per head included")


@exercise("6.3", reveals=("_backward",))
def check_inter_block_dq(inter_dq, seed: int = 0) -> None:
    """``inter_dq(dob, states, lam)`` -> the inter-block part of dQ for every block: diag(lambda^(r+1)) dO_i S_i^T.

    dob: (batch, heads, n_blocks, B, d_v); states: (batch, heads, n_blocks, d_k, d_v), the state entering
    each block; lam: (heads,). Returns (batch, heads, n_blocks, B, d_k).
    """
    for i in range(len(_CASES)):
        gen, lam, batch, heads, n_blocks, block, d_k, d_v = _case(i, seed)
        dob = _randn(gen, batch, heads, n_blocks, block, d_v)
        states = _randn(gen, batch, heads, n_blocks, d_k, d_v)
        q_scale = _powers(lam, np.arange(block) + 1)[:, None]
        ref = q_scale * (dob @ states.transpose(-1, -2))
        name = f"inter_dq on dob {tuple(dob.shape)}, decay {lam.tolist()}"
        shapes = "dO_i is (B, d_v) and S_i is (d_k, d_v), so dO_i S_i^T is (B, d_k): transpose the last two axes of states"
        got_raw = _call(name, inter_dq, dob, states, lam, shapes=shapes)
        got = expect_shape(name, got_raw, ref.shape)
        if relative_error(got, to_numpy(ref)) <= 1e-10:
            continue
        if relative_error(got, to_numpy(_powers(lam, np.arange(block))[:, None] * (dob @ states.transpose(-1, -2)))) <= 1e-10:
            raise ExerciseError(f"{name}: you scaled row r by lambda^r; the forward used lambda^(r+1), and its gradient carries the same factor")
        if bool((lam < 1).any()) and relative_error(got, to_numpy(dob @ states.transpose(-1, -2))) <= 1e-10:
            raise ExerciseError(f"{name} ignores the decay: O_inter = diag(lambda^(r+1)) Q_i S_i, so dQ_i gets diag(lambda^(r+1)) dO_i S_i^T")
        expect_close(
            name, got.reshape(batch, heads, -1, d_k), to_numpy(ref).reshape(batch, heads, -1, d_k), rtol=1e-10, block_size=block,
            hint="dQ_inter of block i is lambda^(r+1) * (dO_i @ S_i^T), one batched matmul over all blocks",
        )
    _loop_free("inter_dq", inter_dq, lambda gen, nb, b: (_randn(gen, 1, 2, nb, b, 2), _randn(gen, 1, 2, nb, 3, 2),
                                                         torch.tensor([0.9, 0.5], dtype=torch.float64)))
    passed(f"inter-block dQ matches on {len(_CASES)} shapes (one lambda per head), all blocks at once")
