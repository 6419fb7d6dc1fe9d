"""la2_fast's forward with its tiles loaded by Hopper's tensor memory accelerator (TMA). (Chapter 07.)

The main forward kernel of :mod:`la2_fast` computes the address of every element it loads: a 64 x 128 tile of
``Q`` is 8192 pointers, held in registers (chapter 07's Nsight Compute table shows the registers per thread at
d = 128, and their spills). On Hopper GPUs a *tensor descriptor* (the tensor's base, shape and
strides, and the tile's shape, ``triton.tools.tensor_descriptor.TensorDescriptor``) lets the kernel ask the
TMA unit for a whole tile by its coordinates, ``desc.load([batch, head, row, column])``: the copy engine
computes the addresses and writes the tile to shared memory, asynchronously, and rows or columns past the
tensor's end come back as zeros (so no masks). Stores go the same way, dropping what lies outside.

Everything else is la2_fast's: the segment pre-pass (with pointers), the incoming states (stored for the
backward, or read from it), the block loop (Algorithm 1 with 16-bit dots and a float32 state), the non-finite flags
and the exact pass. In time order only: the backward's reversed passes keep la2_fast's pointers.

The backend runs it (:func:`backend_takes`: 16-bit tiles, 64 < d <= 128, calls of 2^18 rows or more, compute
capability 9.0 or later) as the fast pass of its passes in time order, the forward and the backward's dQ pass; its
launch plans (:class:`~._tiles.LaunchPlan`) rebuild each descriptor on the replayed call's tensors. Chapter 07
measures the kernel against la2_fast's (``python -m benchmarks.tma``) and the backend with and without it
(``python -m benchmarks.bench``, method ``triton_pointers``; notebooks/data/bench_h100_d128.json): with
descriptors the forward was faster at every length measured (from 32K on with
:func:`~.la2_fast.whole_dv_forward`'s tiles and segments), the forward + backward faster at 2K and level beyond.

A descriptor needs 16-byte aligned rows: the base and every stride but the last a multiple of 16 bytes (d a
multiple of 8 in 16-bit dtypes, of 4 in float32); on a GPU, compute capability 9.0 or later. The launcher refuses
other inputs (ValueError). In the CPU interpreter descriptors are emulated, so the same kernel is checked there.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from ._tiles import (
    apply_decay, clear_flag, decay_tile, dense, flag_nonfinite, head_start, interpreted, launch,
    refuse_interpreted_bf16,
)
from .la2_fast import _forward_form, _incoming_state, backend_tiles, in_place, output_like

__all__ = ["la2_tma_forward", "tma_ready", "backend_takes", "fast_pass_for", "BACKEND", "MIN_ROWS"]


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


BACKEND = True
"""Whether the backend's passes in time order (the forward, the backward's dQ pass) load their tiles through
descriptors where :func:`backend_takes` says so. Set it to False to run la2_fast's pointer kernel everywhere."""


MIN_ROWS = 2**18
"""The fewest rows (batch * heads * n) of a call whose passes :func:`backend_takes` gives descriptor tiles."""


def backend_takes(q, v) -> bool:
    """Whether the backend's passes in time order on tensors like q (batch, heads, n, d_k) and v (..., d_v) take
    descriptor tiles (:data:`BACKEND` on): 16-bit tiles on a GPU of compute capability 9.0 or later, with
    64 < max(d_k, d_v) <= 128, and at least :data:`MIN_ROWS` rows, where they were measured faster (chapter 07).
    The launchers still ask :func:`tma_ready` of the call's tensors.

    Why a least size. A descriptor costs the host: built at every call (or rebuilt at every replay), and encoded
    again by Triton's launcher at every launch; a forward + backward takes eight. A short call is bound by the
    host, and there the descriptors made it slower (``bench --tiny``, notebooks/data/tiny_tma_h100.json). From
    about 2^18 rows on, the GPU's time for a forward + backward at d = 128 passes the host's for the call, which
    then overlaps it, and the descriptors were faster at every length measured (chapter 07)."""
    import torch

    return (BACKEND and q.dtype in (torch.float16, torch.bfloat16) and 64 < max(q.shape[-1], v.shape[-1]) <= 128
            and q.shape[0] * q.shape[1] * q.shape[2] >= MIN_ROWS and q.is_cuda and not interpreted(q)
            and _capability(q.device.index) >= (9, 0))


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    import torch

    return torch.cuda.get_device_capability(index)


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


def la2_tma_forward(q, k, v, log2_decay, initial_state=None, block: int | None = None, block_dv: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, seg_len: int | None = None):
    """la2_fast's forward with descriptor loads and stores in the main kernel: (o, final_state fp32), as
    :func:`~.la2_fast.la2_fast_forward` returns them. Tiles left None are the backend's
    (:func:`~.la2_fast.backend_tiles`); the segments are :func:`~.la2_fast.choose_segments`'. Inputs that
    :func:`tma_ready` turns down get a ValueError; bfloat16 is refused in the CPU interpreter (TypeError)."""
    refuse_interpreted_bf16("la2_tma_forward", q, k, v)
    block, block_dv, num_warps, num_stages = backend_tiles(q, v, block, block_dv, num_warps, num_stages)
    q, k, v = in_place(q), in_place(k), in_place(v)
    o = output_like(v)
    why = tma_ready(q, k, v, o)
    if why is not None:
        raise ValueError(f"la2_tma_forward: {why}")
    s0 = dense(initial_state.float()) if initial_state is not None else None
    # la2_fast's plan (segments, pre-pass, flags) and exact pass, this module's kernel for the fast pass
    o, sn, _ = _forward_form(q, k, v, log2_decay, s0, False, block, block_dv, num_warps, num_stages, seg_len,
                             out=o, fast_pass=_tma_fast_pass)
    return o, sn


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
