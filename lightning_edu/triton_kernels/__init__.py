"""Rung 3: Triton kernels, and the "triton" backend of :func:`lightning_edu.lightning_attention`.

Variants (each correct, each measured in chapters 07-10, by ``python -m benchmarks.bench`` or, for la2_tma
and the one pass, ``python -m benchmarks.tma`` and ``benchmarks.lookback``):

============  ======================================================================  ==========
variant       what                                                                    module
============  ======================================================================  ==========
la1           Lightning Attention-1: tiled masked left product, O(n^2 d)              ``la1``
la2_literal   Algorithms 1-2 as written: one program per (batch, head[, d slice])     ``la2_literal``
la2_fast      segments + 16-bit dots + backward as reversed forwards (the backend)    ``la2_fast``
la3           la2_fast's forward; dK, dV from micro-chunk tiles in one reverse sweep  ``la3``
la2_tma       la2_fast's forward, tiles loaded and stored by the TMA (descriptors)    ``la2_tma``
one pass      the forward in one kernel: segments hand states on (measured slower)    ``lookback``
============  ======================================================================  ==========

The backend (la2_fast's forward, la3's or la2_fast's backward by :func:`backward_kernel`; at 64 < d <= 128 on
Hopper GPUs, in calls of 2^18 rows or more, the passes in time order load their tiles through la2_tma's
descriptors) runs through two
``torch.library`` custom ops, ``lightning_edu::la2_forward`` and ``lightning_edu::la2_backward`` (:mod:`.ops`),
so that :func:`torch.compile` captures a model calling it without a graph break.

On a machine without CUDA, importing :mod:`lightning_edu` sets ``TRITON_INTERPRET=1`` first, so these
kernels run in Triton's CPU interpreter. Its bf16 arithmetic is wrong (values ~1e10 where ~1e2 is right), so
there the low-level launchers refuse bfloat16 tensors with a TypeError, while the *backend*
(``lightning_attention(..., backend="triton")``) upcasts bfloat16 inputs to float32, computes, and returns
bfloat16 outputs and gradients. On CUDA, bfloat16 runs in the kernels as it is.

Non-finite inputs stay causal in every kernel: a NaN or inf reaches exactly the outputs that depend on it.
Each kernel runs a fast pass that flags the programs where a non-finite value showed up, then an exact pass
over those programs only (masks that select, a sanitised operand: see ``_tiles``). Against single-pass kernels
the second pass costs little where a call is long; where a call is short (d <= 64) its extra launches weigh
(chapter 14, section 14.2). So the backend's kernels with 16-bit tiles at d <= 64 run the exact pass in the fast kernel's own
program, right after its sweep, when its flag is set (``plan.redo_in_place``): three launches fewer per
forward + backward.
"""

from __future__ import annotations

import math
import weakref

import numpy as np
import torch

from ..validation import device_decay
from . import ops
from .ops import VARIANTS, EagerLA2, la2_backward, la2_forward
from .plan import backward_kernel, kernel_config, tiles_for

__all__ = ["VARIANTS", "triton_attention", "autograd_log2_decay",
           "la2_forward", "la2_backward", "kernel_config", "tiles_for", "backward_kernel",
           "log2_decay_tensor"]




_LOG2_DECAY: dict = {}  # (device, log2 values) -> the device tensor, built once
_LOG2_OF_TENSOR: dict = {}  # (id, data_ptr, version, device) of a decay tensor -> (weakref to it, its log2)


def _log2_of_tensor(decay: torch.Tensor, device) -> torch.Tensor:
    return torch.log2(device_decay(decay, device, torch.float64)).to(torch.float32)


def log2_decay_tensor(decay, device) -> torch.Tensor:
    """log2(lambda) per head as float32 on ``device`` (0 exactly for lambda = 1).

    From a sequence of lambdas on the host: built once per (device, values) and then reused, since copying a
    host list to a GPU makes the host wait for the work already queued there, and a copy on every call would
    keep the host from running ahead of the GPU. The cached tensor is read-only by contract (the kernels only
    load it). From a torch tensor (as validated: on a GPU, or requiring grad): computed on its device, in
    float64 and rounded once (a float32 lambda near 1 would lose its last digits in a float32 log), keeping
    the autograd graph; a lambda outside (0, 1] gives NaN (:func:`lightning_edu.validation.device_decay`).
    A tensor that requires no grad is computed once per version: the same tensor, unchanged since (same
    storage, no in-place write), gets the same result back, computed on the device without a host read.

    Under :func:`torch.compile` the host lambdas are values of the traced graph (dynamo turns numpy arrays into
    tensors), not Python floats: there they are converted with torch ops, uncached, which the compiler keeps
    in the graph instead of a cache lookup it cannot trace.
    """
    if torch.compiler.is_compiling() and not isinstance(decay, torch.Tensor):
        return torch.log2(torch.as_tensor(decay, dtype=torch.float64)).to(device=device, dtype=torch.float32)
    if torch.is_tensor(decay):
        if (torch.compiler.is_compiling() or type(decay) is not torch.Tensor or decay.requires_grad
                or decay.is_inference() or (decay.is_cuda and torch.cuda.is_current_stream_capturing())):
            # traced, a subclass, part of the autograd graph or of a CUDA graph being captured, or an inference
            # tensor (which has no version counter): computed afresh
            return _log2_of_tensor(decay, device)
        # A decay buffer (a model's fixed lambdas) is passed again on every call: its log2 is computed once per
        # version of it (an in-place change bumps ``_version``), which saves a handful of small launches per call.
        key = (id(decay), decay.data_ptr(), decay._version, torch.device(device))
        hit = _LOG2_OF_TENSOR.get(key)
        if hit is not None and hit[0]() is decay:
            return hit[1]
        if len(_LOG2_OF_TENSOR) >= 256:
            _LOG2_OF_TENSOR.clear()
        out = _log2_of_tensor(decay, device)
        _LOG2_OF_TENSOR[key] = (weakref.ref(decay), out)
        return out
    # Looked up by the bytes of the lambdas as float64 (for what validation hands over, a float64 array, that is
    # one call), not value by value in Python.
    values = np.asarray(decay, dtype=np.float64)
    key = (device if type(device) is torch.device else torch.device(device), values.tobytes())
    cached = _LOG2_DECAY.get(key)
    if cached is None:
        if len(_LOG2_DECAY) >= 256:  # a model has a few decay vectors; a sweep over many starts again
            _LOG2_DECAY.clear()
        log2 = [math.log2(x) for x in values.tolist()]
        cached = _LOG2_DECAY[key] = torch.tensor(log2, dtype=torch.float32, device=device)
    return cached


def autograd_log2_decay(decay, device) -> torch.Tensor:
    """log2(lambda) per head for a call autograd may differentiate: :func:`log2_decay_tensor`'s float32, except for
    a decay that requires grad (with grad mode on), whose log2 stays float64 in the graph. The kernels read it
    rounded to float32, as ever; the gradient that comes back through it, d/d(log2 lambda) = ln 2 lambda
    dL/dlambda, is subnormal in float32 for a float32 lambda near its smallest values (1e-45 .. 1e-37) and would
    lose most of its digits there."""
    if torch.is_tensor(decay) and decay.requires_grad and torch.is_grad_enabled():
        return torch.log2(device_decay(decay, device, torch.float64))
    return log2_decay_tensor(decay, device)


def triton_attention(q, k, v, decay, initial_state=None, block_size=None):
    """(o, final_state) by the Triton backend; ``decay`` is a sequence of per-head lambdas (or a tensor).

    One call of the custom op ``lightning_edu::la2_forward`` (:mod:`.ops`), differentiable through its
    registered backward, and a single node to :func:`torch.compile`; called eagerly on plain tensors, the same
    forward and backward run as an autograd Function (:class:`.ops.EagerLA2`), which skips the dispatcher; and
    an eager call that no gradient can follow (grad mode off, or no input requiring one: inference) runs the
    forward's kernels alone (:func:`.ops.forward_impl`), without a Function around them: the Function's own host
    time per call is a cost a short inference call need not pay.
    o has v's dtype, final_state is float32.
    bfloat16 inputs off CUDA (the CPU interpreter) are computed in float32 and o is returned as bfloat16;
    gradients flow back to the bfloat16 leaves as bfloat16. The forward keeps its segment states for the backward
    only when a gradient can be asked for (grad mode on and an input requiring one).
    A decay that requires grad gets its log2 in float64 (:func:`autograd_log2_decay`)."""
    log2_decay = autograd_log2_decay(decay, q.device)
    inputs = (q, k, v, log2_decay, initial_state)
    save = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)
    if torch.compiler.is_compiling() or q.is_meta or not all(x is None or type(x) in _PLAIN for x in inputs):
        o, sn, _ = la2_forward(q, k, v, log2_decay, initial_state, block_size, save)  # the custom op
    elif save:  # eager, plain tensors: the same code without the dispatcher's cost (:class:`.ops.EagerLA2`)
        o, sn, _ = EagerLA2.apply(q, k, v, log2_decay, initial_state, block_size, save)
    else:  # and with no gradient to follow, without the Function's either
        o, sn, _ = ops.forward_impl(q, k, v, log2_decay, initial_state, block_size, save)
    return o, sn


_PLAIN = (torch.Tensor, torch.nn.Parameter)

