"""Lightning Attention-1: the tiled *left* product with the decay mask, the paper's comparison point.
(Chapters 07-08.)

Per batch and head, o = [(Q K^T) * M] V with M[t, s] = lambda^(t-s) for t >= s, else 0 -- the masked
left product of chapter 03, computed the way FlashAttention computes softmax attention, minus the softmax:
one program per (query block, batch*head) walks the key blocks up to the diagonal and accumulates

    O_i += [(Q_i K_j^T) * D_ij] V_j,    D_ij[r, s] = lambda^((i B_M + r) - (j B_N + s))  (0 above the diagonal)

in an fp32 tile on chip. Nothing of size n x n ever reaches HBM, but the work is still O(n^2 d): every
query block meets every earlier key block. That quadratic work is what Lightning Attention-2 removes.

The decay tile is ``exp2(log2(lambda) * distance)`` with a distance that is never negative (entries
above the diagonal are set to 0 by the mask, not by a negative power), so nothing overflows for any
lambda in (0, 1]; lambda = 1 gives exp2(0) = 1 exactly.

Backward, with P = (Q K^T) * D (no softmax, so no row statistics to keep):
dV = P^T dO,  dP = dO V^T,  dS = dP * D,  dQ = dS K,  dK = dS^T Q.
dQ is one program per query block looping over key blocks up to the diagonal; dK and dV are one program
per key block looping over the query blocks from the diagonal to the end of the sequence.

Precision: tiles are loaded in the input dtype (fp32, fp16 or bf16); ``tl.dot`` takes its operands in
that dtype and accumulates in fp32 (fp16/bf16 run on the tensor cores; fp32 dots are asked for in full
IEEE precision, not tf32, so that fp32 results agree with float64 to about 1e-6); the decay tile, the
masking and every accumulator are fp32. Outputs are stored in the input dtype.

The sequence length is a runtime argument, specialised only as Triton specialises integers (a multiple of 16,
1, or another: at most three compilations per configuration); head dims are compile-time
constants padded to powers of two >= 16, with masks, so d_k != d_v and d in {16, 32, 64, 128} all work.

Non-finite inputs stay causal: a NaN or inf reaches exactly the outputs that depend on it. Each kernel runs
as a fast pass (the loops above, which flags every program whose output tile came out non-finite) and an
exact pass over the flagged programs only, with masks that select instead of multiplying and a sanitised
right operand (see ``_tiles``). The CPU interpreter computes bfloat16 wrongly, so there the launchers
refuse it (``lightning_attention(..., backend="triton")`` upcasts instead).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_chunked import first_derivative_only
from ..validation import device_decay, validate_attention_args, validate_block_size, validate_decay, validate_head_dims
from ._tiles import (
    apply_decay,
    clear_flag,
    decay_tile,
    dense,
    dot_precision,
    dropped,
    exact_pass_grid,
    finite_operand,
    flag_nonfinite,
    flagged_range,
    launch,
    poison,
    refuse_interpreted_bf16,
    stored_nonfinite,
)
from .plan import cdiv, pad_dim

__all__ = [
    "la1_forward_kernel", "la1_backward_dq_kernel", "la1_backward_dkdv_kernel", "la1_forward", "la1_backward",
    "la1_attention",
]

LA1_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _decay_tile(log2_lam, rows, cols, n, SAFE: tl.constexpr):
    """D[r, s] = lambda^(rows[r] - cols[s]) where rows[r] >= cols[s] and both are inside the sequence, else
    ``dropped(SAFE)`` (0 in the fast pass, -1 in the exact pass: see _tiles.apply_decay). The causal part is
    :func:`~._tiles.decay_tile` (which never forms a negative power of lambda); the padded rows and columns of
    the sequence's last block are dropped here too."""
    inside = (rows[:, None] < n) & (cols[None, :] < n)
    return tl.where(inside, decay_tile(log2_lam, rows, cols, SAFE), dropped(SAFE))


# Each kernel below is launched twice (see _tiles): SAFE=False is the plain kernel and flags the programs whose
# fp32 accumulator ended non-finite; SAFE=True redoes the flagged programs with exact tiles.


@triton.jit
def _forward_program(Q, K, V, O, DECAY, n, heads, block_i, bh,
                     stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                     D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SAFE: tl.constexpr):
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    log2_lam = tl.log2(tl.load(DECAY + h))
    # Every pointer moves to this (batch, head) once; offsets below are within its (n, d) rows.
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh

    rows = block_i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    row_ok = rows < n
    q = tl.load(Q + rows[:, None] * stride_qn + offs_k[None, :],
                mask=row_ok[:, None] & (offs_k[None, :] < D_K), other=0.0)

    acc = tl.zeros((BLOCK_M, PAD_V), dtype=tl.float32)
    # Causality: key blocks past this query block's last row contribute nothing, so the loop stops there.
    end = tl.minimum((block_i + 1) * BLOCK_M, n)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        # K_j^T is loaded already transposed, (PAD_K, BLOCK_N), so the dot needs no register shuffle.
        kt = tl.load(K + cols[None, :] * stride_kn + offs_k[:, None],
                     mask=col_ok[None, :] & (offs_k[:, None] < D_K), other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + offs_v[None, :],
                    mask=col_ok[:, None] & (offs_v[None, :] < D_V), other=0.0)
        scores = tl.dot(q, kt, input_precision=PRECISION)  # fp32 (BLOCK_M, BLOCK_N)
        p = apply_decay(scores, _decay_tile(log2_lam, rows, cols, n, SAFE), SAFE)
        if SAFE:  # a non-finite v_s reaches rows r >= s only (P's zeros would meet it as 0 * NaN)
            v, bad_from = finite_operand(v, cols, True)
            acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            acc = poison(acc, rows, bad_from, True)
        else:
            acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)

    o_ptrs = O + rows[:, None] * stride_on + offs_v[None, :]
    o_mask = row_ok[:, None] & (offs_v[None, :] < D_V)
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=o_mask)
    bad = False
    if not SAFE:  # a non-finite K or V entry always shows in the output tile: the fast pass's flag
        bad = stored_nonfinite(o_ptrs, o_mask)
    return bad


@triton.jit(do_not_specialize=["heads", "n_programs"])
def la1_forward_kernel(
    Q, K, V, O, DECAY, FLAG,
    n, heads, n_programs,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_on,
    D_K: tl.constexpr, D_V: tl.constexpr,
    PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """One program: rows [i*BLOCK_M, (i+1)*BLOCK_M) of o for one (batch, head). Last axis contiguous.

    Fast pass (SAFE=False, grid (query blocks, batch*heads)): FLAG[bh * blocks + i] := whether the
    accumulator ended non-finite. Exact pass (SAFE=True, grid from _tiles.exact_pass_grid): each program scans
    SCAN flags and redoes the flagged programs exactly (see _tiles).
    """
    nb = tl.cdiv(n, BLOCK_M)
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _forward_program(Q, K, V, O, DECAY, n, heads, i % nb, i // nb,
                                 stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                                 D_K, D_V, PAD_K, PAD_V, BLOCK_M, BLOCK_N, PRECISION, True)
    else:
        block_i = tl.program_id(0)
        bh = tl.program_id(1)
        bad = _forward_program(Q, K, V, O, DECAY, n, heads, block_i, bh,
                               stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                               stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
                               D_K, D_V, PAD_K, PAD_V, BLOCK_M, BLOCK_N, PRECISION, False)
        tl.store(FLAG + bh * nb + block_i, bad.to(tl.int32))


@triton.jit
def _dq_program(K, V, DO, DQ, DECAY, n, heads, block_i, bh,
                stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
                D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SAFE: tl.constexpr):
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    log2_lam = tl.log2(tl.load(DECAY + h))
    # Every pointer moves to this (batch, head) once; offsets below are within its (n, d) rows.
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh

    rows = block_i * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    row_ok = rows < n
    do = tl.load(DO + rows[:, None] * stride_don + offs_v[None, :],
                 mask=row_ok[:, None] & (offs_v[None, :] < D_V), other=0.0)

    acc = tl.zeros((BLOCK_M, PAD_K), dtype=tl.float32)
    end = tl.minimum((block_i + 1) * BLOCK_M, n)
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        vt = tl.load(V + cols[None, :] * stride_vn + offs_v[:, None],
                     mask=col_ok[None, :] & (offs_v[:, None] < D_V), other=0.0)
        k = tl.load(K + cols[:, None] * stride_kn + offs_k[None, :],
                    mask=col_ok[:, None] & (offs_k[None, :] < D_K), other=0.0)
        dp = tl.dot(do, vt, input_precision=PRECISION)  # dP = dO V^T, fp32 (BLOCK_M, BLOCK_N)
        ds = apply_decay(dp, _decay_tile(log2_lam, rows, cols, n, SAFE), SAFE)
        if SAFE:  # a non-finite k_s reaches rows r >= s only
            k, bad_from = finite_operand(k, cols, True)
            acc += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
            acc = poison(acc, rows, bad_from, True)
        else:
            acc += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    dq_ptrs = DQ + rows[:, None] * stride_dqn + offs_k[None, :]
    dq_mask = row_ok[:, None] & (offs_k[None, :] < D_K)
    tl.store(dq_ptrs, acc.to(DQ.dtype.element_ty), mask=dq_mask)
    bad = False
    if not SAFE:  # a non-finite V or K entry always shows in the output tile: the fast pass's flag
        bad = stored_nonfinite(dq_ptrs, dq_mask)
    return bad


@triton.jit(do_not_specialize=["heads", "n_programs"])
def la1_backward_dq_kernel(
    K, V, DO, DQ, DECAY, FLAG,
    n, heads, n_programs,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dqb, stride_dqh, stride_dqn,
    D_K: tl.constexpr, D_V: tl.constexpr,
    PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """dQ_i = sum over key blocks j <= i of [(dO_i V_j^T) * D_ij] K_j: the forward loop with V and dO swapped in.
    Two passes, as :func:`la1_forward_kernel`."""
    nb = tl.cdiv(n, BLOCK_M)
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _dq_program(K, V, DO, DQ, DECAY, n, heads, i % nb, i // nb,
                            stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                            stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
                            D_K, D_V, PAD_K, PAD_V, BLOCK_M, BLOCK_N, PRECISION, True)
    else:
        block_i = tl.program_id(0)
        bh = tl.program_id(1)
        bad = _dq_program(K, V, DO, DQ, DECAY, n, heads, block_i, bh,
                          stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                          stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
                          D_K, D_V, PAD_K, PAD_V, BLOCK_M, BLOCK_N, PRECISION, False)
        tl.store(FLAG + bh * nb + block_i, bad.to(tl.int32))


@triton.jit
def _dkdv_program(Q, K, V, DO, DK, DV, DECAY, n, heads, block_j, bh,
                  stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                  stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, SAFE: tl.constexpr):
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    log2_lam = tl.log2(tl.load(DECAY + h))
    # Every pointer moves to this (batch, head) once; offsets below are within its (n, d) rows.
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh

    cols = block_j * BLOCK_N + tl.arange(0, BLOCK_N)  # key positions: the rows of every tile here
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    col_ok = cols < n
    k = tl.load(K + cols[:, None] * stride_kn + offs_k[None, :],
                mask=col_ok[:, None] & (offs_k[None, :] < D_K), other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + offs_v[None, :],
                mask=col_ok[:, None] & (offs_v[None, :] < D_V), other=0.0)

    acc_dk = tl.zeros((BLOCK_N, PAD_K), dtype=tl.float32)
    acc_dv = tl.zeros((BLOCK_N, PAD_V), dtype=tl.float32)
    # Causality: only queries at or after this key block see it; start at the query block holding its first row.
    first = (block_j * BLOCK_N // BLOCK_M) * BLOCK_M
    for start in range(first, n, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < n
        qt = tl.load(Q + rows[None, :] * stride_qn + offs_k[:, None],
                     mask=row_ok[None, :] & (offs_k[:, None] < D_K), other=0.0)
        dot_ = tl.load(DO + rows[None, :] * stride_don + offs_v[:, None],
                       mask=row_ok[None, :] & (offs_v[:, None] < D_V), other=0.0)
        # D^T[s, r] = lambda^(row r - key s): the same tile as the forward, transposed.
        decay_t = tl.trans(_decay_tile(log2_lam, rows, cols, n, SAFE))
        pt = apply_decay(tl.dot(k, qt, input_precision=PRECISION), decay_t, SAFE)  # P^T (BLOCK_N, BLOCK_M)
        dst = apply_decay(tl.dot(v, dot_, input_precision=PRECISION), decay_t, SAFE)  # dS^T = (V dO^T) * D^T
        if SAFE:  # key row s receives from query rows r >= s: a non-finite dO_r or Q_r reaches rows s <= r only
            dot_, bad_to_v = finite_operand(dot_, rows, False, 1)
            qt, bad_to_k = finite_operand(qt, rows, False, 1)
            acc_dv += tl.dot(pt.to(dot_.dtype), tl.trans(dot_), input_precision=PRECISION)
            acc_dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)
            acc_dv = poison(acc_dv, cols, bad_to_v, False)
            acc_dk = poison(acc_dk, cols, bad_to_k, False)
        else:
            acc_dv += tl.dot(pt.to(dot_.dtype), tl.trans(dot_), input_precision=PRECISION)
            acc_dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PRECISION)

    out_dk = acc_dk.to(DK.dtype.element_ty)
    tl.store(DK + cols[:, None] * stride_dkn + offs_k[None, :],
             out_dk, mask=col_ok[:, None] & (offs_k[None, :] < D_K))
    out_dv = acc_dv.to(DV.dtype.element_ty)
    tl.store(DV + cols[:, None] * stride_dvn + offs_v[None, :],
             out_dv, mask=col_ok[:, None] & (offs_v[None, :] < D_V))
    return out_dk, out_dv


@triton.jit(do_not_specialize=["heads", "n_programs"])
def la1_backward_dkdv_kernel(
    Q, K, V, DO, DK, DV, DECAY, FLAG,
    n, heads, n_programs,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_don,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    D_K: tl.constexpr, D_V: tl.constexpr,
    PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """One program per key block j: dV_j = sum_{i >= j} P_ij^T dO_i and dK_j = sum_{i >= j} dS_ij^T Q_i.

    Works with transposed tiles (keys as rows), so P^T and dS^T come straight out of the dots.
    Two passes, as :func:`la1_forward_kernel`.
    """
    nb = tl.cdiv(n, BLOCK_N)
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _dkdv_program(Q, K, V, DO, DK, DV, DECAY, n, heads, i % nb, i // nb,
                              stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                              stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                              D_K, D_V, PAD_K, PAD_V, BLOCK_M, BLOCK_N, PRECISION, True)
    else:
        block_j = tl.program_id(0)
        bh = tl.program_id(1)
        flag = FLAG + bh * nb + block_j
        clear_flag(flag)
        out_dk, out_dv = _dkdv_program(Q, K, V, DO, DK, DV, DECAY, n, heads, block_j, bh,
                                       stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
                                       stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_don,
                                       stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                                       D_K, D_V, PAD_K, PAD_V, BLOCK_M, BLOCK_N, PRECISION, False)
        # A non-finite Q or dO entry always shows in the output tiles. Flagged by masked stores, not by the
        # read-back of the other two kernels: here a read-back (two tiles) or a cross-warp reduction cost more of
        # this kernel's fast pass than the masked stores do.
        flag_nonfinite(flag, out_dk)
        flag_nonfinite(flag, out_dv)


def _prepare(who, q, k, v, decay, block_size, do=None):
    """Validate, make the last axis contiguous, turn lambda into a float32 (heads,) tensor on q's device."""
    # Shapes, devices, fp32/fp16/bf16, decay in (0, 1], block a power of two >= 16: all in validation.py.
    args = validate_attention_args(q, k, v, decay, backend="triton", block_size=block_size, do=do)
    refuse_interpreted_bf16(who, q, k, v, do)  # the CPU interpreter's bf16 arithmetic is wrong
    validate_head_dims(args.d_k, args.d_v, 128, "la1")  # tested up to d = 128 (tests/triton_kernels/test_triton_la1.py, cuda cases)
    # fp32 tiles are twice as wide in bytes: 32 rows keep the pipelined K/V tiles inside shared memory at d = 128.
    block = args.block_size or ((32 if q.dtype == torch.float32 else 64) if q.is_cuda else 16)
    decay_t = device_decay(args.decay, q.device, torch.float32)
    tensors = [dense(x) for x in (q, k, v) + ((do,) if do is not None else ())]
    meta = dict(
        # tl.dot wants every side >= 16 and a power of two: head dims padded, padded columns masked to 0 on load.
        D_K=args.d_k, D_V=args.d_v, PAD_K=pad_dim(args.d_k), PAD_V=pad_dim(args.d_v),
        BLOCK_M=block, BLOCK_N=block,
        # fp32 inputs get IEEE fp32 dots (tf32 would cost ~3e-4 relative error); fp16/bf16 use the tensor cores.
        PRECISION=dot_precision(q),
        # Two fp32 accumulators of (B, 128) in the dK/dV kernel need more than 4 warps' registers.
        num_warps=8 if max(args.d_k, args.d_v) >= 128 else 4,
    )
    return args, decay_t, tensors, meta


def _strides(x):
    return x.stride(0), x.stride(1), x.stride(2)


def la1_forward(q, k, v, decay=1.0, block_size: int | None = None):
    """o = [(Q K^T) * M] V by the tiled left product (Lightning Attention-1). (Chapter 07.)

    q, k: (batch, heads, n, d_k); v: (batch, heads, n, d_v), torch tensors of one dtype among float32,
    float16, bfloat16, on CUDA (or on the CPU under TRITON_INTERPRET=1, float32/float16 only: bfloat16 is
    refused with a TypeError there, as the interpreter computes it wrongly); decay: lambda in (0, 1], one float
    or one value per head. ``block_size`` (a power of two >= 16; on CUDA 64, or 32 for fp32; 16 in the
    interpreter) is both the query and the key tile. Returns o (batch, heads, n, d_v) in q's dtype.
    """
    args, decay_t, (q, k, v), meta = _prepare("la1_forward", q, k, v, decay, block_size)
    o = torch.empty((args.batch, args.heads, args.seq_len, args.d_v), dtype=q.dtype, device=q.device)
    grid = (cdiv(args.seq_len, meta["BLOCK_M"]), args.batch * args.heads)
    programs = grid[0] * grid[1]
    flags = torch.empty(programs, dtype=torch.int32, device=q.device)
    launch_args = (q, k, v, o, decay_t, flags, args.seq_len, args.heads, programs, *_strides(q), *_strides(k),
                   *_strides(v), *_strides(o))
    # The fast pass flags programs whose accumulator ended non-finite; the exact pass redoes only those (_tiles).
    launch(la1_forward_kernel, grid)(*launch_args, **meta)
    safe_grid, scan = exact_pass_grid(programs, q.device)
    launch(la1_forward_kernel, safe_grid)(*launch_args, **meta, SAFE=True, SCAN=scan)
    return o


def la1_backward(q, k, v, do, decay=1.0, block_size: int | None = None):
    """Gradients (dq, dk, dv) of L given do = dL/do for o = la1_forward(q, k, v, decay). (Chapter 08.)

    Shapes as in :func:`la1_forward`; do is (batch, heads, n, d_v). Two launches: dQ over query blocks,
    then dK and dV together over key blocks. Returns tensors in q's dtype.
    """
    args, decay_t, (q, k, v, do), meta = _prepare("la1_backward", q, k, v, decay, block_size, do=do)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    heads_total = args.batch * args.heads
    grid = (cdiv(args.seq_len, meta["BLOCK_M"]), heads_total)  # BLOCK_M = BLOCK_N: one grid for both
    programs = grid[0] * grid[1]
    flags = torch.empty(programs, dtype=torch.int32, device=q.device)
    safe_grid, scan = exact_pass_grid(programs, q.device)
    launch_args = (k, v, do, dq, decay_t, flags, args.seq_len, args.heads, programs, *_strides(k), *_strides(v),
                   *_strides(do), *_strides(dq))
    launch(la1_backward_dq_kernel, grid)(*launch_args, **meta)  # fast pass, then the flagged programs exactly (_tiles)
    launch(la1_backward_dq_kernel, safe_grid)(*launch_args, **meta, SAFE=True, SCAN=scan)
    launch_args = (q, k, v, do, dk, dv, decay_t, flags, args.seq_len, args.heads, programs, *_strides(q), *_strides(k),
                   *_strides(v), *_strides(do), *_strides(dk), *_strides(dv))
    launch(la1_backward_dkdv_kernel, grid)(*launch_args, **meta)
    launch(la1_backward_dkdv_kernel, safe_grid)(*launch_args, **meta, SAFE=True, SCAN=scan)
    return dq, dk, dv


class LA1Function(torch.autograd.Function):
    """Autograd wrapper: forward by :func:`la1_forward`, backward by :func:`la1_backward` (no state kept
    between them but q, k, v: the backward recomputes every score tile, as FlashAttention does)."""

    @staticmethod
    def forward(ctx, q, k, v, decay, block_size=None):
        o = la1_forward(q, k, v, decay, block_size)
        ctx.save_for_backward(q, k, v)
        ctx.decay = decay
        ctx.block_size = block_size
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        # a second derivative raises (the kernels have no backward of their own) instead of dropping this term
        dq, dk, dv = first_derivative_only("LA-1's Triton backward", la1_backward, q, k, v, do, ctx.decay,
                                           ctx.block_size)
        return dq, dk, dv, None, None


def la1_attention(q, k, v, decay=1.0, block_size: int | None = None):
    """Differentiable Lightning Attention-1: ``o = la1_attention(q, k, v, decay)``; ``o.backward(...)`` works.

    decay is a float or one value per head (not differentiated). Shapes and dtypes as in :func:`la1_forward`
    (bfloat16 is refused in the CPU interpreter).
    """
    refuse_interpreted_bf16("la1_attention", q, k, v)
    # A decay tensor that requires grad is refused here (no kernel computes dL/dlambda), never silently detached.
    return LA1Function.apply(q, k, v, validate_decay(decay), validate_block_size(block_size))
