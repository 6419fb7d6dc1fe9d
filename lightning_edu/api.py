"""The public entry points: the forward pass, the backward pass, and one decoding step.

Each validates every argument in :mod:`lightning_edu.validation`, then runs the backend implementation of
the chosen rung from :mod:`lightning_edu.registry` on the checked arguments:

========  ==========================================  ==================  ==========
backend   implementation                              decoding step       chapter
========  ==========================================  ==================  ==========
numpy     ``numpy.blockwise`` (Algorithms 1-2)        ``numpy.step``      04-05
torch     ``torch.chunked`` (hand-written backward)   ``torch.step``      06
triton    ``triton.la2_fast`` (Triton kernels)        ``triton.decode``   07-08
========  ==========================================  ==================  ==========
"""

from __future__ import annotations

from . import registry
from .packed import packed_backward, packed_forward
from .validation import validate_attention_args, validate_flag, validate_step_args

__all__ = ["lightning_attention", "lightning_attention_backward", "lightning_attention_step"]


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
    cu_seqlens=None,
):
    """Causal linear attention with decay, the function this whole book computes.

    Per batch and head: ``KV_0 = initial_state`` (zeros if None), ``KV_t = lambda KV_{t-1} + k_t^T v_t``
    for t = 1..n, ``o_t = q_t KV_t``.

    q, k: (batch, heads, n, d_k); v: (batch, heads, n, d_v); decay: lambda in (0, 1], a float or one value
    per head; initial_state: (batch, heads, d_k, d_v). ``backend`` is "numpy" (float64, numpy arrays),
    "torch", "triton" or "auto" (numpy for numpy arrays, triton for CUDA tensors, torch otherwise).
    Returns o (batch, heads, n, d_v), or (o, KV_n) with ``return_state=True``.

    A packed batch of sequences of different lengths (chapter 10): q, k, v of shape (1, heads, total, d) hold
    them end to end and ``cu_seqlens`` (a list, numpy array or CPU tensor of num_seqs + 1 integers starting at
    0, never decreasing, ending at total) marks where each starts; initial_state and the returned state are
    then (num_seqs, heads, d_k, d_v). Each sequence starts from its own state: nothing crosses a boundary.

    A learnable decay (chapter 06): on the torch and triton backends decay may be a tensor of per-head lambdas
    that requires grad; autograd then gives dL/dlambda with the other gradients. A decay tensor on a GPU is
    never read by the host (no waiting for the GPU): its values are checked on the device, where a lambda
    outside (0, 1] turns that head's outputs to NaN; a float, list, array or CPU tensor is checked here and
    refused with a ValueError.

    Non-finite inputs stay causal: an output is NaN or inf exactly when it depends on a NaN or inf input.
    On a machine without CUDA the "triton" backend runs Triton's CPU interpreter, whose bfloat16
    arithmetic is wrong: bfloat16 tensors are computed there in float32 and the output rounded to bfloat16.

    Unsupported, each refused with a TypeError or ValueError that names the argument:
    backend "numpy" with torch tensors, "torch"/"triton" with numpy arrays; "triton" with float64
    (``tl.dot`` has no float64), with d_k or d_v > 256, with a block_size that is not a power of two >= 16,
    or with CPU tensors when the interpreter is off; a decay tensor that requires grad on the numpy backend;
    numpy masked arrays (the mask would be ignored).
    """
    args = validate_attention_args(
        q, k, v, decay, backend=backend, block_size=block_size, initial_state=initial_state, cu_seqlens=cu_seqlens,
        decay_grad=True,
    )
    return_state = validate_flag("return_state", return_state)
    impl = registry.backend_for(args.backend)
    out, state = impl.forward(args) if args.cu_seqlens is None else packed_forward(impl, args)
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
    cu_seqlens=None,
):
    """Gradients (dq, dk, dv) of a loss L given ``do`` = dL/do, by the paper's Algorithm 2. (Chapter 05.)

    ``d_final_state`` is dL/dKV_n when the final state was used too; with ``return_state_grad=True`` the
    result also carries dL/d initial_state: (dq, dk, dv, d_initial_state). ``backend`` as in
    :func:`lightning_attention` ("auto": numpy for numpy arrays, triton for CUDA tensors, torch otherwise), and
    ``cu_seqlens`` too (a packed batch: d_final_state and d_initial_state are then per sequence).

    Unsupported: everything :func:`lightning_attention` refuses, ``do=None`` (a TypeError: the backward needs
    dL/do), and a decay tensor that requires grad (a TypeError: this function returns no dL/dlambda; call
    :func:`lightning_attention` and let autograd give it).
    """
    args = validate_attention_args(
        q, k, v, decay, backend=backend, block_size=block_size, initial_state=initial_state, do=do,
        d_final_state=d_final_state, need_do=True, cu_seqlens=cu_seqlens,
    )
    return_state_grad = validate_flag("return_state_grad", return_state_grad)
    impl = registry.backend_for(args.backend)
    if args.cu_seqlens is None:
        dq, dk, dv, d_state = impl.backward(args, d_final_state)
    else:
        dq, dk, dv, d_state = packed_backward(impl, args, d_final_state)
    return (dq, dk, dv, d_state) if return_state_grad else (dq, dk, dv)


def lightning_attention_step(q, k, v, state=None, decay=1.0, *, backend: str = "auto"):
    """One decoding step: the recurrence of :func:`lightning_attention` advanced by one token. (Chapter 02.)

    Per batch and head: ``new_state = lambda state + k^T v`` (k^T v the d_k x d_v outer product) and
    ``o = q new_state``. q, k: (batch, heads, d_k); v: (batch, heads, d_v); state: (batch, heads, d_k, d_v),
    None meaning zeros; decay: lambda in (0, 1], a float or one value per head. Returns (o, new_state) with
    o (batch, heads, d_v). ``backend`` as in :func:`lightning_attention` ("auto": numpy for numpy arrays,
    triton for CUDA tensors, torch otherwise).

    Generation is a prefill, then one step per new token::

        o, state = lightning_attention(q, k, v, decay, return_state=True)   # the prompt, tokens 1..n
        o_next, state = lightning_attention_step(q_next, k_next, v_next, state, decay)   # token n + 1

    and gives the outputs and the state of one :func:`lightning_attention` call over all the tokens.

    dtypes: "numpy" returns float64 arrays. "torch" returns o in v's dtype and new_state in the compute
    dtype: float32 and float64 inputs keep theirs, while for float16/bfloat16 inputs the state is kept in
    float32, so new_state is float32 (rounding it to 16 bits at every step would add up over a long
    generation); it is plain tensor ops, differentiable with autograd. "triton" returns o in v's dtype and
    new_state in float32 (off CUDA, bfloat16 inputs are computed in float32, as for lightning_attention).

    Unsupported, each refused with a TypeError or ValueError that names the argument: q, k or v with a
    sequence axis (4-D: drop it, or call :func:`lightning_attention` for a whole sequence); everything
    :func:`lightning_attention` refuses for its backend and dtypes (mixed numpy and torch, non-float dtypes,
    "triton" with float64 or d_k or d_v > 256, a decay outside (0, 1], one that requires grad except on "torch").
    """
    args = validate_step_args(q, k, v, state, decay, backend)
    return registry.backend_for(args.backend, op="step").forward(args)
