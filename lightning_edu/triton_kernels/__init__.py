"""Rung 3: Triton kernels, and the "triton" backend of :func:`lightning_edu.lightning_attention`.

Variants (each correct, each measured in chapters 07-08 and by ``python -m lightning_edu.bench``):

============  ======================================================================  ==========
variant       what                                                                    module
============  ======================================================================  ==========
la1           Lightning Attention-1: tiled masked left product, O(n^2 d)              ``la1``
la2_literal   Algorithms 1-2 as written: one program per (batch, head[, d slice])     ``la2_literal``
la2_fast      segments + 16-bit dots + backward as reversed forwards (the backend)    ``la2_fast``
============  ======================================================================  ==========

On a machine without CUDA, importing :mod:`lightning_edu` sets ``TRITON_INTERPRET=1`` first, so these
kernels run in Triton's CPU interpreter (fp32/fp16 only: the interpreter's bf16 arithmetic is wrong).
"""

from __future__ import annotations

import math

import torch

from .la2_fast import la2_fast_backward, la2_fast_forward
from .la2_literal import la2_literal_backward, la2_literal_forward

__all__ = ["VARIANTS", "TritonLightningAttention", "triton_attention", "forward_from_args", "backward_from_args", "kernel_config"]


def kernel_config(d_k: int, d_v: int, dtype: torch.dtype, block_size: int | None = None) -> dict:
    """Tile sizes of the backend's kernels, chosen by the H200 tile sweep of chapter 07 (bench --tune, notebooks/data/tune_h200.json)."""
    big = max(d_k, d_v) > 128
    block = block_size or (32 if big else 64)
    return dict(block=block, block_dv=64 if big else None, num_warps=4, num_stages=2)


# The Lightning Attention-2 variants share one signature: forward(q, k, v, log2_decay, initial_state, ...)
# -> (o, final_state) and backward(q, k, v, do, log2_decay, initial_state, d_final_state, ...) ->
# (dq, dk, dv, d_initial_state). LA-1 has its own wrapper in ``la1`` (no state to carry).
VARIANTS = {
    "la2_literal": (la2_literal_forward, la2_literal_backward),
    "la2_fast": (la2_fast_forward, la2_fast_backward),
}


def log2_decay_tensor(decay, device) -> torch.Tensor:
    """log2(lambda) per head as float32 on ``device`` (0 exactly for lambda = 1)."""
    return torch.tensor([math.log2(float(x)) for x in decay], dtype=torch.float32, device=device)


class TritonLightningAttention(torch.autograd.Function):
    """Differentiable wrapper of the fastest variant: returns (o, final_state fp32)."""

    @staticmethod
    def forward(ctx, q, k, v, log2_decay, initial_state, block_size=None):
        ctx.set_materialize_grads(False)  # an unused final state must not cost a zero-gradient pass
        q, k, v = (x.contiguous() for x in (q, k, v))
        cfg = kernel_config(q.shape[-1], v.shape[-1], q.dtype, block_size)
        o, sn, (seg_len, incoming) = la2_fast_forward(q, k, v, log2_decay, initial_state, save_states=True, **cfg)
        ctx.save_for_backward(q, k, v, log2_decay, initial_state, incoming)
        ctx.seg_len = seg_len
        ctx.has_state = initial_state is not None
        ctx.cfg = cfg
        return o, sn

    @staticmethod
    def backward(ctx, do, d_sn):
        q, k, v, log2_decay, initial_state, incoming = ctx.saved_tensors
        do = torch.zeros_like(v) if do is None else do.contiguous()
        dq, dk, dv, ds0 = la2_fast_backward(
            q, k, v, do, log2_decay, initial_state if ctx.has_state else None, d_sn, saved=(ctx.seg_len, incoming),
            **ctx.cfg,
        )
        d_state = ds0.to(initial_state.dtype) if ctx.has_state and ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, d_state, None


def triton_attention(q, k, v, decay, initial_state=None, block_size=None):
    """(o, final_state) by the Triton backend; ``decay`` is a sequence of per-head lambdas."""
    return TritonLightningAttention.apply(q, k, v, log2_decay_tensor(decay, q.device), initial_state, block_size)


def forward_from_args(args):
    """Backend hook for :func:`lightning_edu.lightning_attention`."""
    return triton_attention(args.q, args.k, args.v, args.decay, args.initial_state, args.block_size)


def backward_from_args(args, d_final_state=None):
    """Backend hook for :func:`lightning_edu.lightning_attention_backward`."""
    q, k, v = (x.contiguous() for x in (args.q, args.k, args.v))
    cfg = kernel_config(q.shape[-1], v.shape[-1], q.dtype, args.block_size)
    return la2_fast_backward(q, k, v, args.do.contiguous(), log2_decay_tensor(args.decay, q.device),
                             args.initial_state, d_final_state, **cfg)

