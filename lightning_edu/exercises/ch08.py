"""Checks for the exercises of chapter 08 (the backward kernel in Triton).

:func:`check_reverse_sweep_kernel` launches the reader's ``@triton.jit`` reverse sweep of Algorithm 2
(in the CPU interpreter without CUDA) on seeded random fp32 inputs with partial last blocks and per-head
decay, and compares dK, dV and the state gradient dKV_0 with ``numpy_blockwise.blockwise_backward``
(float64). Failure messages name the tensor, the block and the rows, and say which part to look at.
"""

from __future__ import annotations

import numpy as np

from ..checks import random_qkv
from ..numpy_blockwise import blockwise_backward
from ._core import ExerciseError, exercise, expect_shape, passed, wrong_rows
from .ch05 import _sweep
from .ch07 import _device, _launch_error, tolerance

__all__ = ["check_reverse_sweep_kernel", "check_la1_dq_kernel"]

_SHAPES = [  # (batch, heads, n, d_k, d_v, decays)
    (1, 2, 53, 16, 32, [0.9, 0.5]),
    (2, 1, 40, 32, 16, [0.99]),
    (1, 1, 16, 16, 16, [0.7]),
]


def _first_wrong_block_from_the_end(got: np.ndarray, ref: np.ndarray, block: int, rtol: float):
    """The block the reverse sweep reaches first among the wrong ones (the highest index), or None."""
    rows = wrong_rows(got, ref, rtol=rtol, axis=2)
    return None if rows.size == 0 else int(rows[-1]) // block


def _known_sweep_mistake(got, inputs, decay, block, rtol) -> str | None:
    """The message for a reverse sweep that matches a classic mistake (in float64 numpy), else None."""
    q, k, v, do = inputs
    lam = np.asarray(decay, dtype=np.float64)
    variants = (
        (dict(forward=True), "the sweep walks the blocks from the first to the last. dK_i and dV_i need the queries "
         "AFTER block i, so the reverse sweep starts at the last block, start = (num_blocks - 1 - i) * BLOCK, and "
         "carries dKV towards the first"),
        (dict(read_after_update=True), "use dKV before you update it: you added this block's own Q_i^T dO_i to dKV "
         "before reading it, so the pairs inside the block are counted twice (and the acausal ones too): compute the "
         "inter terms of dK_i and dV_i first, then update dKV"),
    )
    for options, message in variants:
        dk, dv, dkv0 = _sweep(q, k, v, do, lam, block, **options)
        same = all(not wrong_rows(got[name], ref, rtol=rtol, axis=2).size for name, ref in (("dk", dk), ("dv", dv)))
        if same:
            return message
    return None


@exercise("8.1", reveals=("la2_literal_dkdv_kernel",), kernel=True)
def check_reverse_sweep_kernel(reverse_kernel, block: int = 16, seed: int = 0) -> None:
    """``reverse_kernel[(batch * heads,)](Q, K, V, DO, DK, DV, DKV_OUT, LOG2_DECAY, n, H, D_K=, D_V=, BLOCK=16)``
    must compute dK, dV of Algorithm 2's reverse sweep for contiguous fp32 (batch, heads, n, d) tensors and
    store the final dKV (the gradient of the initial state, (batch, heads, d_k, d_v)) into DKV_OUT."""
    import torch

    dev = _device()
    rtol = tolerance()
    for i, (batch, heads, n, d_k, d_v, decay) in enumerate(_SHAPES):
        q, k, v = random_qkv(batch, heads, n, d_k, d_v, seed=80 + i + seed)
        do = np.random.default_rng(90 + i + seed).standard_normal(v.shape)
        _, dk_ref, dv_ref, dkv_ref = blockwise_backward(q, k, v, do, decay, block_size=block)
        t = [torch.tensor(x, dtype=torch.float32, device=dev) for x in (q, k, v, do)]
        dk = torch.full((batch, heads, n, d_k), float("nan"), dtype=torch.float32, device=dev)
        dv = torch.full((batch, heads, n, d_v), float("nan"), dtype=torch.float32, device=dev)
        dkv = torch.full((batch, heads, d_k, d_v), float("nan"), dtype=torch.float32, device=dev)
        log2_decay = torch.tensor(np.log2(decay), dtype=torch.float32, device=dev)
        try:
            reverse_kernel[(batch * heads,)](*t, dk, dv, dkv, log2_decay, n, heads, D_K=d_k, D_V=d_v, BLOCK=block)
        except Exception as exc:
            raise _launch_error("reverse_kernel", exc) from exc
        case = f"(batch {batch}, heads {heads}, n {n}, d_k {d_k}, d_v {d_v}, lambda {decay})"
        got = {name: expect_shape(name, x, ref.shape) for name, x, ref in (("dk", dk, dk_ref), ("dv", dv, dv_ref), ("dKV_0", dkv, dkv_ref))}
        state_ok = bool(np.allclose(got["dKV_0"], dkv_ref, rtol=0, atol=rtol * np.abs(dkv_ref).max()))
        last = (n - 1) // block
        for name, ref in (("dk", dk_ref), ("dv", dv_ref)):
            blk = _first_wrong_block_from_the_end(got[name], ref, block, rtol)
            if blk is None:
                continue
            rows = f"rows {blk * block}-{min(n, blk * block + block) - 1}"
            other = "v" if name == "dk" else "k"
            mistake = _known_sweep_mistake(got, (q, k, v, do), decay, block, rtol)
            if mistake:
                hint = mistake
            elif not np.isfinite(got[name]).all():
                hint = ("it holds NaN or inf: every row of the block must be stored, and every decay factor is lambda "
                        "to a non-negative power (clamp the exponent at 0 on padded rows)")
            elif blk == last:
                hint = ("the sweep visits this block first, with dKV = 0 (no token comes after the last block), so only "
                        "the intra part (given) may contribute to it: start the sweep at the last block with dKV = 0")
            elif not state_ok:
                hint = ("did you use the reverse-sweep state? After each block, dKV = lambda^b dKV + "
                        "(diag(lambda^(r+1)) Q_i)^T dO_i, with b the block's valid rows (the gradient of the initial "
                        "state differs too)")
            else:
                hint = (f"the reverse-sweep state is right, so the inter term is off: {name}_i += "
                        f"diag(lambda^(b-1-r)) {'V_i dKV^T' if name == 'dk' else 'K_i dKV'} (the same k-side scale as "
                        f"the forward state update, applied to {other})")
            raise ExerciseError(f"{name} differs in block {blk}, {rows} (the sweep runs from block {last} down to 0) "
                                f"for {case}: {hint}")
        if not state_ok:
            raise ExerciseError(
                f"dk and dv are right but DKV_OUT differs for {case}: store dKV after the update of block 0 "
                "(it is dL/dKV_0, the gradient of the initial state)"
            )
    partial = sum(shape[2] % block != 0 for shape in _SHAPES)
    passed(f"reverse_kernel matches Algorithm 2 (numpy, float64) on {len(_SHAPES)} shapes ({partial} with a partial "
           "last block): dK, dV and dKV_0, per-head decay")


_LA1_SHAPES = [  # (batch, heads, n, d_k, d_v, decays)
    # lambda = 1e-3: a mask that multiplies (or a negative power selected away) meets 1e-3^-15, inf in fp32
    (1, 3, 45, 16, 32, [0.9, 0.5, 1e-3]),
    (2, 1, 33, 32, 16, [1.0]),
]


@exercise("8.2", reveals=("la1_backward_dq_kernel",), kernel=True)
def check_la1_dq_kernel(dq_kernel, block: int = 16, seed: int = 0) -> None:
    """``dq_kernel[(cdiv(n, 16), batch * heads)](K, V, DO, DQ, LOG2_DECAY, n, H, D_K=, D_V=, BLOCK=16)`` must
    compute LA-1's dQ_i = sum over key blocks j <= i of [(dO_i V_j^T) * D_ij] K_j for contiguous fp32
    (batch, heads, n, d) tensors, one program per (query block, batch * head)."""
    import torch

    dev = _device()
    rtol = tolerance()
    for i, (batch, heads, n, d_k, d_v, decay) in enumerate(_LA1_SHAPES):
        q, k, v = random_qkv(batch, heads, n, d_k, d_v, seed=60 + i + seed)
        do = np.random.default_rng(65 + i + seed).standard_normal(v.shape)
        dq_ref = blockwise_backward(q, k, v, do, decay, block_size=block)[0]
        t = [torch.tensor(x, dtype=torch.float32, device=dev) for x in (k, v, do)]
        dq = torch.full((batch, heads, n, d_k), float("nan"), dtype=torch.float32, device=dev)
        log2_decay = torch.tensor(np.log2(decay), dtype=torch.float32, device=dev)
        grid = (-(-n // block), batch * heads)
        try:
            dq_kernel[grid](*t, dq, log2_decay, n, heads, D_K=d_k, D_V=d_v, BLOCK=block)
        except Exception as exc:
            raise _launch_error("dq_kernel", exc) from exc
        got = expect_shape("dq", dq, dq_ref.shape)
        rows = wrong_rows(got, dq_ref, rtol=rtol, axis=2)
        if rows.size == 0:
            continue
        blk = int(rows[0]) // block
        case = f"(batch {batch}, heads {heads}, n {n}, d_k {d_k}, d_v {d_v}, lambda {decay})"
        where = f"dq differs first in query block {blk}, rows {blk * block}-{min(n, blk * block + block) - 1}, for {case}"
        if np.isnan(got).any():
            hint = "some rows are NaN: store every valid row of the program's block, and mask loads past n with other=0"
        elif blk == 0:
            hint = ("query block 0 sees only key block 0: the loop must include the diagonal tile j = i, with the "
                    "entries above the diagonal (key after query) set to 0")
        else:
            hint = ("block 0 is right, so the diagonal tile is; the off-diagonal tiles are not: "
                    "D_ij[r, s] = lambda^((i B + r) - (j B + s)) counts the distance in absolute positions, and the "
                    "loop runs over every key block j = 0 .. i")
        raise ExerciseError(f"{where}: {hint}")
    passed(f"dq_kernel matches LA-1's dQ (numpy Algorithm 2, float64) on {len(_LA1_SHAPES)} shapes with partial "
                  "last blocks and per-head decay")
