"""Lightning Attention-2, beyond the paper: segmented, 16-bit tensor-core kernels. (Chapters 07-08.)

Four ideas on top of :mod:`la2_literal`, each measured in chapter 07/08:

1. **Segments.** The literal kernel runs one program per (batch, head): at 32K tokens per call that is
   16 programs on a GPU of 132 SMs. Here the sequence is cut into ``num_segments`` segments. A short pre-pass
   computes each segment's local state ``sum_s lambda^(end-1-s) k_s^T v_s`` (d_k x d_v, a few KB); the main
   kernel then starts segment j from ``sum_{i<j} lambda^((j-1-i) L) S_i`` (Horner's rule over the few
   earlier segments, read from L2) and runs Algorithm 1 over its own blocks. More programs, for a price in
   bytes: the pre-pass reads K and V of every segment but the last a second time (measured in chapter 14, section 14.2).
2. **16-bit dots.** Q, K, V stay bf16/fp16 in the dots, accumulating in fp32; the state stays fp32 and is
   rounded to 16 bits only as a dot operand. Decay factors scale fp32 results, not operands, where possible.
3. **The backward is the forward in disguise.** With time reversed, dK and dV are causal decayed linear
   attention again: dv_t = k_t sum_{s>=t} lambda^(s-t) q_s^T do_s (query k, key q, value dO) and
   dk_t = v_t sum_{s>=t} lambda^(s-t) do_s^T q_s (query v, key dO, value q) share one state dKV; and
   dq_t = do_t sum_{s<=t} lambda^(t-s) v_s^T k_s is the forward with (dO, V, K). So the backward is three
   runs of the forward kernel. A fused reverse kernel for dK and dV (one shared state, fewer bytes) is kept
   as ``fused_dkdv=True``: it was slower, the fused kernel alone at its best tiles slower than the whole
   three-forward backward (chapter 14, section 14.6): seven dots per block on a 128 x 128 fp32 state leave too few registers
   for the 64-row tiles.
4. **Reuse states across passes.** The forward saves each segment's incoming state; the backward's dQ
   pass starts from them (transposed) instead of re-reading K and V, and dK reuses dV's segment states.
   It saves less than the bytes it spares predict: the passes are bound by the chain of dots inside each
   program, not by bytes (chapter 14).

Non-finite inputs stay causal (a NaN or inf reaches exactly the outputs that depend on it), in the forward,
in the three backward passes and in the fused dK/dV kernel: each kernel is a fast pass, which flags the
programs whose state ended non-finite, and an exact pass that redoes only those (``_tiles``), in a launch of
its own or, for 16-bit tiles at d <= 64, in the same program (``plan.redo_in_place``). The segment
states are dense sums, exact as they are. bfloat16 is refused in the CPU interpreter, which computes it wrongly.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import (
    aligned,
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
    head_offset,
    head_start,
    launch,
    poison,
    refuse_interpreted_bf16,
)
from .plan import (
    _capability,
    backend_tiles,
    cdiv,
    choose_segments,
    interpreted,
    pad_dim,
    prepass_tiles,
    redo_in_place,
    settings,
    short_blocks,
    sliced_plan,
    sm_count,
    takes_tma,
    value_slices,
    whole_dv_forward,
    whole_dv_plan,
)

__all__ = [
    "la2_fast_forward", "la2_fast_backward", "dq_pass", "finish_backward", "segment_states", "exact_pass",
    "in_place", "output_like", "in_layout_of",
]


@triton.jit
def _row_offsets(p, n, REVERSE: tl.constexpr):
    # Position p in processing order -> row in memory. Reverse order walks the sequence from its end.
    if REVERSE:
        return n - 1 - p
    return p


@triton.jit(do_not_specialize=["H"])
def _segment_state_kernel(
    K, V, SEG, LOG2_DECAY, n, H, seg_len, skb, skh, skn: tl.constexpr, svb, svh, svn: tl.constexpr,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, REVERSE: tl.constexpr, PRECISION: tl.constexpr, CONTIGUOUS: tl.constexpr = False,
    TAIL_FIRST: tl.constexpr = False,
):
    """Local state of one full segment: sum over its rows of lambda^(end-1-p) k_p^T v_p; with TAIL_FIRST its blocks
    are summed from the segment's end back to its start (the setting ``prepass_tail_first``, :class:`~.plan.Settings`).

    Grid (batch*heads, num_segments - 1, cdiv(d_v, BLOCK_DV)); SEG is (batch*heads, num_segments, d_k, d_v) fp32.
    K and V are (batch, heads, n, d) with any batch, head and row strides (``skb, skh, skn``; ``svb, svh, svn``);
    the row strides are compile-time constants, as the head dims they usually equal.
    """
    bh = tl.program_id(0)
    seg = tl.program_id(1)
    pid_v = tl.program_id(2)
    num_seg = tl.num_programs(1) + 1
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    K += head_offset(bh, H, n, D_K, skb, skh, CONTIGUOUS)
    V += head_offset(bh, H, n, D_V, svb, svh, CONTIGUOUS)
    SEG += head_start(bh, num_seg, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    start = seg * seg_len
    kv = _local_state(K, V, start, start + seg_len, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, skn, svn,
                      PAD_K, BLOCK_DV, BLOCK, REVERSE, PRECISION, TAIL_FIRST)
    tl.store(SEG + seg * D_K * D_V + offs_k[:, None] * D_V + offs_v[None, :], kv, mask=k_ok[:, None] & v_ok[None, :])


@triton.jit
def _local_state(K, V, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, skn: tl.constexpr,
                 svn: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
                 REVERSE: tl.constexpr, PRECISION: tl.constexpr, TAIL_FIRST: tl.constexpr = False):
    """sum over positions p in [start, end) of lambda^(end-1-p) k_p^T v_p, from zero: a segment's local state.
    [start, end) is whole blocks (segments before the last are). K and V point at one head.

    Blocks in processing order, Horner's rule (state times lambda^B, plus the block); with TAIL_FIRST from the
    last block back to the first, block i (counted from the end) weighted by lambda^(i B), a power computed
    directly and at most 1, folded into the key operand (so the dot accumulates into the state in place: scaling
    its float32 result instead cost a second 128 x 128 float32 tile at d = 128). Same sum, rounded in another
    order. The key operand then carries powers down to lambda^L: bfloat16 and float32 hold them as float32 does,
    float16 flushes them to zero sooner (:func:`segment_states` sums float16 from the start)."""
    kv = tl.zeros((PAD_K, BLOCK_DV), dtype=tl.float32)
    block_decay = tl.exp2(log2_lam * BLOCK)
    k_scale = tl.exp2(log2_lam * (BLOCK - 1 - offs_r).to(tl.float32))
    if TAIL_FIRST:
        for i in range(0, (end - start) // BLOCK):
            ks, v = _scaled_block(K, V, end - BLOCK * (i + 1), n, k_scale * tl.exp2(log2_lam * (i * BLOCK)), offs_r,
                                  offs_k, offs_v, k_ok, v_ok, skn, svn, REVERSE)
            kv = tl.dot(tl.trans(ks), v, acc=kv, input_precision=PRECISION)
    else:
        for blk in range(start, end, BLOCK):
            ks, v = _scaled_block(K, V, blk, n, k_scale, offs_r, offs_k, offs_v, k_ok, v_ok, skn, svn, REVERSE)
            kv = kv * block_decay + tl.dot(tl.trans(ks), v, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
    return kv


@triton.jit
def _scaled_block(K, V, blk, n, row_scale, offs_r, offs_k, offs_v, k_ok, v_ok, skn: tl.constexpr, svn: tl.constexpr,
                  REVERSE: tl.constexpr):
    """(k rows scaled by ``row_scale``, in k's dtype; v rows) of the block at processing position ``blk``."""
    rows = _row_offsets(blk + offs_r, n, REVERSE)
    k = tl.load(K + rows[:, None] * skn + offs_k[None, :], mask=k_ok[None, :], other=0.0)
    v = tl.load(V + rows[:, None] * svn + offs_v[None, :], mask=v_ok[None, :], other=0.0)
    return (k.to(tl.float32) * row_scale[:, None]).to(k.dtype), v


@triton.jit
def _incoming_state(S0, SEG, seg, log2_lam, seg_len, state_offs, state_ok,
                    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
                    HAS_S0: tl.constexpr, SEG_IS_INCOMING: tl.constexpr = False, SEG_T: tl.constexpr = False):
    """State at the start of segment ``seg``: lambda^(seg L) S0 + sum_{i<seg} lambda^((seg-1-i) L) S_i (Horner).
    S0 and SEG point at this head's state and segment states.

    With SEG_IS_INCOMING, SEG already holds each segment's incoming state (saved by an earlier pass). With SEG_T,
    SEG holds the states transposed, (d_v, d_k) each: another pass's states, read in place of a transposed copy.
    """
    if SEG_T:  # state_offs holds row * D_V + column; the same entry of a (d_v, d_k) state is column * D_K + row
        seg_offs = (state_offs % D_V) * D_K + state_offs // D_V
    else:
        seg_offs = state_offs
    if SEG_IS_INCOMING:
        return tl.load(SEG + seg * D_K * D_V + seg_offs, mask=state_ok, other=0.0)
    kv = tl.zeros((PAD_K, BLOCK_DV), dtype=tl.float32)
    if HAS_S0:
        kv = tl.load(S0 + state_offs, mask=state_ok, other=0.0).to(tl.float32)
    seg_decay = tl.exp2(log2_lam * seg_len.to(tl.float32))
    for i in range(0, seg):
        kv = kv * seg_decay + tl.load(SEG + i * D_K * D_V + seg_offs, mask=state_ok, other=0.0)
    return kv


@triton.jit
def _forward_sweep(Q, K, V, O, kv, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, mask, q_scale,
                   sqn: tl.constexpr, skn: tl.constexpr, svn: tl.constexpr, son: tl.constexpr,
                   D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr,
                   PRECISION: tl.constexpr, SAFE: tl.constexpr):
    """Algorithm 1 over positions [start, end) of one head from state ``kv``; returns the final state. Row r of
    Q is at ``Q + r * sqn`` (K, V, O likewise).

    SAFE: exact for non-finite K and V (a non-finite k_p or v_p reaches rows p' >= p only; see _tiles); the
    state update keeps the raw V, so it reaches every later block too.
    """
    for blk in range(start, end, BLOCK):
        p = blk + offs_r
        ok = p < end
        rows = _row_offsets(p, n, REVERSE)
        q = tl.load(Q + rows[:, None] * sqn + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        k = tl.load(K + rows[:, None] * skn + offs_k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        v = tl.load(V + rows[:, None] * svn + offs_v[None, :], mask=ok[:, None] & v_ok[None, :], other=0.0)
        b = tl.minimum(end - blk, BLOCK)
        scores = apply_decay(tl.dot(q, tl.trans(k), input_precision=PRECISION), mask, SAFE)  # (B, d_k) @ (d_k, B)
        if SAFE:
            v_safe, bad_from = finite_operand(v, offs_r, True)
            o = poison(tl.dot(scores.to(v.dtype), v_safe, input_precision=PRECISION), offs_r, bad_from, True)
        else:
            o = tl.dot(scores.to(v.dtype), v, input_precision=PRECISION)  # (B, B) @ (B, d_v)
        o += tl.dot(q, kv.to(q.dtype), input_precision=PRECISION) * q_scale[:, None]  # (B, d_k) @ (d_k, d_v)
        k_scale = tl.where(ok, tl.exp2(log2_lam * tl.maximum(b - 1 - offs_r, 0).to(tl.float32)), 0.0)
        ks = (k.to(tl.float32) * k_scale[:, None]).to(k.dtype)
        kv = kv * tl.exp2(log2_lam * b.to(tl.float32)) + tl.dot(tl.trans(ks), v, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
        tl.store(O + rows[:, None] * son + offs_v[None, :], o.to(O.dtype.element_ty), mask=ok[:, None] & v_ok[None, :])
    return kv


@triton.jit
def _forward_program(io, sizes, strides, consts, bh, seg, pid_v, SAFE: tl.constexpr):
    """One program of the forward kernel: segment ``seg`` of head ``bh``, slice ``pid_v`` of d_v; returns the
    final state. The kernel's arguments come grouped as the kernel builds them, once for its three calls: ``io``
    (the pointers), ``sizes`` (n, heads, seg_len, num_seg), ``strides`` (batch and head strides of Q, K, V, O) and
    ``consts`` (its compile-time constants: a tuple assigned as ``tl.constexpr``, since a plain assignment would
    turn its values into tensors). An exact program (SAFE) stores no states: the fast program's stand."""
    Q, K, V, O, S0, SN, SEG, INC, LOG2_DECAY = io
    n, H, seg_len, num_seg = sizes
    sqb, sqh, skb, skh, svb, svh, sob, soh = strides
    (sqn, skn, svn, son, D_K, D_V, PAD_K, BLOCK_DV, BLOCK, REVERSE, HAS_S0, STORE_SN, SEG_IS_INCOMING, STORE_INC,
     PRECISION, CONTIGUOUS, SEG_T) = consts
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    Q += head_offset(bh, H, n, D_K, sqb, sqh, CONTIGUOUS)
    K += head_offset(bh, H, n, D_K, skb, skh, CONTIGUOUS)
    V += head_offset(bh, H, n, D_V, svb, svh, CONTIGUOUS)
    O += head_offset(bh, H, n, D_V, sob, soh, CONTIGUOUS)
    S0 += head_start(bh, 1, D_K * D_V)
    SN += head_start(bh, 1, D_K * D_V)
    SEG += head_start(bh, num_seg, D_K * D_V)
    INC += head_start(bh, num_seg, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    kv = _incoming_state(S0, SEG, seg, log2_lam, seg_len, state_offs, state_ok,
                         D_K, D_V, PAD_K, BLOCK_DV, HAS_S0, SEG_IS_INCOMING, SEG_T)
    if STORE_INC:
        if not SAFE:
            tl.store(INC + seg * D_K * D_V + state_offs, kv, mask=state_ok)
    mask = decay_tile(log2_lam, offs_r, offs_r, SAFE)  # M: lambda^(r-s) on and below the diagonal
    q_scale = tl.exp2(log2_lam * (offs_r + 1).to(tl.float32))
    start = seg * seg_len
    end = tl.minimum(start + seg_len, n)
    kv = _forward_sweep(Q, K, V, O, kv, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, mask,
                        q_scale, sqn, skn, svn, son, D_K, D_V, BLOCK, REVERSE, PRECISION, SAFE)
    if STORE_SN:
        if not SAFE:
            if seg == num_seg - 1:
                tl.store(SN + state_offs, kv, mask=state_ok)
    return kv


@triton.jit(do_not_specialize=["H", "n_programs"])
def _la2_fast_forward_kernel(
    Q, K, V, O, S0, SN, SEG, INC, FLAG, LOG2_DECAY, n, H, seg_len, n_programs,
    sqb, sqh, sqn: tl.constexpr, skb, skh, skn: tl.constexpr, svb, svh, svn: tl.constexpr,
    sob, soh, son: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, REVERSE: tl.constexpr, HAS_S0: tl.constexpr, STORE_SN: tl.constexpr,
    SEG_IS_INCOMING: tl.constexpr, STORE_INC: tl.constexpr, PRECISION: tl.constexpr,
    SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16, CONTIGUOUS: tl.constexpr = False, SEG_T: tl.constexpr = False,
    REDO: tl.constexpr = False,
):
    """Algorithm 1 over one segment. Grid (batch*heads, num_segments, cdiv(d_v, BLOCK_DV)).

    Q, K, V and O are (batch, heads, n, d) with contiguous rows and any batch, head and row strides, given as
    ``sqb, sqh, sqn`` (Q) and likewise for K, V and O. The row strides are compile-time constants, as the head
    dims: d for a contiguous tensor, a multiple of it for a view of a projection, one compilation per layout.
    CONTIGUOUS (all four contiguous) computes each head's start as bh * n * d. With the start computed from the
    batch and head strides instead (the same addresses), the reversed passes of the backward ran slower.

    STORE_INC saves each segment's incoming state to INC (batch*heads, num_segments, d_k, d_v) fp32, so
    that the backward's dQ pass can start every segment without a pre-pass over K and V. SEG_T: SEG holds
    states saved by another pass, transposed (the dQ pass reads the forward's, the dK pass the dV pass's).
    Two passes (_tiles): the fast one flags programs whose final state is non-finite; the exact one (SAFE,
    grid from _tiles.exact_pass_grid) redoes them with exact tiles and stores no states. With REDO the fast
    program redoes itself when flagged (_tiles.flagged_here), and no exact pass is launched.
    """
    slices: tl.constexpr = (D_V + BLOCK_DV - 1) // BLOCK_DV
    num_seg = tl.cdiv(n, seg_len)
    io = (Q, K, V, O, S0, SN, SEG, INC, LOG2_DECAY)
    sizes = (n, H, seg_len, num_seg)
    strides = (sqb, sqh, skb, skh, svb, svh, sob, soh)
    consts: tl.constexpr = (sqn, skn, svn, son, D_K, D_V, PAD_K, BLOCK_DV, BLOCK, REVERSE, HAS_S0, STORE_SN,
                            SEG_IS_INCOMING, STORE_INC, PRECISION, CONTIGUOUS, SEG_T)
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _forward_program(io, sizes, strides, consts, i // slices // num_seg, i // slices % num_seg,
                                 i % slices, True)
    else:
        bh = tl.program_id(0)
        seg = tl.program_id(1)
        pid_v = tl.program_id(2)
        flag = FLAG + (bh * num_seg + seg) * slices + pid_v
        clear_flag(flag)
        kv = _forward_program(io, sizes, strides, consts, bh, seg, pid_v, False)
        flag_nonfinite(flag, kv)  # a non-finite K or V entry always leaves the state non-finite (0 * NaN = NaN)
        if REDO:  # the exact pass of this program, here (plan.Settings.exact_in_place); its states stand
            if flagged_here(flag):
                _forward_program(io, sizes, strides, consts, bh, seg, pid_v, True)


@triton.jit
def _dkdv_sweep(Q, K, V, DO, DK, DV, x, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, mask,
                q_scale, D_K: tl.constexpr, D_V: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
                SAFE: tl.constexpr):
    """The fused reverse sweep over positions [start, end) of one head from state ``x``; returns the final state.
    SAFE: exact for non-finite dO and Q (causal tiles in reversed time; see _tiles)."""
    for blk in range(start, end, BLOCK):
        p = blk + offs_r
        ok = p < end
        rows = n - 1 - p
        kmask = ok[:, None] & k_ok[None, :]
        vmask = ok[:, None] & v_ok[None, :]
        q = tl.load(Q + rows[:, None] * D_K + offs_k[None, :], mask=kmask, other=0.0)
        k = tl.load(K + rows[:, None] * D_K + offs_k[None, :], mask=kmask, other=0.0)
        v = tl.load(V + rows[:, None] * D_V + offs_v[None, :], mask=vmask, other=0.0)
        do = tl.load(DO + rows[:, None] * D_V + offs_v[None, :], mask=vmask, other=0.0)
        b = tl.minimum(end - blk, BLOCK)
        kq = apply_decay(tl.dot(k, tl.trans(q), input_precision=PRECISION), mask, SAFE).to(do.dtype)  # (B, d_k) @ (d_k, B)
        if SAFE:
            do_safe, bad_from = finite_operand(do, offs_r, True)
            dv = poison(tl.dot(kq, do_safe, input_precision=PRECISION), offs_r, bad_from, True)
        else:
            dv = tl.dot(kq, do, input_precision=PRECISION)  # (B, B) @ (B, d_v)
        x16 = x.to(k.dtype)
        dv += tl.dot(k, x16, input_precision=PRECISION) * q_scale[:, None]  # (B, d_k) @ (d_k, d_v)
        vdo = apply_decay(tl.dot(v, tl.trans(do), input_precision=PRECISION), mask, SAFE).to(q.dtype)  # (B, d_v) @ (d_v, B)
        if SAFE:
            q_safe, bad_from = finite_operand(q, offs_r, True)
            dk = poison(tl.dot(vdo, q_safe, input_precision=PRECISION), offs_r, bad_from, True)
        else:
            dk = tl.dot(vdo, q, input_precision=PRECISION)  # (B, B) @ (B, d_k)
        dk += tl.dot(v, tl.trans(x16), input_precision=PRECISION) * q_scale[:, None]  # (B, d_v) @ (d_v, d_k)
        k_scale = tl.where(ok, tl.exp2(log2_lam * tl.maximum(b - 1 - offs_r, 0).to(tl.float32)), 0.0)
        qs = (q.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        x = x * tl.exp2(log2_lam * b.to(tl.float32)) + tl.dot(tl.trans(qs), do, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
        tl.store(DK + rows[:, None] * D_K + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=kmask)
        tl.store(DV + rows[:, None] * D_V + offs_v[None, :], dv.to(DV.dtype.element_ty), mask=vmask)
    return x


@triton.jit
def _dkdv_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, bh, seg, num_seg,
                  D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
                  BLOCK: tl.constexpr, STORE_XN: tl.constexpr, PRECISION: tl.constexpr, SAFE: tl.constexpr):
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    Q += head_start(bh, n, D_K)
    K += head_start(bh, n, D_K)
    V += head_start(bh, n, D_V)
    DO += head_start(bh, n, D_V)
    DK += head_start(bh, n, D_K)
    DV += head_start(bh, n, D_V)
    XN += head_start(bh, 1, D_K * D_V)
    SEG += head_start(bh, num_seg, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = tl.arange(0, PAD_V)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    x = _incoming_state(XN, SEG, seg, log2_lam, seg_len, state_offs, state_ok, D_K, D_V, PAD_K, PAD_V, False)
    mask = decay_tile(log2_lam, offs_r, offs_r, SAFE)
    q_scale = tl.exp2(log2_lam * (offs_r + 1).to(tl.float32))
    start = seg * seg_len
    end = tl.minimum(start + seg_len, n)
    x = _dkdv_sweep(Q, K, V, DO, DK, DV, x, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, mask,
                    q_scale, D_K, D_V, BLOCK, PRECISION, SAFE)
    if STORE_XN:
        if seg == num_seg - 1:
            tl.store(XN + state_offs, x, mask=state_ok)
    return x


@triton.jit(do_not_specialize=["H", "n_programs"])
def _la2_fast_dkdv_kernel(
    Q, K, V, DO, DK, DV, XN, SEG, FLAG, LOG2_DECAY, n, H, seg_len, n_programs,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, PAD_V: tl.constexpr,
    BLOCK: tl.constexpr, STORE_XN: tl.constexpr, PRECISION: tl.constexpr,
    SAFE: tl.constexpr = False, SCAN: tl.constexpr = 16,
):
    """Reverse sweep of Algorithm 2 for one segment, dK and dV together. Grid (batch*heads, num_segments).

    In reversed time (p = n-1-t) with the state X = dKV = sum_{p'<=p} lambda^(p-p') q^T do:
    dV rows = [(K Q^T) * M] dO + lambda^(r+1) K X,   dK rows = [(V dO^T) * M] Q + lambda^(r+1) V X^T.
    Two passes, as the forward kernel (_tiles); the exact one with STORE_XN off.
    """
    num_seg = tl.cdiv(n, seg_len)
    if SAFE:
        first, stop = flagged_range(FLAG, n_programs, SCAN)
        for i in range(first, stop):
            if tl.load(FLAG + i) != 0:
                _dkdv_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, i // num_seg, i % num_seg,
                              num_seg, D_K, D_V, PAD_K, PAD_V, BLOCK, STORE_XN, PRECISION, True)
    else:
        bh = tl.program_id(0)
        seg = tl.program_id(1)
        flag = FLAG + bh * num_seg + seg
        clear_flag(flag)
        x = _dkdv_program(Q, K, V, DO, DK, DV, XN, SEG, LOG2_DECAY, n, H, seg_len, bh, seg, num_seg,
                          D_K, D_V, PAD_K, PAD_V, BLOCK, STORE_XN, PRECISION, False)
        flag_nonfinite(flag, x)  # a non-finite Q or dO entry always shows in the state


# ---------------------------------------------------------------------------------------------------
# Launchers. Inputs: (batch, heads, n, d) tensors, read in place when their head dim is contiguous (see
# :func:`in_place`); log2_decay float32 (heads,).


def _addressable(x) -> bool:
    # The kernels' row addressing: unit stride along the head dim, a head's rows within 32-bit offsets.
    return x.stride(-1) == 1 and (x.shape[-2] - 1) * x.stride(-2) + x.shape[-1] < 2**31


def in_place(x):
    """``x`` itself when the kernels can read it where it lies: its head dim contiguous (the last stride 1) and
    every row of a head within 32-bit offsets of the head's start, and x starts on a 16-byte boundary. Else a
    contiguous, aligned copy (:func:`~._tiles.dense`).

    A model's q, k and v are usually views of one projection, (batch, n, 3, heads, d) permuted to (batch, heads,
    n, d): copying each into (batch, heads, n, d) order, and the output back, would cost four trips through
    memory per call that the kernels avoid by taking strides. An expanded gradient (``o.sum()``'s has stride 0
    everywhere) is copied.
    """
    return x if _addressable(x) and aligned(x) else dense(x)  # a fresh allocation (output_like's) is aligned


def output_like(x):
    """A new tensor of x's shape, dtype and device for a kernel to write: laid out as :func:`torch.empty_like`
    lays out x (the same dimension order, dense) when the kernels can address that, else contiguous. The
    backend's outputs and gradients take the layout of the input they match, so the fake implementations of
    :mod:`.ops` can say which strides the real ones return."""
    import torch

    y = torch.empty_like(x)
    return y if _addressable(y) else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def in_layout_of(result, like):
    """``result``, a kernel's output laid out contiguously, in the layout :func:`output_like` gives ``like``:
    itself when that is contiguous too, else copied (for the kernels that address contiguous heads only)."""
    if like.is_contiguous():
        return result
    out = output_like(like)
    return result if out.stride() == result.stride() else out.copy_(result)


def _strides(*xs):
    """Batch, head and row strides of each (batch, heads, n, d) tensor, in order: the kernels' ``s..b, s..h, s..n``."""
    return tuple(stride for x in xs for stride in x.stride()[:3])


# --------------------------------------------------------------------------------------------------
# The fast pass through tensor descriptors (Hopper's TMA): the forward of the variant la2_tma (:mod:`.la2_tma`),
# and the backend's passes in time order where :func:`~.plan.backend_takes` says so.


@triton.jit(do_not_specialize=["H"])
def _tma_forward_kernel(
    q_desc, k_desc, v_desc, o_desc, S0, SN, SEG, INC, FLAG, LOG2_DECAY, n, H, seg_len,
    D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_SN: tl.constexpr, SEG_IS_INCOMING: tl.constexpr, STORE_INC: tl.constexpr,
    PRECISION: tl.constexpr, SEG_T: tl.constexpr,
):
    """Algorithm 1 over one segment, tiles through descriptors. Grid (batch*heads, num_segments, slices of d_v).

    The descriptors cover (batch, heads, n, d) tensors with tiles of (1, 1, BLOCK, PAD_K) for q and k and
    (1, 1, BLOCK, BLOCK_DV) for v and o. SEG holds every segment's local state (la2_fast's pre-pass), or with
    SEG_IS_INCOMING its incoming state (saved by the forward: the dQ pass), transposed with SEG_T; STORE_INC saves
    the incoming states to INC, STORE_SN the final state to SN, as la2_fast's kernel does. FLAG: one non-finite
    flag per program, in la2_fast's order, for its exact pass.
    """
    bh = tl.program_id(0)
    seg = tl.program_id(1)
    pid_v = tl.program_id(2)
    num_seg = tl.num_programs(1)
    slices: tl.constexpr = (D_V + BLOCK_DV - 1) // BLOCK_DV
    flag = FLAG + (bh * num_seg + seg) * slices + pid_v
    clear_flag(flag)
    b = bh // H
    h = bh % H
    log2_lam = tl.load(LOG2_DECAY + h)
    S0 += head_start(bh, 1, D_K * D_V)
    SN += head_start(bh, 1, D_K * D_V)
    SEG += head_start(bh, num_seg, D_K * D_V)
    INC += head_start(bh, num_seg, D_K * D_V)
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = (offs_k < D_K)[:, None] & (offs_v < D_V)[None, :]
    kv = _incoming_state(S0, SEG, seg, log2_lam, seg_len, state_offs, state_ok, D_K, D_V, PAD_K, BLOCK_DV, HAS_S0,
                         SEG_IS_INCOMING, SEG_T)
    if STORE_INC:
        tl.store(INC + seg * D_K * D_V + state_offs, kv, mask=state_ok)
    mask = decay_tile(log2_lam, offs_r, offs_r, False)
    q_scale = tl.exp2(log2_lam * (offs_r + 1).to(tl.float32))
    start = seg * seg_len
    end = tl.minimum(start + seg_len, n)
    for blk in range(start, end, BLOCK):  # rows past n load as zeros (segments before the last are whole blocks)
        q = q_desc.load([b, h, blk, 0]).reshape(BLOCK, PAD_K)
        k = k_desc.load([b, h, blk, 0]).reshape(BLOCK, PAD_K)
        v = v_desc.load([b, h, blk, pid_v * BLOCK_DV]).reshape(BLOCK, BLOCK_DV)
        size = tl.minimum(end - blk, BLOCK)
        scores = apply_decay(tl.dot(q, tl.trans(k), input_precision=PRECISION), mask, False)  # (B, d_k) @ (d_k, B)
        o = tl.dot(scores.to(v.dtype), v, input_precision=PRECISION)  # (B, B) @ (B, d_v)
        o += tl.dot(q, kv.to(q.dtype), input_precision=PRECISION) * q_scale[:, None]  # (B, d_k) @ (d_k, d_v)
        k_scale = tl.where(blk + offs_r < end, tl.exp2(log2_lam * tl.maximum(size - 1 - offs_r, 0).to(tl.float32)), 0.0)
        ks = (k.to(tl.float32) * k_scale[:, None]).to(k.dtype)
        kv = kv * tl.exp2(log2_lam * size.to(tl.float32)) + tl.dot(tl.trans(ks), v, input_precision=PRECISION)  # (d_k, B) @ (B, d_v)
        o_desc.store([b, h, blk, pid_v * BLOCK_DV], o.to(o_desc.dtype).reshape(1, 1, BLOCK, BLOCK_DV))
    if STORE_SN:
        if seg == num_seg - 1:
            tl.store(SN + state_offs, kv, mask=state_ok)
    flag_nonfinite(flag, kv)


def fast_pass_for(q, k, v, o):
    """The fast pass :func:`~.la2_fast._forward_form` takes when asked for descriptor tiles: this module's, when
    :func:`tma_ready` accepts the call's tensors; else None (la2_fast's pointer kernel)."""
    return _tma_fast_pass if tma_ready(q, k, v, o) is None else None


def tma_ready(*tensors) -> str | None:
    """Why these (batch, heads, n, d) tensors cannot be read through tensor descriptors, or None when they can:
    a GPU of compute capability 9.0 or later (or the interpreter), the last stride 1, and the base and every other
    stride a multiple of 16 bytes."""
    import torch

    for x in tensors:
        if x.is_cuda and not interpreted(x) and _capability(x.device.index) < (9, 0):
            return f"tensor descriptors need a GPU of compute capability 9.0 or later, got {torch.cuda.get_device_name(x.device)}"
        size = x.element_size()
        if x.stride(-1) != 1 or x.data_ptr() % 16 or any(s * size % 16 for s in x.stride()[:-1]):
            return (f"tensor descriptors need 16-byte aligned rows (the base and every stride but the last a multiple "
                    f"of 16 bytes, the last stride 1), got strides {tuple(x.stride())} of {size}-byte elements")
    return None


def _tma_fast_pass(grid, args, meta):
    """The fast pass through descriptors, as la2_fast's ``_forward_form`` launches it (its ``fast_pass``): ``args``
    and ``meta`` are what it hands la2_fast's kernel (tensors first, then the integers and strides; the constants).
    In time order only: a reversed pass reads its rows backwards, which a tile's coordinates cannot say."""
    if meta["REVERSE"]:
        raise ValueError("la2_tma: descriptor tiles run the passes in time order only, got REVERSE=True")
    q, k, v, o, s0, sn, seg, inc, flags, log2_decay, n, heads, seg_len = args[:13]
    names = ("D_K", "D_V", "PAD_K", "BLOCK_DV", "BLOCK", "HAS_S0", "STORE_SN", "SEG_IS_INCOMING", "STORE_INC",
             "PRECISION", "SEG_T", "num_warps", "num_stages")
    launch(_tma_forward_kernel, grid)(
        descriptor(q, meta["BLOCK"], meta["PAD_K"]), descriptor(k, meta["BLOCK"], meta["PAD_K"]),
        descriptor(v, meta["BLOCK"], meta["BLOCK_DV"]), descriptor(o, meta["BLOCK"], meta["BLOCK_DV"]), s0, sn,
        seg, inc, flags, log2_decay, n, heads, seg_len, **{name: meta[name] for name in names})


def descriptor(x, rows: int, columns: int):
    """A tensor descriptor of the (batch, heads, n, d) tensor x, its tiles (1, 1, rows, columns)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, columns])


def _forward_form(q, k, v, log2_decay, initial_state, reverse, block, block_dv, num_warps, num_stages, seg_len,
                  local_states=None, incoming=None, store_incoming=False, out=None, seg_t=False,
                  final_state=True, fast_pass=None, tma=False):
    """o_p = q_p sum_{p'<=p} lambda^(p-p') k_p'^T v_p' (+ lambda^(p+1) q_p S0) in processing order p, written into
    ``out`` when given (v's shape, from :func:`output_like`), else into ``output_like(v)``.

    Returns (o, final_state, aux) with aux = {"seg_len", "local", "incoming"}: the segment length used,
    the segments' local states (computed here, or ``local_states`` when given: a pass over the same keys
    and values in the same order) and, with ``store_incoming`` and more than one segment, every
    segment's incoming state (else None). With
    ``incoming`` given (an earlier pass's saved states, same seg_len), no pre-pass and no Horner loop run.
    ``seg_t``: the given ``local_states`` or ``incoming`` are another pass's, transposed (read in place).
    ``final_state`` False: no final state is stored, nor allocated (None in its place; the dQ pass has no use for
    one).
    ``fast_pass``: another kernel for the fast pass, on this plan (segments, pre-pass, flags; the exact pass is
    la2_fast's), launched as ``fast_pass(grid, args, meta)`` with the positional arguments and the constants
    (STORE_SN and STORE_INC among them) that la2_fast's kernel would get, in its place. la2_tma's.
    ``tma``: with no ``fast_pass`` given, la2_tma's where its descriptors can hold these tensors
    (:func:`fast_pass_for`), else la2_fast's kernel. In time order only.
    """
    import torch

    q, k, v = in_place(q), in_place(k), in_place(v)
    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    pad_k = pad_dim(d_k)
    block_dv, slices = value_slices(d_v, block_dv)
    num_seg, seg_len = choose_segments(batch * heads * slices, n, block, sm_count(q.device), seg_len,
                                       short_blocks(q.device))
    o = output_like(v) if out is None else out  # for a view of a (batch, n, heads, d) projection: that layout
    sn = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32) if final_state else None
    meta = dict(D_K=d_k, D_V=d_v, PAD_K=pad_k, BLOCK_DV=block_dv, BLOCK=block, REVERSE=reverse, PRECISION=dot_precision(q))
    seg = incoming if incoming is not None else local_states
    if seg is None:
        seg = torch.empty(batch * heads, num_seg, d_k, d_v, device=q.device, dtype=torch.float32)
        segment_states(k, v, log2_decay, seg, seg_len, block, block_dv, num_warps, num_stages, reverse)
    # With one segment the dQ pass has no pre-pass to skip (and saving would cost time for nothing).
    store_incoming = store_incoming and num_seg > 1
    # A pointer the kernel never follows (its STORE_ / HAS_ flag off) is handed some float32 tensor of this call.
    unused = sn if final_state else seg
    inc = torch.empty(batch * heads, num_seg, d_k, d_v, device=q.device, dtype=torch.float32) if store_incoming else unused
    s0 = initial_state if initial_state is not None else unused
    grid = (batch * heads, num_seg, slices)
    programs = batch * heads * num_seg * slices
    flags = torch.empty(programs, device=q.device, dtype=torch.int32)
    sn_arg = unused if sn is None else sn
    if tma and fast_pass is None and not reverse:
        fast_pass = fast_pass_for(q, k, v, o)
    args = (q, k, v, o, s0, sn_arg, seg, inc, flags, log2_decay, n, heads, seg_len, programs, *_strides(q, k, v, o))
    meta.update(HAS_S0=initial_state is not None, SEG_IS_INCOMING=incoming is not None, num_warps=num_warps,
                num_stages=num_stages, CONTIGUOUS=all(x.is_contiguous() for x in (q, k, v, o)),
                SEG_T=seg_t and (incoming is not None or local_states is not None))
    # The fast pass flags programs whose state ended non-finite; the exact pass redoes only those (_tiles), in
    # the same program (REDO) or in a launch of its own.
    redo = fast_pass is None and redo_in_place(q.dtype, pad_k, block_dv)
    if fast_pass is None:
        launch(_la2_fast_forward_kernel, grid)(*args, **meta, STORE_SN=final_state, STORE_INC=store_incoming,
                                               REDO=redo)
    else:
        fast_pass(grid, args, {**meta, "STORE_SN": final_state, "STORE_INC": store_incoming})
    if not redo:
        exact_pass(args, meta, programs, q.device)
    aux = {"seg_len": seg_len, "local": None if incoming is not None else seg, "incoming": inc if store_incoming else None}
    return o, sn, aux


def exact_pass(args, meta, programs: int, device) -> None:
    """The exact pass of a forward (_tiles): la2_fast's kernel with SAFE over the ``programs`` flags in ``args`` (its
    positional arguments, as the fast pass gets them) redoes the flagged programs. ``meta``: its constants but
    STORE_SN, STORE_INC, SAFE and SCAN, which are set here."""
    safe_grid, scan = exact_pass_grid(programs, device)
    launch(_la2_fast_forward_kernel, safe_grid)(*args, **meta, STORE_SN=False, STORE_INC=False, SAFE=True, SCAN=scan)


def la2_fast_forward(q, k, v, log2_decay, initial_state=None, block: int | None = None, block_dv: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None, seg_len: int | None = None,
                     save_states: bool = False, tma: bool | None = None):
    """Segmented forward. Returns (o, final_state fp32), or (o, final_state, saved) with ``save_states``:
    ``saved = (seg_len, incoming)`` holds every segment's incoming state for la2_fast_backward's dQ pass
    (``incoming`` is None when the sequence is one segment: then there is nothing to save). Tiles left None
    are the backend's (:func:`backend_tiles`); with none given and no states to save, a 16-bit forward on a GPU
    takes :func:`sliced_forward`'s plan where it applies, else :func:`whole_dv_forward`'s tiles where they apply,
    as the backend does. ``tma``: the main kernel's tiles loaded through tensor descriptors (:mod:`.la2_tma`, where
    the tensors allow), or not; None: as the backend does (:func:`~.plan.backend_takes`).
    bfloat16 is refused in the CPU interpreter (TypeError): its bf16 arithmetic is wrong."""
    refuse_interpreted_bf16("la2_fast_forward", q, k, v)
    backend_picks = (block, block_dv, num_warps, num_stages, seg_len) == (None,) * 5 and not save_states
    block, block_dv, num_warps, num_stages = backend_tiles(q, v, block, block_dv, num_warps, num_stages)
    plan = sliced_plan(q, v, block) if backend_picks else None
    if plan is not None:
        block_dv, num_stages, seg_len = plan
    elif backend_picks and whole_dv_forward(q, v) and tma is not False:
        tiles, _, seg_len = whole_dv_plan(q, block)
        block_dv, num_warps, num_stages = tiles["block_dv"], tiles["num_warps"], tiles["num_stages"]
    s0 = dense(initial_state.float()) if initial_state is not None else None
    o, sn, aux = _forward_form(q, k, v, log2_decay, s0, False, block, block_dv, num_warps, num_stages, seg_len,
                               store_incoming=save_states, tma=takes_tma(tma, q, v))
    return (o, sn, (aux["seg_len"], aux["incoming"])) if save_states else (o, sn)


def la2_fast_backward(q, k, v, do, log2_decay, initial_state=None, d_final_state=None, block: int | None = None,
                      block_dv: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                      seg_len: int | None = None,
                      fused_dkdv: bool = False, dkdv_block: int | None = None, dkdv_warps: int = 8,
                      dkdv_stages: int | None = None, saved=None, d_initial_state: bool = True,
                      tma: bool | None = None):
    """Segmented backward. Returns (dq, dk, dv, d_initial_state fp32); None in place of d_initial_state when
    ``d_initial_state`` is False (autograd asks for it only when an initial state requires a gradient).

    By default the backward is three runs of the forward kernel: dQ = forward(dO, V, K) from S0^T, and in
    reversed time dV = forward(K, Q, dO) and dK = forward(V, dO, Q). ``fused_dkdv=True`` runs dK and dV
    in one kernel over the shared state instead (fewer bytes, but 7 dots per block on a d_k x d_v fp32
    state; slower, see chapter 14, section 14.6); it has its own tiles (dkdv_block, dkdv_warps, dkdv_stages).

    Two passes are saved on long sequences. ``saved`` (from ``la2_fast_forward(..., save_states=True)``)
    gives dQ every segment's incoming state KV^T, so it skips its pre-pass over K and V. And the dV and dK
    passes read the same (Q, dO) in the same order: dK reuses dV's segment states, transposed.

    Tiles left None are the backend's (:func:`backend_tiles`); ``tma`` is the dQ pass's (:func:`dq_pass`).
    bfloat16 is refused in the CPU interpreter (TypeError): its bf16 arithmetic is wrong.
    """
    refuse_interpreted_bf16("la2_fast_backward", q, k, v, do)
    block, block_dv, num_warps, num_stages = backend_tiles(q, v, block, block_dv, num_warps, num_stages)

    dq = dq_pass(q, k, v, do, log2_decay, initial_state, block, block_dv, num_warps, num_stages, seg_len, saved, tma)
    if fused_dkdv:
        dk, dv, x_end = _fused_dkdv(q, k, v, do, log2_decay, block, block_dv, num_warps, num_stages, seg_len,
                                    dkdv_block, dkdv_warps, dkdv_stages)
    else:
        cfg = (block, block_dv, num_warps, num_stages)
        # state sum q^T do = dKV; each gradient laid out as its input (output_like)
        dv, x_end, aux = _forward_form(k, q, do, log2_decay, None, True, *cfg, seg_len, out=output_like(v))
        one_segment = aux["local"].shape[1] == 1  # then there are no segment states to share
        # dK's segment states are dV's, transposed: read in place (seg_t)
        dk, _, _ = _forward_form(v, do, q, log2_decay, None, True, *cfg, aux["seg_len"],
                                 local_states=None if one_segment else aux["local"], seg_t=True, out=output_like(k),
                                 final_state=False)
    return finish_backward(q, k, v, log2_decay, d_final_state, dq, dk, dv, x_end, d_initial_state)


def dq_pass(q, k, v, do, log2_decay, initial_state, block, block_dv, num_warps, num_stages, seg_len, saved,
            tma: bool | None = None):
    """dQ: the forward with (query, key, value) = (dO, V, K); its state is KV^T, starting from S0^T. With
    ``saved`` (the forward's segment states) no pre-pass over K and V runs. dQ is laid out as q (output_like).
    ``tma``: its tiles through descriptors or not, as :func:`la2_fast_forward`'s."""
    s0t = dense(initial_state.float().transpose(-1, -2)) if initial_state is not None else None
    cfg = (block, block_dv, num_warps, num_stages)
    tma = takes_tma(tma, do, k)
    if saved is not None and saved[1] is not None:  # KV at each segment start: dQ's states are KV^T (seg_t)
        return _forward_form(do, v, k, log2_decay, s0t, False, *cfg, saved[0], incoming=saved[1], seg_t=True,
                             out=output_like(q), final_state=False, tma=tma)[0]
    return _forward_form(do, v, k, log2_decay, s0t, False, *cfg, seg_len, out=output_like(q), final_state=False,
                         tma=tma)[0]


def finish_backward(q, k, v, log2_decay, d_final_state, dq, dk, dv, x_end, d_initial_state: bool = True):
    """The terms a reverse sweep leaves out: dL/dS0 from the sweep's last state ``x_end``, and what the
    final state's gradient ``d_final_state`` adds to dK, dV and dS0. Returns (dq, dk, dv, d_initial_state), the
    last None when not asked for (``d_initial_state`` False)."""
    import torch

    heads, n = q.shape[1], q.shape[2]
    # x_end = sum_t lambda^t q_t^T do_t (0-based t); dL/dS0 = sum_t lambda^(t+1) q_t^T do_t (+ lambda^n dSN).
    # Two small ops on the usual path (no final-state gradient): each costs the host as much time as the GPU
    # takes for it, and a short backward is bound by the host: skipped when dL/dS0 is not wanted.
    ds0 = None
    if d_initial_state:
        ds0 = x_end.mul_(torch.exp2(log2_decay.float()).view(1, heads, 1, 1))  # x_end: this backward's own fp32 buffer
    if d_final_state is not None:
        # The final state's gradient reaches token t through lambda^(n-1-t): a rank-d update, done in torch in
        # fp32 (the kernels' accumulation precision), one term at a time.
        t = torch.arange(n, device=q.device, dtype=torch.float32)
        w = torch.exp2(log2_decay.view(heads, 1) * (n - 1 - t)).view(1, heads, n, 1)
        dsn = d_final_state.float()
        dk = dk.float().addcmul_(w, v.float() @ dsn.transpose(-1, -2)).to(k.dtype)
        dv = dv.float().addcmul_(w, k.float() @ dsn).to(v.dtype)
        if d_initial_state:
            lam = torch.exp2(log2_decay.double()).view(1, heads, 1, 1)  # float64: lam**n magnifies its error n times
            ds0 = (ds0.double() + lam**n * dsn.double()).float()
    return dq, dk, dv, ds0


def segment_states(k, v, log2_decay, seg, seg_len, block, block_dv, num_warps, num_stages, reverse=False) -> None:
    """The segment pre-pass, on its own tiles (:func:`prepass_tiles`): into ``seg`` (batch * heads, num_segments,
    d_k, d_v), each segment's local state sum_p lambda^(end-1-p) k_p^T v_p, p in processing order (the sequence
    reversed with ``reverse``), for every segment but the last processed; nothing with one segment. k and v are
    (batch, heads, n, d) with contiguous rows, read in place. The passes of :func:`_forward_form` run it on their
    keys and values; the fused reverse sweeps (la2_fast's fused dK/dV, la3's dK/dV) on (q, dO), reversed."""
    import torch

    batch, heads, n, d_k = k.shape
    d_v, num_seg = v.shape[-1], seg.shape[1]
    if num_seg > 1:
        block, num_warps, num_stages = prepass_tiles(k.dtype, seg_len, block, num_warps, num_stages)
        launch(_segment_state_kernel, (batch * heads, num_seg - 1, cdiv(d_v, block_dv)))(
            k, v, seg, log2_decay, n, heads, seg_len, *_strides(k, v), D_K=d_k, D_V=d_v, PAD_K=pad_dim(d_k),
            BLOCK_DV=block_dv, BLOCK=block, REVERSE=reverse, PRECISION=dot_precision(k),
            CONTIGUOUS=k.is_contiguous() and v.is_contiguous(), TAIL_FIRST=settings().prepass_tail_first and k.dtype != torch.float16,
            num_warps=num_warps, num_stages=num_stages,
        )


def _fused_dkdv(q, k, v, do, log2_decay, block, block_dv, num_warps, num_stages, seg_len, dkdv_block, dkdv_warps,
                dkdv_stages):
    import torch

    like = (k, v)  # dk, dv are returned laid out as k, v (output_like), as la2_fast's other passes return them
    q, k, v, do = (dense(x) for x in (q, k, v, do))  # this kernel addresses contiguous, aligned heads (head_start)
    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    # dK, dV: one reverse sweep over the shared state dKV.
    block = dkdv_block or block
    dkdv_stages = dkdv_stages or min(num_stages, 2)  # its tile sweep (chapter 14, section 14.6) went to 2 stages, the forward's to 3
    if seg_len is not None and seg_len % block:
        seg_len = cdiv(seg_len, block) * block
    num_seg, seg_len_ = choose_segments(batch * heads, n, block, sm_count(q.device), seg_len, short_blocks(q.device))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    x_end = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    seg = torch.empty(batch * heads, num_seg, d_k, d_v, device=q.device, dtype=torch.float32)
    pad_k, pad_v = pad_dim(d_k), pad_dim(d_v)
    segment_states(q, do, log2_decay, seg, seg_len_, block, min(pad_v, block_dv or 64), num_warps, num_stages, True)
    programs = batch * heads * num_seg
    flags = torch.empty(programs, device=q.device, dtype=torch.int32)
    args = (q, k, v, do, dk, dv, x_end, seg, flags, log2_decay, n, heads, seg_len_, programs)
    meta = dict(D_K=d_k, D_V=d_v, PAD_K=pad_k, PAD_V=pad_v, BLOCK=block, PRECISION=dot_precision(q),
                num_warps=dkdv_warps, num_stages=dkdv_stages)
    # fast pass, flags as the forward
    launch(_la2_fast_dkdv_kernel, (batch * heads, num_seg))(*args, **meta, STORE_XN=True)
    safe_grid, scan = exact_pass_grid(programs, q.device)
    launch(_la2_fast_dkdv_kernel, safe_grid)(*args, **meta, STORE_XN=False, SAFE=True, SCAN=scan)
    return in_layout_of(dk, like[0]), in_layout_of(dv, like[1]), x_end
