"""Packed variable-length batches: several sequences of different lengths in one call. (Chapter 10.)

Serving and training both meet batches of unequal sequences. Padding them to one length wastes work; packing
them end to end on one batch row wastes none, as long as each sequence starts from its own state. The
boundaries come as ``cu_seqlens`` (cumulative lengths): sequence i holds packed rows
``cu_seqlens[i] : cu_seqlens[i + 1]``, the convention of flash-attn and fla.

The one bug to avoid is a leak: the state at the end of sequence i carried into sequence i + 1 (or a block
that straddles a boundary mixing the two). Here every sequence runs through the backend on its own slice
of the packed tensors, from its own initial state, so no state or block crosses a boundary by construction;
the outputs are written back in the packed order and the final states stacked per sequence. The slices are
views and the pieces are joined with ``torch.cat``, so autograd flows through the torch and triton
backends. Each sequence costs its own kernel launches: simple and exact, not the fastest on GPUs with
many short sequences (a kernel that reads the boundaries itself is the fast way, and the next step).
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["packed_forward", "packed_backward", "sequence_args"]


def sequence_args(args, i: int, d_final_state=None):
    """The checked arguments of packed sequence ``i`` alone (batch 1), and its d_final_state slice."""
    start, end = args.cu_seqlens[i], args.cu_seqlens[i + 1]
    rows = slice(start, end)
    pick = lambda x: None if x is None else x[:, :, rows]  # noqa: E731
    state = lambda x: None if x is None else x[i : i + 1]  # noqa: E731
    one = dataclasses.replace(args, q=args.q[:, :, rows], k=args.k[:, :, rows], v=args.v[:, :, rows],
                              do=pick(args.do), initial_state=state(args.initial_state), seq_len=end - start,
                              cu_seqlens=None)
    return one, state(d_final_state)


def _lib(args):
    if args.kind == "numpy":
        return np, np.concatenate, np.stack
    import torch

    return torch, torch.cat, torch.stack


def _stack_states(args, states, passed_through):
    """Stack per-sequence states; a sequence with no tokens (None) takes ``passed_through[i]`` unchanged
    (its initial state forward, its final-state gradient backward), or zeros, in the other states' dtype."""
    lib, _, stack = _lib(args)
    like = next(s for s in states if s is not None)
    for i, s in enumerate(states):
        if s is None:
            if passed_through is None:
                states[i] = lib.zeros_like(like)
            elif args.kind == "numpy":
                states[i] = np.asarray(passed_through[i], dtype=like.dtype)
            else:
                states[i] = passed_through[i].to(like.dtype)
    return stack(states, 0)


def packed_forward(impl, args):
    """(o, final states) of a packed call: o (1, heads, total, d_v), states (num_seqs, heads, d_k, d_v)."""
    _, cat, _ = _lib(args)
    outs, states = [], [None] * args.num_seqs
    for i in range(args.num_seqs):
        one, _ = sequence_args(args, i)
        if one.seq_len == 0:
            continue
        o, s = impl.forward(one)
        outs.append(o)
        states[i] = None if s is None else s[0]
    o = cat(outs, 2)
    if impl.final_state is False or all(s is None for s in states):
        return o, None
    return o, _stack_states(args, states, args.initial_state)  # an empty sequence ends where it started


def packed_backward(impl, args, d_final_state=None):
    """(dq, dk, dv, d_initial_states) of a packed call, each sequence's backward on its own slice."""
    _, cat, _ = _lib(args)
    grads, d_states = [[], [], []], [None] * args.num_seqs
    for i in range(args.num_seqs):
        one, dsn = sequence_args(args, i, d_final_state)
        if one.seq_len == 0:
            continue
        dq, dk, dv, ds0 = impl.backward(one, dsn)
        for acc, g in zip(grads, (dq, dk, dv)):
            acc.append(g)
        d_states[i] = None if ds0 is None else ds0[0]
    dq, dk, dv = (cat(g, 2) for g in grads)
    if all(s is None for s in d_states):
        return dq, dk, dv, None
    # No tokens: the initial state reaches the final state unchanged, and so does its gradient.
    return dq, dk, dv, _stack_states(args, d_states, d_final_state)
