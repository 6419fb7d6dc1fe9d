"""The public entry points: one function for the forward pass, one for the backward pass.

Both validate every argument in :mod:`lightning_edu.validation`, then run the backend implementation of
the chosen rung from :mod:`lightning_edu.registry` on the checked arguments:

========  ==========================================  ==========
backend   implementation                              chapter
========  ==========================================  ==========
numpy     ``numpy.blockwise`` (Algorithms 1-2)        04-05
torch     ``torch.chunked`` (hand-written backward)   06
triton    ``triton.la2_fast`` (Triton kernels)        07-08
========  ==========================================  ==========
"""

from __future__ import annotations

from . import registry
from .validation import validate_attention_args, validate_flag

__all__ = ["lightning_attention", "lightning_attention_backward"]


def lightning_attention(
    q,
    k,
    v,
    decay=1.0,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    initial_state=None,
    return_state: bool = False,
):
    """Causal linear attention with decay, the function this whole book computes.

    Per batch and head: ``KV_0 = initial_state`` (zeros if None), ``KV_t = lambda KV_{t-1} + k_t^T v_t``
    for t = 1..n, ``o_t = q_t KV_t``.

    q, k: (batch, heads, n, d_k); v: (batch, heads, n, d_v); decay: lambda in (0, 1], a float or one value
    per head; initial_state: (batch, heads, d_k, d_v). ``backend`` is "numpy" (float64, numpy arrays),
    "torch", "triton" or "auto" (numpy for numpy arrays, triton for CUDA tensors, torch otherwise).
    Returns o (batch, heads, n, d_v), or (o, KV_n) with ``return_state=True``.

    Non-finite inputs stay causal: an output is NaN or inf exactly when it depends on a NaN or inf input.
    On a machine without CUDA the "triton" backend runs Triton's CPU interpreter, whose bfloat16
    arithmetic is wrong: bfloat16 tensors are computed there in float32 and the output rounded to bfloat16.

    Unsupported, each refused with a TypeError or ValueError that names the argument:
    backend "numpy" with torch tensors, "torch"/"triton" with numpy arrays; "triton" with float64
    (``tl.dot`` has no float64), with d_k or d_v > 256, with a block_size that is not a power of two >= 16,
    or with CPU tensors when the interpreter is off; a decay tensor that requires grad (no backend computes
    dL/dlambda yet); numpy masked arrays (the mask would be ignored).
    """
    args = validate_attention_args(
        q, k, v, decay, backend=backend, block_size=block_size, initial_state=initial_state
    )
    return_state = validate_flag("return_state", return_state)
    out, state = registry.backend_for(args.backend).forward(args)
    return (out, state) if return_state else out


def lightning_attention_backward(
    q,
    k,
    v,
    do,
    decay=1.0,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    initial_state=None,
    d_final_state=None,
    return_state_grad: bool = False,
):
    """Gradients (dq, dk, dv) of a loss L given ``do`` = dL/do, by the paper's Algorithm 2. (Chapter 05.)

    ``d_final_state`` is dL/dKV_n when the final state was used too; with ``return_state_grad=True`` the
    result also carries dL/d initial_state: (dq, dk, dv, d_initial_state). ``backend`` as in
    :func:`lightning_attention` ("auto": numpy for numpy arrays, triton for CUDA tensors, torch otherwise).

    Unsupported: everything :func:`lightning_attention` refuses, and ``do=None`` (a TypeError: the
    backward needs dL/do).
    """
    args = validate_attention_args(
        q, k, v, decay, backend=backend, block_size=block_size, initial_state=initial_state, do=do,
        d_final_state=d_final_state, need_do=True,
    )
    return_state_grad = validate_flag("return_state_grad", return_state_grad)
    dq, dk, dv, d_state = registry.backend_for(args.backend).backward(args, d_final_state)
    return (dq, dk, dv, d_state) if return_state_grad else (dq, dk, dv)
