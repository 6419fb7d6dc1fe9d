"""One pass instead of two: the forward with a chained scan or a decoupled look-back. (Chapter 14.)

The backend's forward (:mod:`la2_fast`) reads K and V twice on a long sequence: a pre-pass computes every
segment's local state, then the main kernel starts each segment from the states before it. This module
tries the other way, one kernel, in which the segments hand their states to each other while they run:

1. Each program takes a **ticket** (an atomic counter) and works on the segment the ticket names, in ticket
   order: segment s of every (batch, head, d_v slice) before segment s + 1 of any. A program waits only on
   programs with earlier tickets, which have all started, so the waiting always ends (the order in which
   the GPU starts programs is not promised; the order of tickets is).
2. The program reads its segment's K and V once to form the local state ``A_s`` (as the pre-pass does).
3. It obtains its incoming state ``S_s`` (the state after segment s - 1) and publishes the next one,
   ``S_{s+1} = lambda^L S_s + A_s``: a store, a barrier, then a flag set with release semantics; a reader
   loads the flag with acquire semantics before it loads the state.

   * **Chained scan** (``lookback=False``): wait for segment s - 1 to publish ``S_s``. One hop per segment,
     in series along the whole sequence.
   * **Decoupled look-back** (``lookback=True``, after Merrill and Garland's single-pass prefix scan): publish
     ``A_s`` first, then walk back: add ``lambda^(jL) A_{s-1-j}`` while a predecessor has only its local state
     published, and stop at the first one that has published its outgoing state. A program waits only for its
     predecessors' local states, which they all compute at once, never for a chain of hand-offs.
4. It sweeps its blocks from ``S_s`` (Algorithm 1), reading K and V a second time. If the segment is short
   enough, they are still in L2 from step 2: K and V come from DRAM once.

It does not pay: it was slower than the two passes at every shape measured (chapter 14,
``python -m benchmarks.lookback``, notebooks/data/lookback_h100.json). The price is in states: each
segment writes one or two d_k x d_v float32 states (64 KB at d = 128) and reads one or more, which costs as
many bytes as L2 saves for segments up to 2d rows (4d with the look-back), while the segment must be short for
its K and V to stay in L2 between the two reads.

Non-finite inputs stay causal, as in every kernel of the package: the program flags a final state that ended
non-finite, and la2_fast's exact pass redoes the flagged segments from the incoming states this kernel
leaves behind. bfloat16 is refused in the CPU interpreter, which computes it wrongly. The interpreter runs
programs one at a time, in order: there every wait ends at once and the look-back never walks past one
segment. The waits and the walk are exercised by the GPU cases of ``tests/triton_kernels/test_triton_lookback.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tiles import (
    clear_flag,
    decay_tile,
    dense,
    dot_precision,
    flag_nonfinite,
    head_offset,
    head_start,
    launch,
    refuse_interpreted_bf16,
)
from .la2_fast import _forward_sweep, _local_state, _strides, exact_pass, in_place, output_like
from .plan import backend_tiles, cdiv, pad_dim, value_slices

__all__ = ["lookback_forward"]

LOCAL = tl.constexpr(1)
"""A segment's flag once its local state A_s is published (look-back only)."""
OUTGOING = tl.constexpr(2)
"""A segment's flag once the state after it, S_{s+1}, is published."""


@triton.jit
def _await_flag(flag, at_least):
    """The flag at ``flag`` once it is at least ``at_least``, loaded with acquire semantics (so the states
    published before it are visible to every thread of this program after it)."""
    f = tl.atomic_add(flag, 0, sem="acquire")  # compiled to a load with acquire semantics
    while f < at_least:
        f = tl.atomic_add(flag, 0, sem="acquire")
    return f


@triton.jit
def _publish(STATES, index, state, state_offs, state_ok, flag, value, D_K: tl.constexpr, D_V: tl.constexpr):
    """Store ``state`` as entry ``index`` of STATES, then set ``flag`` to ``value`` with release semantics. The
    barrier makes every thread's store part of what the release publishes."""
    tl.store(STATES + index * D_K * D_V + state_offs, state, mask=state_ok)
    tl.debug_barrier()
    tl.atomic_xchg(flag, value, sem="release")


@triton.jit(do_not_specialize=["H", "chains"])
def _one_pass_forward_kernel(
    Q, K, V, O, S0, SN, LOCALS, INC, READY, FLAG, LOG2_DECAY, n, H, seg_len, chains,
    sqb, sqh, sqn: tl.constexpr, skb, skh, skn: tl.constexpr, svb, svh, svn: tl.constexpr,
    sob, soh, son: tl.constexpr, D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK: tl.constexpr, HAS_S0: tl.constexpr, LOOKBACK: tl.constexpr, PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr = False,
):
    """One segment of one (batch*head, d_v slice), chosen by ticket. Grid (chains * num_segments,).

    READY is int32, zero at launch: READY[0] the ticket counter, then one flag per (chain, segment) (0, LOCAL or
    OUTGOING). LOCALS and INC are (batch*heads, num_segments, d_k, d_v) fp32: INC[s] receives segment s's
    incoming state (S0 or zeros for s = 0), which la2_fast's exact pass reads back; LOCALS[s] the local state
    (look-back only). FLAG holds la2_fast's non-finite flags, in its order.
    """
    slices: tl.constexpr = (D_V + BLOCK_DV - 1) // BLOCK_DV
    num_seg = tl.cdiv(n, seg_len)
    ticket = tl.atomic_add(READY, 1)
    seg = ticket // chains
    chain = ticket % chains  # the chains of one segment run side by side (slices of one head adjacent)
    bh = chain // slices
    pid_v = chain % slices
    flag = FLAG + (bh * num_seg + seg) * slices + pid_v
    clear_flag(flag)
    log2_lam = tl.load(LOG2_DECAY + bh % H)
    Q += head_offset(bh, H, n, D_K, sqb, sqh, CONTIGUOUS)
    K += head_offset(bh, H, n, D_K, skb, skh, CONTIGUOUS)
    V += head_offset(bh, H, n, D_V, svb, svh, CONTIGUOUS)
    O += head_offset(bh, H, n, D_V, sob, soh, CONTIGUOUS)
    S0 += head_start(bh, 1, D_K * D_V)
    SN += head_start(bh, 1, D_K * D_V)
    LOCALS += head_start(bh, num_seg, D_K * D_V)
    INC += head_start(bh, num_seg, D_K * D_V)
    READY += 1 + chain * num_seg  # this chain's flags
    offs_r = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    start = seg * seg_len
    end = tl.minimum(start + seg_len, n)
    seg_decay = tl.exp2(log2_lam * seg_len.to(tl.float32))
    # 1. The local state (the last segment has no successor to hand a state to).
    local = tl.zeros((PAD_K, BLOCK_DV), dtype=tl.float32)
    if seg < num_seg - 1:
        local = _local_state(K, V, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, skn, svn,
                             PAD_K, BLOCK_DV, BLOCK, False, PRECISION)
        if LOOKBACK:
            if seg > 0:
                _publish(LOCALS, seg, local, state_offs, state_ok, READY + seg, LOCAL, D_K, D_V)
    # 2. The incoming state.
    kv = tl.zeros((PAD_K, BLOCK_DV), dtype=tl.float32)
    if seg == 0:
        if HAS_S0:
            kv = tl.load(S0 + state_offs, mask=state_ok, other=0.0)
    elif LOOKBACK:
        scale = 1.0  # lambda^(L (s-1-j)) for predecessor j
        j = seg - 1
        while j >= 0:  # segment 0 publishes OUTGOING only: every walk ends there at the latest
            f = _await_flag(READY + j, LOCAL)
            if f == OUTGOING:  # INC[j + 1] holds the state after segment j: done
                kv += scale * tl.load(INC + (j + 1) * D_K * D_V + state_offs, mask=state_ok, other=0.0,
                                      cache_modifier=".cg")
                j = -1
            else:  # LOCAL: add A_j, look further back
                kv += scale * tl.load(LOCALS + j * D_K * D_V + state_offs, mask=state_ok, other=0.0,
                                      cache_modifier=".cg")
                scale = scale * seg_decay
                j -= 1
    else:
        _await_flag(READY + seg - 1, OUTGOING)
        kv = tl.load(INC + seg * D_K * D_V + state_offs, mask=state_ok, other=0.0, cache_modifier=".cg")
    # 3. Hand on the next state (segment 0 also keeps its incoming one, for the exact pass).
    if seg == 0:
        tl.store(INC + state_offs, kv, mask=state_ok)
    if seg < num_seg - 1:
        _publish(INC, seg + 1, kv * seg_decay + local, state_offs, state_ok, READY + seg, OUTGOING, D_K, D_V)
    # 4. Algorithm 1 over the segment, from the incoming state.
    mask = decay_tile(log2_lam, offs_r, offs_r, False)
    q_scale = tl.exp2(log2_lam * (offs_r + 1).to(tl.float32))
    kv = _forward_sweep(Q, K, V, O, kv, start, end, n, log2_lam, offs_r, offs_k, offs_v, k_ok, v_ok, mask,
                        q_scale, sqn, skn, svn, son, D_K, D_V, BLOCK, False, PRECISION, False)
    if seg == num_seg - 1:
        tl.store(SN + state_offs, kv, mask=state_ok)
    flag_nonfinite(flag, kv)


def lookback_forward(q, k, v, log2_decay, initial_state=None, seg_len: int | None = None, lookback: bool = True,
                     block: int | None = None, block_dv: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None):
    """The forward in one pass: (o, final_state fp32), as :func:`~.la2_fast.la2_fast_forward` returns them.

    q, k (batch, heads, n, d_k), v (batch, heads, n, d_v), log2_decay float32 (heads,) on q's device;
    initial_state (batch, heads, d_k, d_v) or None. ``lookback`` True: decoupled look-back; False: the chained
    scan. ``seg_len`` (rows per segment, a multiple of the block; default 8 blocks) sets how many programs run
    and how long each holds its K and V. Tiles left None are the backend's (:func:`~.plan.backend_tiles`).
    Two launches, as every kernel of the package: this one, then la2_fast's exact pass over the segments
    flagged non-finite. bfloat16 is refused in the CPU interpreter (TypeError).
    """
    import torch

    refuse_interpreted_bf16("lookback_forward", q, k, v)
    block, block_dv, num_warps, num_stages = backend_tiles(q, v, block, block_dv, num_warps, num_stages)
    seg_len = 8 * block if seg_len is None else seg_len
    if not isinstance(seg_len, int) or seg_len <= 0 or seg_len % block:
        raise ValueError(f"seg_len must be a positive multiple of the block size {block}, got {seg_len!r}")
    q, k, v = in_place(q), in_place(k), in_place(v)
    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    block_dv, slices = value_slices(d_v, block_dv)
    num_seg = cdiv(n, seg_len)
    chains = batch * heads * slices
    programs = chains * num_seg
    o = output_like(v)
    sn = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    states = (batch * heads, num_seg, d_k, d_v)
    inc = torch.empty(states, device=q.device, dtype=torch.float32)
    local = torch.empty(states, device=q.device, dtype=torch.float32) if lookback else inc  # inc: never read then
    ready = torch.zeros(1 + programs, device=q.device, dtype=torch.int32)  # the ticket counter, then the flags
    flags = torch.empty(programs, device=q.device, dtype=torch.int32)
    s0 = dense(initial_state.float()) if initial_state is not None else sn  # sn: never read without HAS_S0
    contiguous = all(x.is_contiguous() for x in (q, k, v, o))
    meta = dict(D_K=d_k, D_V=d_v, PAD_K=pad_dim(d_k), BLOCK_DV=block_dv, BLOCK=block, PRECISION=dot_precision(q),
                CONTIGUOUS=contiguous, num_warps=num_warps, num_stages=num_stages)
    strides = _strides(q, k, v, o)
    launch(_one_pass_forward_kernel, (programs,))(q, k, v, o, s0, sn, local, inc, ready, flags, log2_decay, n, heads,
                                                  seg_len, chains, *strides, **meta,
                                                  HAS_S0=initial_state is not None, LOOKBACK=lookback)
    # la2_fast's exact pass redoes the flagged segments from their saved incoming states.
    exact_pass((q, k, v, o, s0, sn, inc, inc, flags, log2_decay, n, heads, seg_len, programs, *strides),
               {**meta, "REVERSE": False, "HAS_S0": False, "SEG_IS_INCOMING": True}, programs, q.device)
    return o, sn
