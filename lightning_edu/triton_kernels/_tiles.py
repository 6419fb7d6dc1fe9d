"""Small launch-time helpers shared by the Lightning Attention-2 kernels."""

from __future__ import annotations

import torch
import triton

__all__ = ["pad_dim", "dot_precision"]


def pad_dim(d: int) -> int:
    """A head dim as a tile width: the next power of two, at least 16 (tl.dot's smallest tile)."""
    return max(16, triton.next_power_of_2(d))


def dot_precision(x: torch.Tensor) -> str:
    """``input_precision`` of tl.dot: full fp32 ("ieee") for fp32 inputs, the correctness rung; "tf32" for
    16-bit inputs, whose operands are already coarser than tf32."""
    return "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"
