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

Chapter 11 adds the normalised variants of the explainer on feature maps and decoding, "Inference: No KV
Cache": :func:`normalized_attention` and :func:`normalized_attention_step`, which run the functions above on
phi(q), phi(k) and [v | 1] (every backend), and :func:`hybrid_attention`, softmax inside blocks and linear
attention between them (numpy and torch, in :mod:`lightning_edu.feature_maps`).
"""

from __future__ import annotations

# feature_core holds what lightning_edu.feature_maps re-exports and these functions run (feature_maps itself imports
# this module, to measure normalized_attention): bound to the name the chapter reads, feature_maps.
from . import feature_core as feature_maps, registry
from .packed import packed_backward, packed_forward
from .validation import (
    validate_attention_args, validate_augmented_state, validate_feature_map, validate_flag, validate_hybrid_args,
    validate_normalized_args, validate_step_args,
)

__all__ = ["lightning_attention", "lightning_attention_backward", "lightning_attention_step", "normalized_attention",
           "normalized_attention_step", "hybrid_attention"]


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
    "torch", "triton" or "auto" (numpy for numpy arrays, triton for float32/16-bit CUDA tensors, torch
    otherwise). Returns o (batch, heads, n, d_v), or (o, KV_n) with ``return_state=True``.

    Any strides will do. The "triton" backend reads q, k and v where they lie when their head dim is contiguous
    and they start on a 16-byte boundary, as every tensor torch allocates does (a model's views of one
    projection, ``qkv(x).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)``, are not copied; a view at an odd offset is)
    and returns o laid out as v (there: (batch, n, heads, d), so that ``o.transpose(1, 2).reshape(b, n, h * d)``
    is free), each gradient laid out as its input (chapter 07).

    A packed batch of sequences of different lengths (chapter 10): q, k, v of shape (1, heads, total, d) hold
    them end to end and ``cu_seqlens`` (a list, numpy array or CPU tensor of num_seqs + 1 integers starting at
    0, never decreasing, ending at total; under :func:`torch.compile` a list of Python ints) marks where each
    starts; initial_state and the returned state are then (num_seqs, heads, d_k, d_v). Each sequence starts from
    its own state: nothing crosses a boundary.

    A learnable decay (chapter 06): on the torch and triton backends decay may be a tensor of per-head lambdas
    that requires grad; autograd then gives dL/dlambda with the other gradients. A decay tensor on a GPU is
    never read by the host (no waiting for the GPU): its values are checked on the device, where a lambda
    outside (0, 1] turns that head's outputs to NaN; a float, list, array or CPU tensor is checked here and
    refused with a ValueError.

    Non-finite inputs stay causal: an output is NaN or inf exactly when it depends on a NaN or inf input.
    Meta tensors (a model traced on the meta device, with no data) get the shapes and dtypes of a real call on
    the torch and triton backends, here, in :func:`lightning_attention_backward` and in the decoding step.
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
    :func:`lightning_attention` ("auto": numpy for numpy arrays, triton for float32/16-bit CUDA tensors, torch
    otherwise), and ``cu_seqlens`` too (a packed batch: d_final_state and d_initial_state are then per sequence).

    Unsupported: everything :func:`lightning_attention` refuses, ``do=None`` (a TypeError: the backward needs
    dL/do), a decay tensor that requires grad (a TypeError: this function returns no dL/dlambda; call
    :func:`lightning_attention` and let autograd give it), and, while grad mode is on, any other tensor argument
    that requires grad (a TypeError: the gradients returned carry no graph, there is no second derivative; pass
    it detached, or call under ``torch.no_grad()``).
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
    """One decoding step: the recurrence of :func:`lightning_attention` advanced by one token. (Chapter 10.)

    Per batch and head: ``new_state = lambda state + k^T v`` (k^T v the d_k x d_v outer product) and
    ``o = q new_state``. q, k: (batch, heads, d_k); v: (batch, heads, d_v); state: (batch, heads, d_k, d_v),
    None meaning zeros; decay: lambda in (0, 1], a float or one value per head. Returns (o, new_state) with
    o (batch, heads, d_v). ``backend`` as in :func:`lightning_attention` ("auto": numpy for numpy arrays,
    triton for float32/16-bit CUDA tensors, torch otherwise).

    Generation is a prefill, then one step per new token::

        o, state = lightning_attention(q, k, v, decay, return_state=True)   # the prompt, tokens 1..n
        o_next, state = lightning_attention_step(q_next, k_next, v_next, state, decay)   # token n + 1

    and gives the outputs and the state of one :func:`lightning_attention` call over all the tokens.

    dtypes: "numpy" returns float64 arrays. "torch" returns o in v's dtype and new_state in the compute
    dtype: float32 and float64 inputs keep theirs, while for float16/bfloat16 inputs the state is kept in
    float32, so new_state is float32 (rounding it to 16 bits at every step would add up over a long
    generation); it is plain tensor ops, differentiable with autograd. "triton" returns o in v's dtype and
    new_state in float32 (off CUDA, bfloat16 inputs are computed in float32, as for lightning_attention).

    Gradients: on "torch" and "triton" autograd gives dL/dq, dk, dv, dstate and, for a decay tensor that
    requires grad, dL/dlambda (also under ``torch.compile``); "triton" computes them in float32 torch ops from
    the kernel's output (the custom op ``lightning_edu::decode_step``), and with nothing requiring grad it is the
    kernel's one launch alone.

    Unsupported, each refused with a TypeError or ValueError that names the argument: q, k or v with a
    sequence axis (4-D: drop it, or call :func:`lightning_attention` for a whole sequence); everything
    :func:`lightning_attention` refuses for its backend and dtypes (mixed numpy and torch, non-float dtypes,
    "triton" with float64 or d_k or d_v > 256, a decay outside (0, 1], one that requires grad on "numpy").
    """
    args = validate_step_args(q, k, v, state, decay, backend)
    return registry.backend_for(args.backend, op="step").forward(args)


def normalized_attention(
    q,
    k,
    v,
    decay=1.0,
    *,
    feature_map="elu+1",
    eps: float = 1e-6,
    backend: str = "auto",
    initial_state=None,
    return_state: bool = False,
):
    """Normalized linear attention with a feature map: the form of the explainer on feature maps and decoding,
    "Inference: No KV Cache". (Chapter 11.)

    Per batch and head, with phi the feature map applied to q and k::

        S_t = lambda S_{t-1} + phi(k_t)^T v_t,    z_t = lambda z_{t-1} + phi(k_t),
        o_t = phi(q_t) S_t / (phi(q_t) . z_t + eps).

    It is computed by the ones column: ``lightning_attention(phi(q), phi(k), [v | 1], decay)`` with a column of
    ones appended to v, then the first d_v columns divided by the last. The state of that call is
    [S | z]: its last column sums lambda^(t-s) phi(k_s) * 1, which is z_t exactly, and the last output
    column is phi(q_t) . z_t. So the numerator and the denominator come from the same kernel on every
    backend (numpy, torch, triton): same blocks, same decay factors, same rounding, one pass, and the
    normaliser costs one extra value column. Autograd flows through the division, the feature map and
    lightning_attention on the torch and triton backends (decay too, as in :func:`lightning_attention`).

    q, k: (batch, heads, n, d_k); v: (batch, heads, n, d_v); decay: lambda in (0, 1], a float or one value
    per head. ``feature_map``: "identity", "elu+1" (Katharopoulos et al., 2020), "relu2" (ReLU(x)^2), or a
    callable mapping (..., d_k) to (..., d'), d' free: a numpy function for numpy arrays, a torch function
    or ``torch.nn.Module`` for tensors (e.g. :class:`lightning_edu.feature_maps.LearnedReLU2`). ``eps``: a
    finite number >= 0 added to the denominator.

    The state, taken (``initial_state``) and returned (``return_state=True``: (o, state)), is that of the
    ones column: one array (batch, heads, d', d_v + 1) holding S in ``state[..., :d_v]`` and z in
    ``state[..., d_v]``. So a sequence split in two gives the outputs of one call::

        o1, state = normalized_attention(q1, k1, v1, decay, return_state=True)
        o2 = normalized_attention(q2, k2, v2, decay, initial_state=state)

    The denominator is positive only for a positive map. With "identity" (or any map with negative values)
    phi(q_t) . z_t can be 0 or negative: the output is then inf, NaN or of flipped sign. Nothing is
    clamped: eps > 0 moves the pole, it does not remove it. "relu2" and LearnedReLU2 can give phi(q) = 0
    (every projection negative): o_t = 0 / eps = 0, or NaN with eps = 0.

    dtypes: "numpy" returns float64; "torch" and "triton" return o in v's dtype (16-bit inputs are divided in
    float32, then rounded) and the state as :func:`lightning_attention` returns it. Unsupported, each
    refused with a TypeError or ValueError that names the argument: everything :func:`lightning_attention`
    refuses for phi(q), phi(k) and [v | 1] (so "triton" needs d', d_v + 1 <= 256), an unknown map name, a
    callable whose output has another kind, dtype, device or leading shape, phi(k) of another d' than
    phi(q), a torch module with numpy arrays, eps negative or not finite.
    """
    args, feature_map, eps, return_state = validate_normalized_args(q, k, v, decay, feature_map, eps, backend,
                                                                    return_state)
    phi_q, phi_k, d_feature = feature_maps.apply_feature_map(feature_map, args.q, args.k, args.kind)
    validate_augmented_state("initial_state", initial_state, (args.batch, args.heads, d_feature, args.d_v + 1),
                             args.kind, args.q)
    out, state = lightning_attention(phi_q, phi_k, feature_maps.append_ones(args.v), decay, backend=args.backend,
                                     initial_state=initial_state, return_state=True)
    o = feature_maps.divide_by_normaliser(out, eps)
    return (o, state) if return_state else o


def normalized_attention_step(q, k, v, state=None, decay=1.0, *, feature_map="elu+1", eps: float = 1e-6,
                              backend: str = "auto"):
    """One decoding step of :func:`normalized_attention`: the token's key and value enter the state first,
    then its query reads it. (Chapter 11.)

    q, k: (batch, heads, d_k); v: (batch, heads, d_v); state: [S | z] of shape (batch, heads, d', d_v + 1)
    as :func:`normalized_attention` returns it, None meaning zeros. Returns (o, new_state) with
    ``new_state = lambda state + phi(k)^T [v | 1]`` and ``o = phi(q) S_new / (phi(q) . z_new + eps)``: a
    prefill with ``return_state=True`` followed by one step per token gives the outputs of one call.
    Runs :func:`lightning_attention_step` on phi(q), phi(k), [v | 1]; arguments are checked as there and
    as in :func:`normalized_attention`. On "torch" and "triton" autograd flows through the division, the feature
    map (a module's parameters too) and the step to q, k, v, the state and a decay tensor that requires grad.
    """
    args, feature_map, eps, _ = validate_normalized_args(q, k, v, decay, feature_map, eps, backend, False,
                                                         step=True)
    phi_q, phi_k, d_feature = feature_maps.apply_feature_map(feature_map, args.q, args.k, args.kind)
    validate_augmented_state("state", state, (args.batch, args.heads, d_feature, args.d_v + 1), args.kind, args.q)
    out, new_state = lightning_attention_step(phi_q, phi_k, feature_maps.append_ones(args.v), state, decay,
                                              backend=args.backend)
    return feature_maps.divide_by_normaliser(out, eps), new_state


def hybrid_attention(q, k, v, decay=1.0, *, block_size: int, feature_map="elu+1", scale: float | None = None,
                     backend: str = "auto"):
    r"""Causal softmax inside each block, linear attention to the earlier blocks, one joint normaliser.
    (Chapter 11.)

    Row t of block [c, c + B) gives every key an unnormalised weight and divides by their one sum:

    .. math::

        o_t = \frac{\sum_{c \le s \le t} e^{s_{ts}} v_s + \sum_{s < c} \lambda^{t-s}\,\phi(q_t)\cdot\phi(k_s)\, v_s}
                   {\sum_{c \le s \le t} e^{s_{ts}} + \sum_{s < c} \lambda^{t-s}\,\phi(q_t)\cdot\phi(k_s)},
        \qquad s_{ts} = \text{scale}\; q_t \cdot k_s + (t - s) \log\lambda .

    The linear part is read off the state of [v | 1] entering the block, lambda^(t-c+1) phi(q_t) [S | z],
    as in :func:`lightning_attention`. The exponential and phi(q) . phi(k) stand on the same footing: both are
    unnormalised similarities, and the row's weights sum to 1 over both parts together (the explainer's
    chunked module normalises each part on its own and adds them, so its rows sum to 2: see
    :func:`lightning_edu.errata.explainer_hybrid_separate`).

    Decay: every weight, in the block or before it, carries lambda^(t-s). Inside the block that is the score
    bias (t - s) log lambda (an ALiBi-like bias); at lambda = 1 it vanishes. With ``block_size >= n`` and
    lambda = 1 this is causal softmax attention exactly (to rounding); with ``block_size=1`` it is normalized
    linear attention over the earlier tokens, the token itself weighted by e^{s_tt} instead of phi(q_t) . phi(k_t).

    Evaluated without overflow (:func:`lightning_edu.feature_maps.joint_normalise`): with m_t the row's
    largest in-block score, a_t the size of the linear part (max of |denominator part| and |numerator
    part|) and M_t = max(m_t, log a_t), numerator and denominator are both multiplied by e^{-M_t}; every
    exponent is then <= 0, and q, k scaled by 100 still give finite outputs. A map that is not positive
    ("identity") can make the denominator 0 or negative, as in :func:`normalized_attention`.

    q, k: (batch, heads, n, d_k); v: (batch, heads, n, d_v); decay a float or one per head; ``block_size``
    any positive integer (it need not divide n); ``feature_map`` as in :func:`normalized_attention`;
    ``scale`` default d_k^-0.5. Backends: "numpy" (float64, block by block), "torch" (all blocks at once,
    differentiable by autograd, decay included; float16/bfloat16 compute in float32, o in v's dtype);
    "auto" picks numpy for arrays and torch for any tensor, CUDA ones included. "triton" is refused with a
    ValueError: no Lightning Attention kernel computes the in-block softmax. Returns o (batch, heads, n, d_v).
    """
    args, block_size, scale = validate_hybrid_args(q, k, v, decay, block_size, scale, backend)
    feature_map = validate_feature_map(feature_map, args.kind)
    phi_q, phi_k, _ = feature_maps.apply_feature_map(feature_map, args.q, args.k, args.kind)
    impl = feature_maps.hybrid_numpy if args.backend == "numpy" else feature_maps.hybrid_torch
    return impl(args, phi_q, phi_k, block_size, scale)
