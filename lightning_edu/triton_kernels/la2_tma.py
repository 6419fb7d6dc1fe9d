"""la2_fast's forward with its tiles loaded by Hopper's tensor memory accelerator (TMA). (Chapter 07.)

The main forward kernel of :mod:`la2_fast` computes the address of every element it loads: a 64 x 128 tile of
``Q`` is 8192 pointers, held in registers (chapter 14's Nsight Compute table shows the registers per thread at
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
launch plans (:class:`~._tiles.LaunchPlan`) rebuild each descriptor on the replayed call's tensors. Chapter 14
measures the kernel against la2_fast's (``python -m benchmarks.tma``) and the backend with and without it
(``python -m benchmarks.bench``, method ``triton_pointers``; notebooks/data/bench_h100_d128.json): with
descriptors the forward was faster at every length measured (from 32K on with
:func:`~.plan.whole_dv_forward`'s tiles and segments), the forward + backward faster at 2K and level beyond.

A descriptor needs 16-byte aligned rows: the base and every stride but the last a multiple of 16 bytes (d a
multiple of 8 in 16-bit dtypes, of 4 in float32); on a GPU, compute capability 9.0 or later. The launcher refuses
other inputs (ValueError). In the CPU interpreter descriptors are emulated, so the same kernel is checked there.
"""

from __future__ import annotations

from ._tiles import (
    dense,
    refuse_interpreted_bf16,
)
from .la2_fast import (  # noqa: F401
    _forward_form,
    _tma_fast_pass,
    _tma_forward_kernel,
    fast_pass_for,
    in_place,
    output_like,
    tma_ready,
)
from .plan import backend_tiles

__all__ = ["la2_tma_forward", "tma_ready", "fast_pass_for"]


def la2_tma_forward(q, k, v, log2_decay, initial_state=None, block: int | None = None, block_dv: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None, seg_len: int | None = None):
    """la2_fast's forward with descriptor loads and stores in the main kernel: (o, final_state fp32), as
    :func:`~.la2_fast.la2_fast_forward` returns them. Tiles left None are the backend's
    (:func:`~.plan.backend_tiles`); the segments are :func:`~.plan.choose_segments`'. Inputs that
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


