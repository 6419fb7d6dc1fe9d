"""Registry hooks of the Triton rung: checked arguments in, kernels launched, (o, final_state) out.

Every Triton implementation in :mod:`lightning_edu.registry` runs through one of these. They take an
:class:`~lightning_edu.validation.AttentionArgs` (a :class:`~lightning_edu.validation.StepArgs` for the
decoding step) that validation has already checked, make the tensors contiguous (except the differentiable backend,
``la2_fast_from_args`` with its default options, which reads strided views in place), and, in Triton's CPU
interpreter (no CUDA), compute bfloat16 inputs in float32 and round the results back (the interpreter's own
bf16 arithmetic is wrong); on a GPU bf16 runs in the kernels as it is.

Each hook names the options it takes as keyword-only parameters (most take none); the registry passes a hook only
the options it declares and refuses any other (:meth:`~lightning_edu.registry.Implementation.options_for`).
"""

from __future__ import annotations

import torch

from . import autograd_log2_decay, log2_decay_tensor, triton_attention
from ._tiles import dense, upcast_for_interpreter
from .decode import decode_op, step_kernels
from .la1 import la1_backward, la1_forward
from .la2_fast import la2_fast_backward, la2_fast_forward
from .la2_literal import la2_literal_backward, la2_literal_forward
from .la3 import la3_backward
from .plan import cdiv, tiles_for

__all__ = [
    "la1_from_args", "la1_backward_from_args", "la2_literal_from_args", "la2_literal_backward_from_args",
    "la2_fast_from_args", "la2_fast_backward_from_args", "la3_backward_from_args", "one_pass_from_args",
    "tma_from_args",
    "decode_from_args",
]


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # the tensors that run the launchers eagerly; subclasses go through ops


def _tensors(*xs):
    """Contiguous and aligned (:func:`~._tiles.dense`), and float32 where a bfloat16 tensor would meet the CPU
    interpreter."""
    return upcast_for_interpreter(*(dense(x) for x in xs))


def _back(x, like):
    return x.to(like.dtype)


def la1_from_args(args):
    """LA-1 forward: (o, None); it has no state."""
    q, k, v = _tensors(args.q, args.k, args.v)
    return _back(la1_forward(q, k, v, args.decay, args.block_size), args.v), None


def la1_backward_from_args(args, d_final_state=None):
    q, k, v, do = _tensors(args.q, args.k, args.v, args.do)
    dq, dk, dv = la1_backward(q, k, v, do, args.decay, args.block_size)
    return _back(dq, args.q), _back(dk, args.k), _back(dv, args.v), None


def la2_literal_from_args(args):
    q, k, v = _tensors(args.q, args.k, args.v)
    o, sn = la2_literal_forward(q, k, v, log2_decay_tensor(args.decay, q.device), args.initial_state,
                                block=args.block_size or 64)
    return _back(o, args.v), sn


def la2_literal_backward_from_args(args, d_final_state=None):
    q, k, v, do = _tensors(args.q, args.k, args.v, args.do)
    dq, dk, dv, ds0 = la2_literal_backward(q, k, v, do, log2_decay_tensor(args.decay, q.device), args.initial_state,
                                           d_final_state, block=args.block_size or 64)
    return _back(dq, args.q), _back(dk, args.k), _back(dv, args.v), ds0


def _la2_fast_config(q, v, block_size, segments: bool, fused_dkdv: bool) -> tuple[dict, dict]:
    """(la2_fast's tiles for q (batch, heads, n, d_k) and v, the backward's extra options) of a variant."""
    cfg = tiles_for(q, v, block_size)
    if not segments:  # one segment: the whole sequence, in whole blocks
        cfg["seg_len"] = cdiv(q.shape[2], cfg["block"]) * cfg["block"]
    backward_only = dict(fused_dkdv=True, dkdv_block=64, dkdv_warps=8) if fused_dkdv else {}
    return cfg, backward_only


def la2_fast_from_args(args, *, segments: bool = True, reuse_states: bool = True, fused_dkdv: bool = False):
    """The backend's kernels. With the default options this is the differentiable backend
    (:func:`~lightning_edu.triton_kernels.triton_attention`), whose forward keeps the segment states for its
    autograd backward when a gradient can follow. Any other option launches la2_fast's forward here, on
    :func:`~.plan.tiles_for`'s tiles, keeping no states: ``segments`` False (one segment),
    ``fused_dkdv`` True (the variant whose backward fuses dK and dV), ``reuse_states`` False (nothing else
    changed: the states a backward could reuse are not kept). The backward hook,
    :func:`la2_fast_backward_from_args`, is never handed saved states and always recomputes them, so it takes no
    ``reuse_states``."""
    if segments and reuse_states and not fused_dkdv:
        return triton_attention(args.q, args.k, args.v, args.decay, args.initial_state, args.block_size)
    q, k, v = _tensors(args.q, args.k, args.v)
    cfg, _ = _la2_fast_config(q, args.v, args.block_size, segments, fused_dkdv)
    o, sn = la2_fast_forward(q, k, v, log2_decay_tensor(args.decay, q.device), args.initial_state, **cfg)
    return _back(o, args.v), sn


def la2_fast_backward_from_args(args, d_final_state=None, *, segments: bool = True, fused_dkdv: bool = False):
    """The backend's backward kernels, or their sub-variants' (see :func:`la2_fast_from_args`): the backward of
    :func:`lightning_edu.lightning_attention_backward`. Eager calls on plain tensors run the launchers here
    (:func:`_fast_backward`); under :func:`torch.compile`, on meta tensors (a model traced on the meta device, no
    data) and on other tensor subclasses the same code runs as the custom op ``lightning_edu::la2_fast_backward``
    (:func:`fast_backward_op`), one node to Dynamo, whose fake gives the gradients' shapes and dtypes."""
    inputs = (args.q, args.k, args.v, args.do, args.initial_state, d_final_state)
    log2_decay = log2_decay_tensor(args.decay, args.q.device)
    if torch.compiler.is_compiling() or args.q.is_meta or not all(x is None or type(x) in _PLAIN for x in inputs):
        return fast_backward_op(args.q, args.k, args.v, args.do, log2_decay, args.initial_state, d_final_state,
                                args.block_size, segments, fused_dkdv)
    return _fast_backward(args.q, args.k, args.v, args.do, log2_decay, args.initial_state, d_final_state,
                          args.block_size, segments, fused_dkdv)


def _fast_backward(q, k, v, do, log2_decay, initial_state, d_final_state, block_size, segments, fused_dkdv):
    """(dq, dk, dv in the dtypes of q, k, v, d_initial_state fp32) by la2_fast_backward, without saved states: its
    own pre-pass gives the segment states (the forward's are not at hand). The gradients are contiguous."""
    qc, kc, vc, doc = _tensors(q, k, v, do)
    cfg, extra = _la2_fast_config(qc, v, block_size, segments, fused_dkdv)
    dq, dk, dv, ds0 = la2_fast_backward(qc, kc, vc, doc, log2_decay, initial_state, d_final_state, **cfg, **extra)
    return _back(dq, q), _back(dk, k), _back(dv, v), ds0


@torch.library.custom_op("lightning_edu::la2_fast_backward", mutates_args=())
def fast_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, log2_decay: torch.Tensor,
                     initial_state: torch.Tensor | None, d_final_state: torch.Tensor | None, block_size: int | None,
                     segments: bool, fused_dkdv: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_fast_backward` as an op (no autograd: the gradients it returns have no backward of their own)."""
    return _fast_backward(q, k, v, do, log2_decay, initial_state, d_final_state, block_size, segments, fused_dkdv)


@fast_backward_op.register_fake
def _fast_backward_fake(q, k, v, do, log2_decay, initial_state, d_final_state, block_size, segments, fused_dkdv):
    batch, heads, _, d_k = q.shape
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((batch, heads, d_k, v.shape[-1]), dtype=torch.float32))


def la3_backward_from_args(args, d_final_state=None, *, chunk: int | None = None, micro: int | None = None,
                            dkdv_warps: int | None = None, dkdv_stages: int | None = None):
    """The recompute-heavy backward (its forward is la2_fast's); the options set its dK/dV kernel's tiles, None
    for :func:`~.plan.la3_tiles`'s."""
    q, k, v, do = _tensors(args.q, args.k, args.v, args.do)
    cfg, _ = _la2_fast_config(q, args.v, args.block_size, True, False)
    dq, dk, dv, ds0 = la3_backward(q, k, v, do, log2_decay_tensor(args.decay, q.device), args.initial_state,
                                   d_final_state, **cfg, chunk=chunk, micro=micro, dkdv_warps=dkdv_warps,
                                   dkdv_stages=dkdv_stages)
    return _back(dq, args.q), _back(dk, args.k), _back(dv, args.v), ds0


def one_pass_from_args(args, *, lookback: bool = True):
    """The forward in one pass (chapter 07): the decoupled look-back, or with ``lookback`` False the chained scan;
    the backend's tiles, segments of 8 blocks."""
    from .lookback import lookback_forward

    q, k, v = _tensors(args.q, args.k, args.v)
    o, sn = lookback_forward(q, k, v, log2_decay_tensor(args.decay, q.device), args.initial_state, lookback=lookback,
                             block=args.block_size)
    return _back(o, args.v), sn


def tma_from_args(args):
    """la2_fast's forward with descriptor loads in its main kernel (chapter 07), on the backend's tiles."""
    from .la2_tma import la2_tma_forward

    q, k, v = _tensors(args.q, args.k, args.v)
    o, sn = la2_tma_forward(q, k, v, log2_decay_tensor(args.decay, q.device), args.initial_state, block=args.block_size)
    return _back(o, args.v), sn


def decode_from_args(args):
    """One decoding step (a :class:`~lightning_edu.validation.StepArgs`): (o in v's dtype, new_state float32).

    With no gradient to follow (grad mode off, or nothing requiring one: a decoding loop), the kernel's launch
    alone (:func:`~.decode.step_kernels`). Otherwise, and under :func:`torch.compile` or for tensor subclasses,
    the custom op ``lightning_edu::decode_step`` (:func:`~.decode.decode_op`), whose registered backward gives
    the gradients of q, k, v, the state and a learnable decay."""
    inputs = (args.q, args.k, args.v, args.state, autograd_log2_decay(args.decay, args.q.device))
    return decode_op(*inputs) if _needs_op(inputs) else step_kernels(*inputs)


def _needs_op(inputs) -> bool:
    """Whether a step goes through its op: under torch.compile, for a tensor subclass, or when a gradient can follow
    (grad mode on and an input requiring one). One pass over the inputs: this runs before every decoding step."""
    if torch.compiler.is_compiling():
        return True
    grad = torch.is_grad_enabled()
    for x in inputs:
        if x is not None and (type(x) not in _PLAIN or grad and x.requires_grad):
            return True
    return False
