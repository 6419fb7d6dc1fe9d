"""A recompute-heavy backward in the spirit of the "Lightning Attention-3" design note, with decay. (Chapter 09.)

The store-heavy way to run the intra-block part of the backward holds a whole C x C score tile (and its
gradient, and a mask) per chunk of C rows, and the tiles of Q, K, V, dO, dQ, dK, dV beside it. On a GPU with
about 100 KB of shared memory per block that does not fit at C = 64. The recompute-heavy schedule cuts each
chunk into micro-chunks of c rows and recomputes every c x c score tile where it is needed: nothing bigger
than a (c, d) tile and the d_k x d_v state is ever live.

dK and dV come out of one reverse sweep (time runs from the end of the sequence to its start, processing
position p = n - 1 - t). In that order, with X = dKV = sum_{p' < chunk} lambda^(p - p') q_p'^T do_p' the state
carried in from the chunks already processed, the rows of output micro-chunk i are

    dV_i = sum_{j <= i} [(K_i Q_j^T) * L_ij] dO_j  +  diag(lambda^(r+1)) K_i X
    dK_i = sum_{j <= i} [(V_i dO_j^T) * L_ij] Q_j  +  diag(lambda^(r+1)) V_i X^T

where r counts rows from the start of the chunk and L_ij[r', s'] = lambda^(p_r' - p_s') (on the diagonal tile
j = i only for p_r' >= p_s'). Off the diagonal the exponent (i - j) c + r' - s' is at least 1: every factor
is lambda to a non-negative power, formed directly, so nothing overflows (no lambda^-c, no lambda^-C). Only
then is X updated with the chunk's own pairs: X = lambda^b X + sum_s lambda^(b-1-s) q_s^T do_s. The chunk's
(Q, dO) tiles are read again by the update, from L2, not from HBM.

dQ is Algorithm 1 in forward time with (query, key, value) = (dO, V, K); it reuses la2_fast's dQ pass, which
starts every segment from the state the forward saved. The forward is la2_fast's.

Non-finite values stay causal, with the two-pass scheme of ``_tiles``: the fast pass flags the programs whose
state ended non-finite, the exact pass redoes them with selecting masks on the diagonal tiles (off-diagonal
tiles have no dropped entries, so their plain products are already exact). With 16-bit tiles (the backend's)
the exact pass runs in the fast kernel's own program (``plan.redo_in_place``), float32 in a launch of its own.
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
    flagged_here,
    flagged_range,
    head_start,
    launch,
    poison,
    refuse_interpreted_bf16,
)
from .la2_fast import _incoming_state, dq_pass, finish_backward, in_layout_of, segment_states
from .plan import backend_tiles, cdiv, choose_segments, la3_tiles, pad_dim, redo_in_place, short_blocks, sm_count

__all__ = ["la3_backward", "la3_dkdv"]

MAX_HEAD_DIM = 128  # the sweep holds a d_k x d_v fp32 state: 64 KB at d = 128, 256 KB (all spilled) at 256


@triton.jit
def _tile(X, p, ok, n, offs_d, d_ok, D: tl.constexpr):
    """Rows at processing positions ``p`` (reverse order: memory row n - 1 - p) of one head's (n, D) rows."""
    rows = n - 1 - p
    return tl.load(X + rows[:, None] * D + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _la3_chunk(Q, K, V, DO, DK, DV, x, blk, end, n, log2_lam, offs_c, offs_k, offs_v, k_ok, v_ok, diag,
               D_K: tl.constexpr, D_V: tl.constexpr, CHUNK: tl.constexpr, MICRO: tl.constexpr,
               PRECISION: tl.constexpr, SAFE: tl.constexpr):
    """dK and dV of one chunk (processing positions [blk, blk + CHUNK) cut at ``end``) from the state ``x``;
    returns the state after the chunk."""
    x16 = x.to(Q.dtype.element_ty)
    for i in tl.static_range(CHUNK // MICRO):
        p_i = blk + i * MICRO + offs_c
        ok_i = p_i < end
        k_i = _tile(K, p_i, ok_i, n, offs_k, k_ok, D_K)                                 # (c, d_k)
        v_i = _tile(V, p_i, ok_i, n, offs_v, v_ok, D_V)                                 # (c, d_v)
        q_scale = tl.exp2(log2_lam * (i * MICRO + offs_c + 1).to(tl.float32))[:, None]      # lambda^(r+1)
        dv = tl.dot(k_i, x16, input_precision=PRECISION) * q_scale                          # (c, d_k) @ (d_k, d_v)
        dk = tl.dot(v_i, tl.trans(x16), input_precision=PRECISION) * q_scale                # (c, d_v) @ (d_v, d_k)
        for j in tl.static_range(i):  # earlier micro-chunks: every pair is kept, exponent >= 1
            p_j = blk + j * MICRO + offs_c
            ok_j = p_j < end
            q_j = _tile(Q, p_j, ok_j, n, offs_k, k_ok, D_K)
            do_j = _tile(DO, p_j, ok_j, n, offs_v, v_ok, D_V)
            l_ij = tl.exp2(log2_lam * ((i - j) * MICRO + offs_c[:, None] - offs_c[None, :]).to(tl.float32))
            a = tl.dot(k_i, tl.trans(q_j), input_precision=PRECISION) * l_ij                # (c, c) scores
            dv += tl.dot(a.to(do_j.dtype), do_j, input_precision=PRECISION)                 # (c, c) @ (c, d_v)
            da = tl.dot(v_i, tl.trans(do_j), input_precision=PRECISION) * l_ij              # (c, c) score grads
            dk += tl.dot(da.to(q_j.dtype), q_j, input_precision=PRECISION)                  # (c, c) @ (c, d_k)
        q_i = _tile(Q, p_i, ok_i, n, offs_k, k_ok, D_K)  # the diagonal tile: causal inside
        do_i = _tile(DO, p_i, ok_i, n, offs_v, v_ok, D_V)
        a = apply_decay(tl.dot(k_i, tl.trans(q_i), input_precision=PRECISION), diag, SAFE).to(do_i.dtype)
        da = apply_decay(tl.dot(v_i, tl.trans(do_i), input_precision=PRECISION), diag, SAFE).to(q_i.dtype)
        if SAFE:
            do_safe, bad_do = finite_operand(do_i, offs_c, True)
            q_safe, bad_q = finite_operand(q_i, offs_c, True)
            dv += poison(tl.dot(a, do_safe, input_precision=PRECISION), offs_c, bad_do, True)
            dk += poison(tl.dot(da, q_safe, input_precision=PRECISION), offs_c, bad_q, True)
        else:
            dv += tl.dot(a, do_i, input_precision=PRECISION)
            dk += tl.dot(da, q_i, input_precision=PRECISION)
        rows = n - 1 - p_i
        tl.store(DK + rows[:, None] * D_K + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=ok_i[:, None] & k_ok[None, :])
        tl.store(DV + rows[:, None] * D_V + offs_v[None, :], dv.to(DV.dtype.element_ty), mask=ok_i[:, None] & v_ok[None, :])
    # Only now the state takes the chunk's own pairs (read before update), one micro-chunk at a time.
    b = tl.minimum(end - blk, CHUNK)
    x = x * tl.exp2(log2_lam * b.to(tl.float32))
    for j in tl.static_range(CHUNK // MICRO):
        p_j = blk + j * MICRO + offs_c
        ok_j = p_j < end
        q_j = _tile(Q, p_j, ok_j, n, offs_k, k_ok, D_K)
        do_j = _tile(DO, p_j, ok_j, n, offs_v, v_ok, D_V)
        k_scale = tl.where(ok_j, tl.exp2(log2_lam * tl.maximum(b - 1 - j * MICRO - offs_c, 0).to(tl.float32)), 0.0)
        qs = (q_j.to(tl.float32) * k_scale[:, None]).to(q_j.dtype)
        x += tl.dot(tl.trans(qs), do_j, input_precision=PRECISION)                      # (d_k, c) @ (c, d_v)
    return x


@triton.jit
def _la3_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, bh, seg, num_seg,
                 D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
                 CHUNK: tl.constexpr, MICRO: tl.constexpr, STORE_XN: tl.constexpr, PRECISION: tl.constexpr,
                 SAFE: tl.constexpr):
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    Q += head_start(bh, n, D_K)
    K += head_start(bh, n, D_K)
    V += head_start(bh, n, D_V)
    DO += head_start(bh, n, D_V)
    DK += head_start(bh, n, D_K)
    DV += head_start(bh, n, D_V)
    XN += head_start(bh, 1, D_K * D_V)
    SEG += head_start(bh, num_seg, D_K * D_V)
    offs_c = tl.arange(0, MICRO)
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    x = _incoming_state(XN, SEG, seg, log2_lam, seg_len, state_offs, state_ok, D_K, D_V, PAD_K, PAD_V, False)
    diag = decay_tile(log2_lam, offs_c, offs_c, SAFE)  # the causal (c, c) tile on the diagonal
    start = seg * seg_len
    end = tl.minimum(start + seg_len, n)
    for blk in range(start, end, CHUNK):
        x = _la3_chunk(Q, K, V, DO, DK, DV, x, blk, end, n, log2_lam, offs_c, offs_k, offs_v, k_ok, v_ok, diag,
                       D_K, D_V, CHUNK, MICRO, PRECISION, SAFE)
    if STORE_XN:
        if seg == num_seg - 1:
            tl.store(XN + state_offs, x, mask=state_ok)
    return x


@triton.jit(do_not_specialize=["H", "n_programs"])
def _la3_dkdv_kernel(
    Q, K, V, DO, DK, DV, XN, SEG, FLAG, LOG2_DECAY, n, H, seg_len, n_programs,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    CHUNK: tl.constexpr, MICRO: tl.constexpr, STORE_XN: tl.constexpr, PRECISION: tl.constexpr,
    SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16, REDO: tl.constexpr = False,
):
    """dK and dV of one segment in one reverse sweep over micro-chunk tiles. Grid (batch*heads, num_segments).

    Two passes (_tiles): the fast one flags programs whose state ended non-finite, the exact one (SAFE, grid
    from _tiles.exact_pass_grid, STORE_XN off) redoes only those; with REDO the fast program redoes itself
    when flagged (_tiles.flagged_here), and no exact pass is launched.
    """
    num_seg = tl.cdiv(n, seg_len)
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _la3_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, i // num_seg, i % num_seg,
                             num_seg, D_K, D_V, PAD_K, PAD_V, CHUNK, MICRO, STORE_XN, PRECISION, True)
    else:
        bh = tl.program_id(0)
        seg = tl.program_id(1)
        flag = FLAG + bh * num_seg + seg
        clear_flag(flag)
        x = _la3_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, bh, seg, num_seg,
                         D_K, D_V, PAD_K, PAD_V, CHUNK, MICRO, STORE_XN, PRECISION, False)
        flag_nonfinite(flag, x)  # a non-finite Q or dO entry always shows in the state
        if REDO:  # the exact pass of this program, here (plan.Settings.exact_in_place)
            if flagged_here(flag):
                _la3_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, bh, seg, num_seg,
                             D_K, D_V, PAD_K, PAD_V, CHUNK, MICRO, False, PRECISION, True)


# ---------------------------------------------------------------------------------------------------
# Launchers. Inputs: (batch, heads, n, d) tensors (la3_dkdv makes them contiguous; the dQ pass reads them in
# place); log2_decay float32 (heads,).


def la3_dkdv(q, k, v, do, log2_decay, chunk: int = 64, micro: int = 16, num_warps: int = 4, num_stages: int = 1,
             seg_len: int | None = None):
    """dK, dV and the reverse sweep's last state x_end = sum_t lambda^t q_t^T do_t (fp32), by the micro-chunk
    kernel. ``chunk`` is a multiple of ``micro``; both are powers of two >= 16 (tl.dot's smallest tile)."""
    import torch

    for name, value in (("chunk", chunk), ("micro", micro)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if chunk % micro:
        raise ValueError(f"chunk must be a multiple of micro, got chunk = {chunk}, micro = {micro}")
    like = (k, v)  # dk, dv are returned laid out as k, v (output_like), as la2_fast's passes return theirs
    q, k, v, do = (dense(x) for x in (q, k, v, do))  # the micro-chunk kernel addresses contiguous, aligned heads
    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    validate_head_dims(d_k, d_v, MAX_HEAD_DIM, "la3")
    pad_k, pad_v = pad_dim(d_k), pad_dim(d_v)
    if q.is_cuda and micro == 64 and (pad_k, pad_v) == (64, 32):
        # Compiled by Triton 3.6 for a GPU of compute capability 9.0, the 16-bit kernel with 64-row micro-chunks
        # at d_k = 64, d_v = 32 reads outside its tensors (an illegal memory access), while d = (64, 16), (32, 64),
        # (64, 64), (128, 64) and 16-row micro-chunks at (64, 32) run correctly: a compiler fault, so this shape
        # takes 16-row tiles.
        micro = 16
    if seg_len is not None and seg_len % chunk:
        seg_len = cdiv(seg_len, chunk) * chunk
    num_seg, seg_len = choose_segments(batch * heads, n, chunk, sm_count(q.device), seg_len, short_blocks(q.device))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    x_end = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    seg = torch.empty(batch * heads, num_seg, d_k, d_v, device=q.device, dtype=torch.float32)
    precision = dot_precision(q)
    segment_states(q, do, log2_decay, seg, seg_len, chunk, min(pad_v, 64), 4, 2, reverse=True)
    programs = batch * heads * num_seg
    flags = torch.empty(programs, device=q.device, dtype=torch.int32)
    args = (q, k, v, do, dk, dv, x_end, seg, flags, log2_decay, n, heads, seg_len, programs)
    meta = dict(D_K=d_k, D_V=d_v, PAD_K=pad_k, PAD_V=pad_v, CHUNK=chunk, MICRO=micro, PRECISION=precision,
                num_warps=num_warps, num_stages=num_stages)
    redo = redo_in_place(q.dtype, pad_k, pad_v)
    launch(_la3_dkdv_kernel, (batch * heads, num_seg))(*args, **meta, STORE_XN=True, REDO=redo)
    if not redo:
        safe_grid, scan = exact_pass_grid(programs, q.device)
        launch(_la3_dkdv_kernel, safe_grid)(*args, **meta, STORE_XN=False, SAFE=True, SCAN=scan)
    return in_layout_of(dk, like[0]), in_layout_of(dv, like[1]), x_end


def la3_backward(q, k, v, do, log2_decay, initial_state=None, d_final_state=None, block: int | None = None,
                 block_dv: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 seg_len: int | None = None,
                 saved=None, chunk: int | None = None, micro: int | None = None, dkdv_warps: int | None = None,
                 dkdv_stages: int | None = None, d_initial_state: bool = True):
    """The recompute-heavy backward. Returns (dq, dk, dv, d_initial_state fp32); the signature of
    la2_fast_backward (``d_initial_state`` False: None in its place), plus the dK/dV kernel's tiles (``chunk``,
    ``micro``, ``dkdv_warps``, ``dkdv_stages``; defaults from :func:`la3_tiles`); dQ's tiles left None are the backend's (:func:`~.plan.backend_tiles`).
    Head dims up to 128 (ValueError beyond, before anything runs).

    dQ is la2_fast's dQ pass (from the forward's saved segment states when ``saved`` is given), its d_k cut
    in slices of at most 64 columns so that it too stays within 99 KB of shared memory; dK and dV come from
    one reverse sweep over micro-chunk tiles (:func:`la3_dkdv`). bfloat16 is refused in the CPU interpreter
    (TypeError): its bf16 arithmetic is wrong.
    """
    refuse_interpreted_bf16("la3_backward", q, k, v, do)
    validate_head_dims(q.shape[-1], v.shape[-1], MAX_HEAD_DIM, "la3")
    block, block_dv, num_warps, num_stages = backend_tiles(q, v, block, block_dv, num_warps, num_stages)
    block_dv = min(block_dv or 64, 64)  # dQ's "value" is K: slices of d_k (a full 128-wide slice needs 112 KB)
    dq = dq_pass(q, k, v, do, log2_decay, initial_state, block, block_dv, num_warps, num_stages, seg_len, saved)
    tiles = la3_tiles(q.dtype, max(q.shape[-1], v.shape[-1]))
    tiles.update({key: val for key, val in (("chunk", chunk), ("micro", micro), ("num_warps", dkdv_warps),
                                              ("num_stages", dkdv_stages)) if val is not None})
    dk, dv, x_end = la3_dkdv(q, k, v, do, log2_decay, **tiles, seg_len=seg_len)
    return finish_backward(q, k, v, log2_decay, d_final_state, dq, dk, dv, x_end, d_initial_state)
