"""Lightning Attention-2, literally: Algorithms 1 and 2 of the paper as Triton kernels. (Chapters 07-08.)

One program per (batch x head [, slice of d_v or d_k]) walks the sequence block by block, keeping the
d_k x d_v state KV in fp32 registers: nothing but Q, K, V, O (and dO, dQ, dK, dV) ever touches HBM.
Loads are upcast to fp32 right after ``tl.load`` so the kernels also run in Triton's CPU interpreter.

Row r = 0 .. b-1 of a block of b valid rows uses the factors (0-based; see numpy_blockwise):
``M[r, s] = lambda^(r-s)``, ``q_scale = lambda^(r+1)``, ``k_scale = lambda^(b-1-r)``, ``lambda^b``; each is
``exp2(log2(lambda) * non-negative power)``, so lambda^-B is never formed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..validation import validate_head_dims
from ._tiles import dot_precision, pad_dim

__all__ = [
    "la2_literal_forward_kernel", "la2_literal_dq_kernel", "la2_literal_dkdv_kernel",
    "la2_literal_forward", "la2_literal_backward",
]


@triton.jit
def _decay_factors(log2_lam, offs_r, b, BLOCK: tl.constexpr):
    """M (BLOCK x BLOCK), lambda^(r+1), lambda^(b-1-r) (0 on padded rows) and lambda^b for b valid rows."""
    gap = offs_r[:, None] - offs_r[None, :]
    mask = tl.where(gap >= 0, tl.exp2(log2_lam * tl.maximum(gap, 0).to(tl.float32)), 0.0)
    q_scale = tl.exp2(log2_lam * (offs_r + 1).to(tl.float32))
    k_scale = tl.where(offs_r < b, tl.exp2(log2_lam * tl.maximum(b - 1 - offs_r, 0).to(tl.float32)), 0.0)
    block_decay = tl.exp2(log2_lam * b.to(tl.float32))
    return mask, q_scale, k_scale, block_decay


@triton.jit
def la2_literal_forward_kernel(
    Q, K, V, O, S0, SN, LOG2_DECAY, n, H,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, HAS_S0: tl.constexpr, STORE_SN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Algorithm 1. Grid: (batch*heads, cdiv(d_v, BLOCK_DV)). Q, K: (bh, n, D_K); V, O: (bh, n, D_V)."""
    bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_ptrs = bh * D_K * D_V + offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    # KV lives on chip, in fp32, for the whole sequence (Algorithm 1: "KV = 0" before the loop).
    kv = tl.zeros((PAD_K, BLOCK_DV), dtype=tl.float32)
    if HAS_S0:
        kv = tl.load(S0 + state_ptrs, mask=state_ok, other=0.0).to(tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + offs_r
        row_ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        # Load Q_i, K_i, V_i from HBM to on-chip SRAM.
        q = tl.load(Q + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        k = tl.load(K + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        mask, q_scale, k_scale, block_decay = _decay_factors(log2_lam, offs_r, b, BLOCK)
        # O_intra = [(Q_i K_i^T) * M] V_i
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * mask
        o = tl.dot(scores, v, input_precision=PRECISION)
        # O_inter = Lambda Q_i KV,  Lambda = diag(lambda^1 .. lambda^B)
        o += tl.dot(q * q_scale[:, None], kv, input_precision=PRECISION)
        # KV = lambda^B KV + (lambda^B Lambda^-1 K_i)^T V_i, with lambda^B Lambda^-1 = diag(lambda^(b-1-r)) formed directly
        kv = kv * block_decay + tl.dot(tl.trans(k * k_scale[:, None]), v, input_precision=PRECISION)
        # Write O_i = O_intra + O_inter to HBM.
        tl.store(O + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], o.to(O.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])
    if STORE_SN:
        tl.store(SN + state_ptrs, kv, mask=state_ok)


@triton.jit
def la2_literal_dq_kernel(
    K, V, DO, DQ, S0, LOG2_DECAY, n, H,
    D_K: tl.constexpr, D_V: tl.constexpr, BLOCK_DK: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK: tl.constexpr, HAS_S0: tl.constexpr, PRECISION: tl.constexpr,
):
    """Algorithm 2, first loop (forward sweep). Grid: (batch*heads, cdiv(d_k, BLOCK_DK)).

    dQ_i = [(dO_i V_i^T) * M] K_i + Lambda dO_i KV^T, then the forward state update of KV.
    This program owns columns ``BLOCK_DK`` of dQ, so it keeps the matching rows of KV.
    """
    bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    offs_r = tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK_DK + tl.arange(0, BLOCK_DK)
    offs_v = tl.arange(0, PAD_V)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    kv = tl.zeros((BLOCK_DK, PAD_V), dtype=tl.float32)
    if HAS_S0:
        kv = tl.load(S0 + bh * D_K * D_V + offs_k[:, None] * D_V + offs_v[None, :], mask=k_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    for start in range(0, n, BLOCK):
        rows = start + offs_r
        row_ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        k = tl.load(K + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        v = tl.load(V + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        do = tl.load(DO + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], mask=row_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        mask, q_scale, k_scale, block_decay = _decay_factors(log2_lam, offs_r, b, BLOCK)
        scores = tl.dot(do, tl.trans(v), input_precision=PRECISION) * mask  # (dO_i V_i^T) * M
        dq = tl.dot(scores, k, input_precision=PRECISION)
        dq += tl.dot(do * q_scale[:, None], tl.trans(kv), input_precision=PRECISION)  # Lambda dO_i KV^T
        kv = kv * block_decay + tl.dot(tl.trans(k * k_scale[:, None]), v, input_precision=PRECISION)
        tl.store(DQ + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & k_ok[None, :])


@triton.jit
def la2_literal_dkdv_kernel(
    Q, K, V, DO, DK, DV, DSN, DS0, LOG2_DECAY, n, H,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK: tl.constexpr, HAS_DSN: tl.constexpr, STORE_DS0: tl.constexpr, PRECISION: tl.constexpr,
):
    """Algorithm 2, second loop (reverse sweep). Grid: (batch*heads,).

    From the last block to the first:
    dK_i = [(dO_i V_i^T) * M]^T Q_i + (lambda^B Lambda^-1 V_i) dKV^T
    dV_i = [(Q_i K_i^T) * M]^T dO_i + (lambda^B Lambda^-1 K_i) dKV      (this block's dO_i: eq. 19 prints dO_{t})
    dKV  = lambda^B dKV + (Lambda Q_i)^T dO_i
    """
    bh = tl.program_id(0)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_ptrs = bh * D_K * D_V + offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    dkv = tl.zeros((PAD_K, PAD_V), dtype=tl.float32)
    if HAS_DSN:
        dkv = tl.load(DSN + state_ptrs, mask=state_ok, other=0.0).to(tl.float32)
    num_blocks = tl.cdiv(n, BLOCK)
    for i in range(0, num_blocks):
        start = (num_blocks - 1 - i) * BLOCK
        rows = start + offs_r
        row_ok = rows < n
        b = tl.minimum(n - start, BLOCK)
        kmask = row_ok[:, None] & k_ok[None, :]
        vmask = row_ok[:, None] & v_ok[None, :]
        q = tl.load(Q + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(K + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(V + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], mask=vmask, other=0.0).to(tl.float32)
        do = tl.load(DO + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], mask=vmask, other=0.0).to(tl.float32)
        mask, q_scale, k_scale, block_decay = _decay_factors(log2_lam, offs_r, b, BLOCK)
        dov = tl.dot(do, tl.trans(v), input_precision=PRECISION) * mask
        dk = tl.dot(tl.trans(dov), q, input_precision=PRECISION)
        dk += tl.dot(v * k_scale[:, None], tl.trans(dkv), input_precision=PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * mask
        dv = tl.dot(tl.trans(qk), do, input_precision=PRECISION)
        dv += tl.dot(k * k_scale[:, None], dkv, input_precision=PRECISION)
        dkv = dkv * block_decay + tl.dot(tl.trans(q * q_scale[:, None]), do, input_precision=PRECISION)
        tl.store(DK + bh * n * D_K + rows[:, None] * D_K + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=kmask)
        tl.store(DV + bh * n * D_V + rows[:, None] * D_V + offs_v[None, :], dv.to(DV.dtype.element_ty), mask=vmask)
    if STORE_DS0:
        tl.store(DS0 + state_ptrs, dkv, mask=state_ok)


# ---------------------------------------------------------------------------------------------------
# Thin launchers: allocate, pick tiles, launch. Inputs are contiguous (batch, heads, n, d) tensors and
# ``log2_decay`` a float32 tensor (heads,) on the same device; checks happened in validation.py.



def _block_cap(*dims: int) -> int:
    # Everything is upcast to fp32 on chip, so wide heads need short blocks to fit in shared memory
    # (an H200 refused 64 x 128 fp32 tiles): 64 rows up to d = 64, 32 at d = 128 (the largest allowed).
    return 32 if max(pad_dim(d) for d in dims) >= 128 else 64



def la2_literal_forward(q, k, v, log2_decay, initial_state=None, block: int = 64):
    """Run Algorithm 1. Returns (o, final_state fp32). ``block`` is capped by the head dims (see _block_cap)."""
    import torch

    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    validate_head_dims(d_k, d_v, 128, "la2_literal")
    block = min(block, _block_cap(d_k, d_v))
    o = torch.empty_like(v)
    sn = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    block_dv = min(pad_dim(d_v), 64)
    grid = (batch * heads, triton.cdiv(d_v, block_dv))
    s0 = initial_state.float().contiguous() if initial_state is not None else sn
    la2_literal_forward_kernel[grid](
        q, k, v, o, s0, sn, log2_decay, n, heads,
        D_K=d_k, D_V=d_v, PAD_K=pad_dim(d_k), BLOCK_DV=block_dv, BLOCK=block,
        HAS_S0=initial_state is not None, STORE_SN=True, PRECISION=dot_precision(q),
    )
    return o, sn


def la2_literal_backward(q, k, v, do, log2_decay, initial_state=None, d_final_state=None, block: int = 64):
    """Run Algorithm 2. Returns (dq, dk, dv, d_initial_state fp32). ``block`` is capped as in the forward."""
    import torch

    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    # The reverse sweep keeps the whole d_k x d_v fp32 state on chip: 256 KiB at d = 256, more than an
    # H200 SM's 227 KiB of shared memory (its compiler asked for 360448 bytes: notebooks/data/gpu_tests_h200.json).
    validate_head_dims(d_k, d_v, 128, "la2_literal")
    block = min(block, _block_cap(d_k, d_v))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ds0 = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    block_dk = min(pad_dim(d_k), 64)
    s0 = initial_state.float().contiguous() if initial_state is not None else ds0
    la2_literal_dq_kernel[(batch * heads, triton.cdiv(d_k, block_dk))](
        k, v, do, dq, s0, log2_decay, n, heads,
        D_K=d_k, D_V=d_v, BLOCK_DK=block_dk, PAD_V=pad_dim(d_v), BLOCK=block,
        HAS_S0=initial_state is not None, PRECISION=dot_precision(q),
    )
    dsn = d_final_state.float().contiguous() if d_final_state is not None else ds0
    la2_literal_dkdv_kernel[(batch * heads,)](
        q, k, v, do, dk, dv, dsn, ds0, log2_decay, n, heads,
        D_K=d_k, D_V=d_v, PAD_K=pad_dim(d_k), PAD_V=pad_dim(d_v), BLOCK=block,
        HAS_DSN=d_final_state is not None, STORE_DS0=True, PRECISION=dot_precision(q), num_warps=8,
    )
    return dq, dk, dv, ds0
