"""One decoding step in Triton: a new token per sequence against the carried state, no KV cache. (Chapter 10.)

Per (batch, head), with the state S (d_k x d_v, fp32) carried from the tokens so far:

    S' = lambda S + k^T v        (an outer product: d_k x d_v multiply-adds)
    o  = q S'                    (d_k x d_v multiply-adds)

A step reads S once and writes S' once: 2 d_k d_v * 4 bytes per head against 4 d_k d_v FLOPs, one FLOP per
two bytes, so the step is bound by memory, never by the tensor cores. The kernel is elementwise work and a
reduction over d_k; it has no tl.dot, so it runs for any head dims in the CPU interpreter as on a GPU. One
launch covers every (batch, head) and a slice of BLOCK_DV columns of the state; q, k and v may be fp32, fp16
or bf16 (upcast after loading), the state stays fp32.

The backend's step, :func:`step_kernels`, is also the custom op ``lightning_edu::decode_step``::

    lightning_edu::decode_step(Tensor q, Tensor k, Tensor v, Tensor? state, Tensor log2_decay)
                               -> (Tensor o, Tensor new_state)

with a fake (the outputs' shapes and dtypes, for torch.compile and meta tensors) and a registered backward in
float32 torch ops (a step's gradients are a handful of outer and matrix-vector products, as memory-bound as the
step: no kernel of their own). The hook calls the op only when a gradient can follow or under torch.compile,
and the kernel's launch alone otherwise: a decoding loop pays nothing for the dispatcher.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._tiles import aligned, dense, head_start, launch_keyed, refuse_interpreted_bf16, upcast_for_interpreter
from .plan import cdiv, interpreted, pad_dim

__all__ = ["decode_step", "step_kernels", "decode_op"]


@triton.jit(do_not_specialize=["H"])
def _decode_kernel(Q, K, V, S, S_OUT, O, LOG2_DECAY, H,
                   D_K: tl.constexpr, D_V: tl.constexpr, PAD_K: tl.constexpr, BLOCK_DV: tl.constexpr,
                   HAS_STATE: tl.constexpr):
    """Grid (batch*heads, cdiv(d_v, BLOCK_DV)). Q, K: (batch*heads, d_k); V, O: (batch*heads, d_v);
    S, S_OUT: (batch*heads, d_k, d_v) fp32 (S may be S_OUT: each program reads its slice before writing it)."""
    bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_k = tl.arange(0, PAD_K)
    offs_v = pid_v * BLOCK_DV + tl.arange(0, BLOCK_DV)
    k_ok = offs_k < D_K
    v_ok = offs_v < D_V
    state_ok = k_ok[:, None] & v_ok[None, :]
    state_offs = offs_k[:, None] * D_V + offs_v[None, :]
    S += head_start(bh, D_K, D_V)
    S_OUT += head_start(bh, D_K, D_V)
    q = tl.load(Q + bh * D_K + offs_k, mask=k_ok, other=0.0).to(tl.float32)              # (d_k,)
    k = tl.load(K + bh * D_K + offs_k, mask=k_ok, other=0.0).to(tl.float32)              # (d_k,)
    v = tl.load(V + bh * D_V + offs_v, mask=v_ok, other=0.0).to(tl.float32)              # (BLOCK_DV,)
    s = k[:, None] * v[None, :]                                                          # (d_k, BLOCK_DV): k^T v
    if HAS_STATE:
        lam = tl.exp2(tl.load(LOG2_DECAY + bh % H))
        s += lam * tl.load(S + state_offs, mask=state_ok, other=0.0)
    # Padded rows (d_k < PAD_K) hold 0 in q, k and S: they add nothing to the sum over d_k.
    o = tl.sum(q[:, None] * s, axis=0)                                                   # (BLOCK_DV,): q S'
    tl.store(S_OUT + state_offs, s, mask=state_ok)
    tl.store(O + bh * D_V + offs_v, o.to(O.dtype.element_ty), mask=v_ok)


def decode_step(q, k, v, state, log2_decay, out_state=None, block_v: int | None = None, num_warps: int = 4):
    """(o, new_state) of one step. q, k: (batch, heads, d_k); v: (batch, heads, d_v); state: (batch, heads, d_k,
    d_v) or None (zeros); log2_decay: float32 (heads,). o has q's dtype; new_state is float32, written into
    ``out_state`` when given (which may be ``state`` itself: an in-place step for a decode loop).
    bfloat16 is refused in the CPU interpreter (TypeError): its bf16 arithmetic is wrong.

    A decoding loop launches this kernel once per token and layer with the same shapes, so the launch names its
    specialisation itself (:func:`~._tiles.launch_keyed`, keyed by dtypes, alignments, head dims and tiles) and
    the tiles of a (d_k, d_v) are chosen once (:func:`_step_tiles`)."""
    if interpreted(q):
        refuse_interpreted_bf16("decode_step", q, k, v)
    batch, heads, d_k = q.shape
    d_v = v.shape[-1]
    q, k, v = dense(q), dense(k), dense(v)
    if state is not None:
        state = dense(state.float())
    if out_state is None:
        out_state = torch.empty(batch, heads, d_k, d_v, device=q.device, dtype=torch.float32)
    o = torch.empty(batch, heads, d_v, device=q.device, dtype=q.dtype)
    if q.is_meta:  # a model traced on the meta device: the outputs' shapes and dtypes, nothing to launch
        return o, out_state
    pad_k, block_v, blocks_v = _step_tiles(d_k, d_v, block_v)
    has_state = state is not None
    # Everything the launch specialises on: q, k, v and state are dense (aligned), o is fresh (aligned); heads is
    # not specialised (do_not_specialize) but its width and whether it is 1 are named anyway.
    key = (_decode_kernel, q.dtype, k.dtype, v.dtype, out_state.dtype, aligned(out_state), log2_decay.dtype,
           aligned(log2_decay), heads == 1, heads < 2**31, d_k, d_v, pad_k, block_v, has_state, num_warps)
    launch_keyed(key, _decode_kernel, (batch * heads, blocks_v), q, k, v, state if has_state else out_state,
                 out_state, o, log2_decay, heads, D_K=d_k, D_V=d_v, PAD_K=pad_k, BLOCK_DV=block_v,
                 HAS_STATE=has_state, num_warps=num_warps)
    return o, out_state


@functools.cache
def _step_tiles(d_k: int, d_v: int, block_v: int | None) -> tuple[int, int, int]:
    """(PAD_K, BLOCK_DV, programs along d_v) of a step: a slice of the state per program, at most 8K fp32 values
    (32 KB) in registers."""
    pad_k = pad_dim(d_k)
    block_v = block_v or max(16, min(pad_dim(d_v), 8192 // pad_k))
    return pad_k, block_v, cdiv(d_v, block_v)


def step_kernels(q, k, v, state, log2_decay):
    """(o in v's dtype, new_state float32) of one step of the backend, by one launch of the kernel: what
    ``lightning_attention_step(..., backend="triton")`` runs. q, k, v: (batch, heads, d) as validated (any strides:
    copied when not dense); state (batch, heads, d_k, d_v) of any float dtype, or None; log2_decay (heads,), read by
    the kernel as float32 (a float64 one, a learnable decay's, is rounded first).
    In the CPU interpreter bfloat16 q, k, v are computed in float32 and o rounded to bfloat16 (its bf16 arithmetic is
    wrong). Called directly when no gradient can follow (the decoding loop: nothing but the launch), through the
    op :func:`decode_op` otherwise."""
    qc, kc, vc = upcast_for_interpreter(q, k, v) if interpreted(q) else (q, k, v)
    if log2_decay.dtype != torch.float32:
        log2_decay = log2_decay.float()
    o, new_state = decode_step(qc, kc, vc, state, dense(log2_decay))
    return (o if o.dtype == v.dtype else o.to(v.dtype)), new_state


@torch.library.custom_op("lightning_edu::decode_step", mutates_args=())
def decode_op(q: Tensor, k: Tensor, v: Tensor, state: Tensor | None, log2_decay: Tensor) -> tuple[Tensor, Tensor]:
    """(o in v's dtype, new_state float32): :func:`step_kernels` as one node of an autograd or compiled graph."""
    return step_kernels(q, k, v, state, log2_decay)


@decode_op.register_fake
def _decode_op_fake(q, k, v, state, log2_decay):
    batch, heads, d_k = q.shape
    d_v = v.shape[-1]
    return v.new_empty((batch, heads, d_v)), q.new_empty((batch, heads, d_k, d_v), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, state, log2_decay = inputs
    ctx.set_materialize_grads(False)  # an unused o or new state costs nothing
    ctx.save_for_backward(q, k, v, state, log2_decay, output[1])


def _decode_backward(ctx, do, d_new):
    """The step's gradients in torch ops, in float32 (the state's dtype). With S' = lambda S + k^T v and o = q S',
    G = dL/dS' + q^T dL/do (the new state reaches the loss directly and through o) gives dq = dL/do S'^T,
    dk = G v^T, dv = k G, d state = lambda G and dL/dlambda = sum(S * G) over batch, d_k and d_v; exact, as the
    torch step's autograd is, and differentiable again (S' is the op's own output, q, k, v the inputs)."""
    q, k, v, state, log2_decay, new_state = ctx.saved_tensors
    needs = ctx.needs_input_grad
    if do is None and d_new is None:
        return None, None, None, None, None
    qf, kf, vf = (x.float() for x in (q, k, v))
    grad = d_new.float() if d_new is not None else None
    if do is not None:
        from_o = qf[..., :, None] * do.float()[..., None, :]  # q^T dL/do, (batch, heads, d_k, d_v)
        grad = from_o if grad is None else grad + from_o
    dq = (new_state @ do.float()[..., :, None])[..., 0].to(q.dtype) if needs[0] and do is not None else None
    dk = (grad @ vf[..., :, None])[..., 0].to(k.dtype) if needs[1] else None
    dv = (kf[..., None, :] @ grad)[..., 0, :].to(v.dtype) if needs[2] else None
    d_state = d_log2 = None
    if state is not None and needs[3]:
        lam = torch.exp2(log2_decay.float())[None, :, None, None]  # the kernel's lambda, exp2 of the float32 log2
        d_state = (lam * grad).to(state.dtype)
    if state is not None and needs[4]:  # dL/d log2(lambda) = ln 2 lambda dL/dlambda, the factor in float64
        d_lam = (state.float() * grad).sum(dim=(0, 2, 3))
        d_log2 = (d_lam.double() * torch.exp2(log2_decay.double()) * math.log(2.0)).to(log2_decay.dtype)
    return dq, dk, dv, d_state, d_log2


decode_op.register_autograd(_decode_backward, setup_context=_setup_context)
