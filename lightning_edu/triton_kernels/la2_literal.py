"""Lightning Attention-2, literally: Algorithms 1 and 2 of the paper as Triton kernels. (Chapters 07-08.)

One program per (batch x head [, slice of d_v or d_k]) walks the sequence block by block, keeping the
d_k x d_v state KV in fp32 registers: nothing but Q, K, V, O (and dO, dQ, dK, dV) ever touches HBM.
Loads are upcast to fp32 right after ``tl.load`` so the kernels also run in Triton's CPU interpreter.

Row r = 0 .. b-1 of a block of b valid rows uses the factors (0-based; see numpy_blockwise):
``M[r, s] = lambda^(r-s)``, ``q_scale = lambda^(r+1)``, ``k_scale = lambda^(b-1-r)``, ``lambda^b``; each is
``exp2(log2(lambda) * non-negative power)``, so lambda^-B is never formed.

Non-finite inputs stay causal (a NaN or inf reaches exactly the outputs that depend on it): every kernel is
a fast pass, which flags the programs whose state ended non-finite, and an exact pass that redoes only those
(``_tiles``). bfloat16 is refused in the CPU interpreter, which computes it wrongly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..validation import validate_head_dims
from ._tiles import (
    apply_decay,
    clear_flag,
    decay_tile,
    dense,
    dot_precision,
    exact_pass_grid,
    finite_operand,
    flag_nonfinite,
    flagged_range,
    head_start,
    launch,
    poison,
    refuse_interpreted_bf16,
)
from .plan import cdiv, pad_dim

__all__ = [
    "la2_literal_forward_kernel", "la2_literal_dq_kernel", "la2_literal_dkdv_kernel",
    "la2_literal_forward", "la2_literal_backward",
]


@triton.jit
def _decay_factors(log2_lam, offs_r, b, BLOCK: tl.constexpr, SAFE: tl.constexpr):
    """M (BLOCK x BLOCK: lambda^(r-s) for r >= s, ``dropped(SAFE)`` above the diagonal), lambda^(r+1),
    lambda^(b-1-r) (0 on padded rows) and lambda^b for b valid rows. Score tiles: ``apply_decay(dot, M, SAFE)``."""
    mask = decay_tile(log2_lam, offs_r, offs_r, SAFE)
    q_scale = tl.exp2(log2_lam * (offs_r + 1).to(tl.float32))
    k_scale = tl.where(offs_r < b, tl.exp2(log2_lam * tl.maximum(b - 1 - offs_r, 0).to(tl.float32)), 0.0)
    block_decay = tl.exp2(log2_lam * b.to(tl.float32))
    return mask, q_scale, k_scale, block_decay


# Every kernel below is launched twice (see _tiles): SAFE=False runs the plain algorithm and flags the programs
# whose state ended non-finite; SAFE=True redoes the flagged programs with exact tiles (launched with its state
# output off: the fast pass computed the state exactly).


@triton.jit
def _forward_program(Q, K, V, O, S0, SN, LOG2_DECAY, n, H, bh, pid_v,
                     D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_S0: tl.constexpr, STORE_SN: tl.constexpr, PRECISION: tl.constexpr,
                     SAFE: tl.constexpr):
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    Q += head_start(bh, n, D_K)
    K += head_start(bh, n, D_K)
    V += head_start(bh, n, D_V)
    O += head_start(bh, n, D_V)
    S0 += head_start(bh, 1, D_K * D_V)
    SN += head_start(bh, 1, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    # KV lives on chip, in fp32, for the whole sequence (Algorithm 1: "KV = 0" before the loop).
    kv = tl.zeros((PAD_K, BLOCK_DV), dtype=tl.float32)
    if HAS_S0:
        kv = tl.load(S0 + state_offs, mask=state_ok, other=0.0).to(tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + offs_r
        row_ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        # Load Q_i, K_i, V_i from HBM to on-chip SRAM.
        q = tl.load(Q + rows[:, None] * D_K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        k = tl.load(K + rows[:, None] * D_K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * D_V + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        mask, q_scale, k_scale, block_decay = _decay_factors(log2_lam, offs_r, b, BLOCK, SAFE)
        # O_intra = [(Q_i K_i^T) * M] V_i
        scores = apply_decay(tl.dot(q, tl.trans(k), input_precision=PRECISION), mask, SAFE)  # (B, d_k) @ (d_k, B)
        if SAFE:  # a non-finite v_s reaches rows r >= s only; the state update below keeps the raw V_i
            v_safe, bad_from = finite_operand(v, offs_r, True)
            o = poison(tl.dot(scores, v_safe, input_precision=PRECISION), offs_r, bad_from, True)
        else:
            o = tl.dot(scores, v, input_precision=PRECISION)  # (B, B) @ (B, d_v)
        # O_inter = Lambda Q_i KV,  Lambda = diag(lambda^1 .. lambda^B)
        o += tl.dot(q * q_scale[:, None], kv, input_precision=PRECISION)  # (B, d_k) @ (d_k, d_v)
        # KV = lambda^B KV + (lambda^B Lambda^-1 K_i)^T V_i, with lambda^B Lambda^-1 = diag(lambda^(b-1-r)) formed directly
        kv = kv * block_decay + tl.dot(tl.trans(k * k_scale[:, None]), v, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
        # Write O_i = O_intra + O_inter to HBM.
        tl.store(O + rows[:, None] * D_V + offs_v[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    if STORE_SN:
        tl.store(SN + state_offs, kv, mask=state_ok)
    return kv


@triton.jit(do_not_specialize=["H", "n_programs"])
def la2_literal_forward_kernel(
    Q, K, V, O, S0, SN, FLAG, LOG2_DECAY, n, H, n_programs,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, HAS_S0: tl.constexpr, STORE_SN: tl.constexpr, PRECISION: tl.constexpr,
    SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """Algorithm 1. Grid: (batch*heads, cdiv(d_v, BLOCK_DV)). Q, K: (bh, n, D_K); V, O: (bh, n, D_V).
    Exact pass (SAFE): grid from _tiles.exact_pass_grid, STORE_SN off."""
    slices: tl.constexpr = (D_V + BLOCK_DV - 1) // BLOCK_DV
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _forward_program(Q, K, V, O, S0, SN, LOG2_DECAY, n, H, i // slices, i % slices, D_K, D_V, PAD_K,
                                 BLOCK_DV, BLOCK, HAS_S0, STORE_SN, PRECISION, True)
    else:
        bh = tl.program_id(0)
        pid_v = tl.program_id(1)
        flag = FLAG + bh * slices + pid_v
        clear_flag(flag)
        kv = _forward_program(Q, K, V, O, S0, SN, LOG2_DECAY, n, H, bh, pid_v, D_K, D_V, PAD_K, BLOCK_DV, BLOCK,
                              HAS_S0, STORE_SN, PRECISION, False)
        flag_nonfinite(flag, kv)  # a non-finite K or V entry always shows in the state


@triton.jit
def _dq_program(K, V, DO, DQ, S0, LOG2_DECAY, n, H, bh, pid_k,
                D_K: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, PAD_V: tl.constexpr,
                BLOCK: tl.constexpr, HAS_S0: tl.constexpr, PRECISION: tl.constexpr, SAFE: tl.constexpr):
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    K += head_start(bh, n, D_K)
    V += head_start(bh, n, D_V)
    DO += head_start(bh, n, D_V)
    DQ += head_start(bh, n, D_K)
    S0 += head_start(bh, 1, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK_DK + tl.arange(0, BLOCK_DK)
    offs_v = tl.arange(0, PAD_V)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    kv = tl.zeros((BLOCK_DK, PAD_V), dtype=tl.float32)
    if HAS_S0:
        kv = tl.load(S0 + offs_k[:, None] * D_V + offs_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + offs_r
        row_ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        k = tl.load(K + rows[:, None] * D_K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * D_V + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        do = tl.load(DO + rows[:, None] * D_V + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        mask, q_scale, k_scale, block_decay = _decay_factors(log2_lam, offs_r, b, BLOCK, SAFE)
        scores = apply_decay(tl.dot(do, tl.trans(v), input_precision=PRECISION), mask, SAFE)  # (dO_i V_i^T) * M: (B, d_v) @ (d_v, B)
        if SAFE:
            k_safe, bad_from = finite_operand(k, offs_r, True)
            dq = poison(tl.dot(scores, k_safe, input_precision=PRECISION), offs_r, bad_from, True)
        else:
            dq = tl.dot(scores, k, input_precision=PRECISION)  # (B, B) @ (B, d_k)
        dq += tl.dot(do * q_scale[:, None], tl.trans(kv), input_precision=PRECISION)  # Lambda dO_i KV^T: (B, d_v) @ (d_v, d_k)
        kv = kv * block_decay + tl.dot(tl.trans(k * k_scale[:, None]), v, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
        tl.store(DQ + rows[:, None] * D_K + offs_k[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & k_ok[None, :])
    return kv


@triton.jit(do_not_specialize=["H", "n_programs"])
def la2_literal_dq_kernel(
    K, V, DO, DQ, S0, FLAG, LOG2_DECAY, n, H, n_programs,
    D_K: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK: tl.constexpr, HAS_S0: tl.constexpr, PRECISION: tl.constexpr,
    SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """Algorithm 2, first loop (forward sweep). Grid: (batch*heads, cdiv(d_k, BLOCK_DK)).

    dQ_i = [(dO_i V_i^T) * M] K_i + Lambda dO_i KV^T, then the forward state update of KV.
    This program owns columns ``BLOCK_DK`` of dQ, so it keeps the matching rows of KV.
    """
    slices: tl.constexpr = (D_K + BLOCK_DK - 1) // BLOCK_DK
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _dq_program(K, V, DO, DQ, S0, LOG2_DECAY, n, H, i // slices, i % slices, D_K, D_V, BLOCK_DK, PAD_V,
                            BLOCK, HAS_S0, PRECISION, True)
    else:
        bh = tl.program_id(0)
        pid_k = tl.program_id(1)
        flag = FLAG + bh * slices + pid_k
        clear_flag(flag)
        kv = _dq_program(K, V, DO, DQ, S0, LOG2_DECAY, n, H, bh, pid_k, D_K, D_V, BLOCK_DK, PAD_V, BLOCK, HAS_S0,
                         PRECISION, False)
        flag_nonfinite(flag, kv)  # a non-finite K or V entry always shows in the state


@triton.jit
def _dkdv_program(Q, K, V, DO, DK, DV, DSN, DS0, LOG2_DECAY, n, H, bh,
                  D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
                  BLOCK: tl.constexpr, HAS_DSN: tl.constexpr, STORE_DS0: tl.constexpr, PRECISION: tl.constexpr,
                  SAFE: tl.constexpr):
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    Q += head_start(bh, n, D_K)
    K += head_start(bh, n, D_K)
    V += head_start(bh, n, D_V)
    DO += head_start(bh, n, D_V)
    DK += head_start(bh, n, D_K)
    DV += head_start(bh, n, D_V)
    DSN += head_start(bh, 1, D_K * D_V)
    DS0 += head_start(bh, 1, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    dkv = tl.zeros((PAD_K, PAD_V), dtype=tl.float32)
    if HAS_DSN:
        dkv = tl.load(DSN + state_offs, mask=state_ok, other=0.0).to(tl.float32)
    num_blocks = tl.cdiv(n, BLOCK)
    for i in range(0, num_blocks):
        start = (num_blocks - 1 - i) * BLOCK
        rows = start + offs_r
        row_ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        kmask = row_ok[:, None] & k_ok[None, :]
        vmask = row_ok[:, None] & v_ok[None, :]
        q = tl.load(Q + rows[:, None] * D_K + offs_k[None, :], mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(K + rows[:, None] * D_K + offs_k[None, :], mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(V + rows[:, None] * D_V + offs_v[None, :], mask=vmask, other=0.0).to(tl.float32)
        do = tl.load(DO + rows[:, None] * D_V + offs_v[None, :], mask=vmask, other=0.0).to(tl.float32)
        mask, q_scale, k_scale, block_decay = _decay_factors(log2_lam, offs_r, b, BLOCK, SAFE)
        # With SAFE: key row s receives from rows r >= s, so a non-finite q_r or do_r reaches rows s <= r only.
        dov = apply_decay(tl.dot(do, tl.trans(v), input_precision=PRECISION), mask, SAFE)  # (B, d_v) @ (d_v, B)
        if SAFE:
            q_safe, bad_to = finite_operand(q, offs_r, False)
            dk = poison(tl.dot(tl.trans(dov), q_safe, input_precision=PRECISION), offs_r, bad_to, False)
        else:
            dk = tl.dot(tl.trans(dov), q, input_precision=PRECISION)  # (B, B) @ (B, d_k)
        dk += tl.dot(v * k_scale[:, None], tl.trans(dkv), input_precision=PRECISION)  # (B, d_v) @ (d_v, d_k)
        qk = apply_decay(tl.dot(q, tl.trans(k), input_precision=PRECISION), mask, SAFE)  # (B, d_k) @ (d_k, B)
        if SAFE:
            do_safe, bad_to = finite_operand(do, offs_r, False)
            dv = poison(tl.dot(tl.trans(qk), do_safe, input_precision=PRECISION), offs_r, bad_to, False)
        else:
            dv = tl.dot(tl.trans(qk), do, input_precision=PRECISION)  # (B, B) @ (B, d_v)
        dv += tl.dot(k * k_scale[:, None], dkv, input_precision=PRECISION)  # (B, d_k) @ (d_k, d_v)
        dkv = dkv * block_decay + tl.dot(tl.trans(q * q_scale[:, None]), do, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
        tl.store(DK + rows[:, None] * D_K + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=kmask)
        tl.store(DV + rows[:, None] * D_V + offs_v[None, :], dv.to(DV.dtype.element_ty), mask=vmask)
    if STORE_DS0:
        tl.store(DS0 + state_offs, dkv, mask=state_ok)
    return dkv


@triton.jit(do_not_specialize=["H", "n_programs"])
def la2_literal_dkdv_kernel(
    Q, K, V, DO, DK, DV, DSN, DS0, FLAG, LOG2_DECAY, n, H, n_programs,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK: tl.constexpr, HAS_DSN: tl.constexpr, STORE_DS0: tl.constexpr, PRECISION: tl.constexpr,
    SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """Algorithm 2, second loop (reverse sweep). Grid: (batch*heads,).

    From the last block to the first:
    dK_i = [(dO_i V_i^T) * M]^T Q_i + (lambda^B Lambda^-1 V_i) dKV^T
    dV_i = [(Q_i K_i^T) * M]^T dO_i + (lambda^B Lambda^-1 K_i) dKV      (this block's dO_i: eq. 19 prints dO_{t})
    dKV  = lambda^B dKV + (Lambda Q_i)^T dO_i
    """
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _dkdv_program(Q, K, V, DO, DK, DV, DSN, DS0, LOG2_DECAY, n, H, i, D_K, D_V, PAD_K, PAD_V, BLOCK,
                              HAS_DSN, STORE_DS0, PRECISION, True)
    else:
        bh = tl.program_id(0)
        flag = FLAG + bh
        clear_flag(flag)
        dkv = _dkdv_program(Q, K, V, DO, DK, DV, DSN, DS0, LOG2_DECAY, n, H, bh, D_K, D_V, PAD_K, PAD_V, BLOCK,
                            HAS_DSN, STORE_DS0, PRECISION, False)
        flag_nonfinite(flag, dkv)  # a non-finite Q or dO entry always shows in dKV


# ---------------------------------------------------------------------------------------------------
# Thin launchers: allocate, pick tiles, launch. Inputs are (batch, heads, n, d) tensors, made contiguous here,
# and ``log2_decay`` a float32 tensor (heads,) on the same device; checks happened in validation.py.



def _block_cap(*dims: int) -> int:
    # Everything is upcast to fp32 on chip, so wide heads need short blocks to fit in shared memory
    # (64 x 128 fp32 tiles did not fit in an SM's): 64 rows up to d = 64, 32 at d = 128 (the largest allowed).
    return 32 if max(pad_dim(d) for d in dims) >= 128 else 64



def la2_literal_forward(q, k, v, log2_decay, initial_state=None, block: int = 64):
    """Run Algorithm 1. Returns (o, final_state fp32). ``block`` is capped by the head dims (see _block_cap).
    bfloat16 is refused in the CPU interpreter (TypeError): its bf16 arithmetic is wrong."""
    import torch

    refuse_interpreted_bf16("la2_literal_forward", q, k, v)
    q, k, v = (x.contiguous() for x in (q, k, v))  # the kernels address contiguous heads (head_start)

    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    validate_head_dims(d_k, d_v, 128, "la2_literal")
    block = min(block, _block_cap(d_k, d_v))
    o = torch.empty_like(v)
    sn = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    block_dv = min(pad_dim(d_v), 64)
    grid = (batch * heads, cdiv(d_v, block_dv))
    s0 = dense(initial_state.float()) if initial_state is not None else sn
    programs = grid[0] * grid[1]
    flags = torch.empty(programs, device=q.device, dtype=torch.int32)
    args = (q, k, v, o, s0, sn, flags, log2_decay, n, heads, programs)
    meta = dict(D_K=d_k, D_V=d_v, PAD_K=pad_dim(d_k), BLOCK_DV=block_dv, BLOCK=block,
                HAS_S0=initial_state is not None, PRECISION=dot_precision(q))
    # The fast pass flags programs whose state ended non-finite; the exact pass redoes only those (_tiles).
    launch(la2_literal_forward_kernel, grid)(*args, **meta, STORE_SN=True)
    safe_grid, scan = exact_pass_grid(programs, q.device)
    launch(la2_literal_forward_kernel, safe_grid)(*args, **meta, STORE_SN=False, SAFE=True, SCAN=scan)
    return o, sn


def la2_literal_backward(q, k, v, do, log2_decay, initial_state=None, d_final_state=None, block: int = 64):
    """Run Algorithm 2. Returns (dq, dk, dv, d_initial_state fp32). ``block`` is capped as in the forward.
    bfloat16 is refused in the CPU interpreter (TypeError): its bf16 arithmetic is wrong."""
    import torch

    refuse_interpreted_bf16("la2_literal_backward", q, k, v, do)
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))  # the kernels address contiguous heads (head_start)

    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    # The reverse sweep keeps the whole d_k x d_v fp32 state on chip: 256 KiB at d = 256, more than an SM's
    # shared memory (the compile failure is recorded in notebooks/data/gpu_tests_h200.json, under earlier_runs).
    validate_head_dims(d_k, d_v, 128, "la2_literal")
    block = min(block, _block_cap(d_k, d_v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ds0 = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    block_dk = min(pad_dim(d_k), 64)
    s0 = dense(initial_state.float()) if initial_state is not None else ds0
    grid = (batch * heads, cdiv(d_k, block_dk))
    programs = grid[0] * grid[1]
    flags = torch.empty(programs, device=q.device, dtype=torch.int32)  # also serves dK/dV: batch*heads <= programs
    args = (k, v, do, dq, s0, flags, log2_decay, n, heads, programs)
    meta = dict(D_K=d_k, D_V=d_v, BLOCK_DK=block_dk, PAD_V=pad_dim(d_v), BLOCK=block,
                HAS_S0=initial_state is not None, PRECISION=dot_precision(q))
    launch(la2_literal_dq_kernel, grid)(*args, **meta)  # fast pass, then the flagged programs exactly (_tiles)
    safe_grid, scan = exact_pass_grid(programs, q.device)
    launch(la2_literal_dq_kernel, safe_grid)(*args, **meta, SAFE=True, SCAN=scan)
    dsn = dense(d_final_state.float()) if d_final_state is not None else ds0
    args = (q, k, v, do, dk, dv, dsn, ds0, flags, log2_decay, n, heads, batch * heads)
    meta = dict(D_K=d_k, D_V=d_v, PAD_K=pad_dim(d_k), PAD_V=pad_dim(d_v), BLOCK=block,
                HAS_DSN=d_final_state is not None, PRECISION=dot_precision(q), num_warps=8)
    launch(la2_literal_dkdv_kernel, (batch * heads,))(*args, **meta, STORE_DS0=True)
    safe_grid, scan = exact_pass_grid(batch * heads, q.device)
    launch(la2_literal_dkdv_kernel, safe_grid)(*args, **meta, STORE_DS0=False, SAFE=True, SCAN=scan)
    return dq, dk, dv, ds0
