"""Sequence parallelism: one long sequence split across devices, and only a state crosses between them.
(Chapter 12.)

Cut a sequence of n tokens into contiguous slices, one per rank in rank order: rank 0 holds the first
n_0 tokens, rank 1 the next n_1, and so on (the slices may have different lengths). The recurrence
``KV_t = lambda KV_{t-1} + k_t^T v_t``, ``o_t = q_t KV_t`` then splits exactly the way chapter 04 split a
sequence into blocks, with a rank playing the part of a block:

1. **Local pass.** Rank r runs :func:`lightning_edu.lightning_attention` on its own slice from a zero
   state and gets its local outputs o_r^loc and its local state
   ``S_r = sum_s lambda^(n_r - 1 - s) k_s^T v_s`` (s the position inside the slice): what its tokens add to
   the state, decayed to the slice's end.
2. **State exchange.** The state entering rank r obeys the recurrence one slice at a time,
   ``IN_r = lambda^(n_{r-1}) IN_{r-1} + S_{r-1}``, a prefix combination over the ranks before r. Only
   non-negative powers of lambda appear, so nothing overflows for any lambda in (0, 1]; lambda = 1 gives
   factors of exactly 1, and a factor that underflows to 0 is the right answer (that past is forgotten).
3. **Correction.** The incoming state reaches local row t (t = 0..n_r - 1) decayed t + 1 times, exactly
   like the inter-block term of chapter 04: ``o_r = o_r^loc + diag(lambda^(t+1)) q_r IN_r``.

Why only the state crosses devices: everything rank r needs from the tokens before it is summarised in
IN_r, a (d_k, d_v) matrix per batch and head, whatever the number of those tokens. Softmax attention has
no such summary: each query must meet every earlier key, so its context parallelism moves the keys and
values themselves, n_local (d_k + d_v) numbers per head from each rank instead of d_k d_v
(:func:`communication_bytes` counts both for the chapter's table).

Two exchanges compute the same IN_r:

* ``"allgather"``: every rank gathers every S_j (one all-gather of world states) and forms the prefix
  combination itself. One collective, latency that does not grow with the number of ranks in sequence.
* ``"ring"`` (as in LASP): rank r receives IN_r from rank r - 1 and sends ``lambda^(n_r) IN_r + S_r``
  to rank r + 1. One state per rank on the wire, but the ranks wait for each other one after the other.

The initial state (the state before the sequence's first token) belongs to rank 0, so it is given on
rank 0 only. Rank 0 folds it into its local pass, which then needs no correction, and the combination of
the other ranks starts from rank 0's final state.

Autograd. The function is made of differentiable pieces: the local passes, the decay powers, the
corrections, and an exchange that knows its own backward. The backward of a gather is the reverse
exchange: the gradient reaching rank j's state S_j is the sum over ranks of what each one's outputs sent
it (a reduce-scatter, :class:`_GatherStates`), and the ring runs backwards, from the last rank to the
first, carrying dL/dIN (:class:`_RingExchange`). The gradients are those of the sum of the ranks' losses,
the usual convention of data and sequence parallelism. Every rank must take part in the backward pass
(it is a collective), so every rank must backpropagate through its result.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .api import lightning_attention
from .torch_chunked import _powers  # lambda^n per head, in float64, rounded once
from .torch_chunked import first_derivative_only
from .validation import validate_attention_args, validate_choice, validate_flag, validate_positive_int

__all__ = ["sequence_parallel_attention", "communication_bytes", "run_on_cpu_ranks"]

EXCHANGES = ("allgather", "ring")
"""The two ways to move the states: one all-gather of every rank's state, or a ring of send/recv."""

_BACKENDS = ("auto", "torch", "triton")


# ----------------------------------------------------------------------------------------------- validation


@dataclass(frozen=True)
class _Plan:
    """The checked call, the same picture on every rank: who we are, every slice's length, lambda."""

    rank: int
    world: int
    group: Any
    counts: tuple[int, ...]
    decay: Any  # what validate_decay returned: float64 numpy array, or a tensor that requires grad
    backend: str
    exchange: str
    return_state: bool


def _check_group(group: Any) -> tuple[Any, int, int]:
    """(group, rank, world) of an initialised process group; ``None`` is the default (world) group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group: torch.distributed is not initialised; call torch.distributed.init_process_group"
                         "(...) on every rank first (gloo on CPUs, nccl on GPUs), or use run_on_cpu_ranks for a demo")
    if group is None:
        group = dist.group.WORLD
    elif not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


def _tracks_grad(*xs: Any) -> bool:
    """Whether autograd records this call: grad mode on and some tensor input requires grad."""
    return torch.is_grad_enabled() and any(torch.is_tensor(x) and x.requires_grad for x in xs)


def _local_meta(rank: int, q, k, v, decay, backend, initial_state, return_state, exchange, offset) -> tuple:
    """Check this rank's arguments on their own; return (args, metadata for the other ranks)."""
    backend = validate_choice("backend", backend, _BACKENDS)
    exchange = validate_choice("exchange", exchange, EXCHANGES)
    return_state = validate_flag("return_state", return_state)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not torch.is_tensor(x):
            raise TypeError(f"{name} must be a torch.Tensor (the slices travel through torch.distributed), got "
                            f"{type(x).__name__}")
    if q.ndim == 4 and q.shape[2] == 0:
        raise ValueError(f"q must hold at least one token on every rank (n_local >= 1), got shape {tuple(q.shape)} "
                         f"on rank {rank}")
    if offset is not None:
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
            raise TypeError(f"offset must be an integer (this rank's first position in the sequence) or None, got "
                            f"{type(offset).__name__} {offset!r}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0 (this rank's first position in the sequence), got {offset}")
    if initial_state is not None and rank != 0:
        raise ValueError(f"initial_state is the state before the sequence's first token, which rank 0 holds: pass it "
                         f"on rank 0 only and None elsewhere (rank {rank} passed one)")
    args = validate_attention_args(q, k, v, decay, backend=backend, initial_state=initial_state, decay_grad=True)
    lam = args.decay.detach().cpu().double().tolist() if torch.is_tensor(args.decay) else args.decay.tolist()
    meta = dict(batch=args.batch, heads=args.heads, d_k=args.d_k, d_v=args.d_v, dtype=str(q.dtype),
                device=q.device.type, n=args.seq_len, decay=lam, offset=None if offset is None else int(offset),
                exchange=exchange, return_state=return_state,
                tracks_grad=_tracks_grad(q, k, v, initial_state, decay))
    return args, meta


def _agree(metas: list[dict], key: str, what: str, hint: str = "") -> None:
    """Raise unless every rank has the same ``key``; the message names the first rank that differs."""
    for r, m in enumerate(metas[1:], 1):
        if m[key] != metas[0][key]:
            raise ValueError(f"{what} must be the same on every rank: rank 0 has {metas[0][key]!r}, rank {r} has "
                             f"{m[key]!r}{hint}")


def _check_offsets(metas: list[dict]) -> None:
    """Offsets, where given, must say that the slices are contiguous and in rank order: each rank starts
    where the one before it ends (rank 0 anywhere: a sequence resumed from an initial state need not start
    at position 0)."""
    given = [m["offset"] is not None for m in metas]
    if not any(given):
        return
    if not all(given):
        missing = [r for r, g in enumerate(given) if not g]
        raise ValueError(f"offset must be given on every rank or on none, got None on rank(s) {missing}")
    for r in range(1, len(metas)):
        before, m = metas[r - 1], metas[r]
        end = before["offset"] + before["n"]
        if m["offset"] != end:
            raise ValueError(f"offset: the slices must be contiguous and in rank order, each rank starting where the "
                             f"one before it ends; rank {r} starts at {m['offset']}, expected {end} (rank {r - 1} "
                             f"holds positions {before['offset']}..{end - 1})")


def _check_across_ranks(metas: list[dict]) -> None:
    """What one rank cannot see alone: shapes, dtypes, lambda, flags and the order of the slices."""
    for key, what in (("batch", "the batch size of q, k, v (axis 0)"), ("heads", "the number of heads (axis 1)"),
                      ("d_k", "d_k (axis 3 of q and k)"), ("d_v", "d_v (axis 3 of v)"), ("dtype", "the dtype of q"),
                      ("device", "the device type of q")):
        _agree(metas, key, what, " (the ranks hold slices of the same sequences: only the sequence axis may differ)")
    _agree(metas, "decay", "decay (one lambda per head for the whole sequence)")
    _agree(metas, "exchange", "exchange")
    _agree(metas, "return_state", "return_state")
    tracks = [m["tracks_grad"] for m in metas]
    if any(tracks) and not all(tracks):
        raise ValueError(f"autograd must record this call on every rank or on none (the backward pass is a "
                         f"collective every rank joins): ranks {[r for r, t in enumerate(tracks) if t]} have "
                         f"inputs that require grad, ranks {[r for r, t in enumerate(tracks) if not t]} do not")
    _check_offsets(metas)


def _validate(q, k, v, decay, group, backend, initial_state, return_state, exchange, offset) -> tuple:
    """Every check in one place; return (args, plan), or raise the same error on every rank.

    A rank that raised on its own while the others went on into a collective would leave them waiting
    forever, so the local verdicts are gathered first (one small all-gather of metadata) and all ranks
    raise together: the rank at fault its own error, the others one of the same type naming it.
    """
    group, rank, world = _check_group(group)
    args, meta, error = None, None, None
    try:
        args, meta = _local_meta(rank, q, k, v, decay, backend, initial_state, return_state, exchange, offset)
    except (TypeError, ValueError) as exc:
        error = exc
    metas: list = [None] * world
    dist.all_gather_object(metas, meta if error is None else (type(error).__name__, str(error)), group=group)
    if error is not None:
        raise error
    failed = [(r, m) for r, m in enumerate(metas) if isinstance(m, tuple)]
    if failed:
        r, (kind, message) = failed[0]
        raise (TypeError if kind == "TypeError" else ValueError)(f"rank {r} refused its arguments: {kind}: {message}")
    _check_across_ranks(metas)
    plan = _Plan(rank, world, group, tuple(m["n"] for m in metas), args.decay, args.backend, meta["exchange"],
                 meta["return_state"])
    return args, plan


# --------------------------------------------------------------------------------------------- the exchanges


class _GatherStates(torch.autograd.Function):
    """All-gather one tensor per rank; backward: each rank's gradient summed over all ranks (reduce-scatter).

    torch.distributed.nn.functional.all_gather does the same but is deprecated; this is its dozen lines.
    Gloo has no reduce-scatter, so there the backward is an all-to-all followed by a sum.
    """

    @staticmethod
    def forward(ctx, group, local: torch.Tensor):
        ctx.group = group
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        # The collectives below are invisible to autograd: under create_graph=True their result goes through a
        # node that refuses a second derivative, rather than enter the graph as a constant (a term silently lost).
        return None, first_derivative_only("the all-gather of sequence_parallel_attention", _reduce_scatter,
                                           ctx.group, *grads)


def _reduce_scatter(group, *grads: torch.Tensor) -> torch.Tensor:
    """This rank's gradient summed over all ranks: _GatherStates' backward."""
    grads = [g.contiguous() for g in grads]
    if grads[0].device.type == "cpu":  # gloo: no reduce_scatter, and its list all_to_all only in some builds
        sent = torch.stack(grads)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)  # received[r]: rank r's gradient of this rank's part
        return received.sum(0)
    mine = torch.empty_like(grads[0])
    dist.reduce_scatter(mine, grads, group=group)
    return mine


def _peer(group, rank: int) -> int:
    """The global rank of ``rank`` in ``group`` (send and recv address global ranks)."""
    return dist.get_global_rank(group, rank) if group is not dist.group.WORLD else rank


class _RingExchange(torch.autograd.Function):
    """LASP's ring: IN_r arrives from rank r - 1, ``lambda^(n_r) IN_r + S_r`` leaves for rank r + 1.

    Returns (IN_r, final state of the whole sequence), the final state sent from the last rank to all (with
    ``with_final``; else a 0-d zero in its place).
    Backward, the ring reversed: rank r receives dL/d(its outgoing state) from rank r + 1 (the last rank:
    the final state's gradient summed over all ranks), which is dL/dS_r; adds ``lambda^(n_r)`` times it to
    its own dL/dIN_r and sends that to rank r - 1, whose outgoing state was IN_r.
    """

    @staticmethod
    def forward(ctx, group, rank: int, world: int, carry: torch.Tensor, factor: torch.Tensor, with_final: bool):
        incoming = torch.zeros_like(carry)
        if rank > 0:
            dist.recv(incoming, src=_peer(group, rank - 1), group=group)
        outgoing = (factor * incoming + carry).contiguous()
        if rank < world - 1:
            dist.send(outgoing, dst=_peer(group, rank + 1), group=group)
        final = outgoing.clone() if with_final else carry.new_zeros(())
        if with_final:
            dist.broadcast(final, src=_peer(group, world - 1), group=group)
        ctx.save_for_backward(incoming, factor)
        ctx.group, ctx.rank, ctx.world, ctx.with_final = group, rank, world, with_final
        return incoming, final

    @staticmethod
    def backward(ctx, d_incoming: torch.Tensor, d_final: torch.Tensor):
        incoming, factor = ctx.saved_tensors
        # As _GatherStates: what arrives by recv has no history, so under create_graph=True the ring's backward is
        # a node that refuses a second derivative.
        d_outgoing, d_factor = first_derivative_only(
            "the ring exchange of sequence_parallel_attention", _ring_backward, ctx.group, ctx.rank, ctx.world,
            ctx.with_final, incoming, factor, d_incoming, d_final)
        return None, None, None, d_outgoing, d_factor, None


def _ring_backward(group, rank: int, world: int, with_final: bool, incoming, factor, d_incoming, d_final):
    """(dL/d carry, dL/d factor) of this rank: _RingExchange's backward, the ring reversed."""
    d_outgoing = torch.zeros_like(incoming)
    if with_final:  # every rank's loss may use the final state: their gradients add up on the last rank
        d_final = d_final.contiguous().clone()
        dist.all_reduce(d_final, group=group)
        if rank == world - 1:
            d_outgoing = d_final
    if rank < world - 1:
        dist.recv(d_outgoing, src=_peer(group, rank + 1), group=group)
    if rank > 0:
        dist.send((d_incoming + factor * d_outgoing).contiguous(), dst=_peer(group, rank - 1), group=group)
    d_factor = (d_outgoing * incoming).sum(dim=(0, 2, 3), keepdim=True)
    return d_outgoing, d_factor


class _Join(torch.autograd.Function):
    """``out`` unchanged, tied to the exchange so that rank 0's backward runs the exchange's backward.

    Rank 0's outputs do not read any other rank's state, so without this tie its backward would skip the
    exchange and the other ranks, waiting in the collective, would never finish. Every other rank's output reads
    its incoming state, an output of the exchange, and needs no tie. The copy of ``out`` is what makes the tie
    an output of its own: a view returned by a custom Function could not be modified in place by the caller.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, *exchanged: torch.Tensor):
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in exchanged]
        return out.clone()

    @staticmethod
    def backward(ctx, d_out: torch.Tensor):
        return (d_out, *(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.shapes))


# ------------------------------------------------------------------------------------------------- the math


def _prefix_states(carries: list[torch.Tensor], factors: list[torch.Tensor], upto: int) -> list[torch.Tensor]:
    """[IN_0 = 0 (None), IN_1, ..., IN_upto] with ``IN_{j+1} = factors[j] IN_j + carries[j]``: rank j's
    contribution decayed across each later slice it passes, one non-negative power at a time."""
    states: list = [None]
    for j in range(upto):
        states.append(carries[j] if states[-1] is None else factors[j] * states[-1] + carries[j])
    return states


def _correct(o_local: torch.Tensor, q: torch.Tensor, incoming: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """``o_loc + diag(lambda^(t+1)) q IN``: the incoming state decayed to each local row t = 0..n_r - 1."""
    dtype = incoming.dtype
    rows = torch.arange(1, q.shape[2] + 1, device=q.device)
    scale = _powers(lam, rows.to(lam.device), dtype)[None, ..., None]  # (1, heads, n_r, 1)
    return (o_local.to(dtype) + scale * (q.to(dtype) @ incoming)).to(o_local.dtype)


def sequence_parallel_attention(
    q,
    k,
    v,
    decay=1.0,
    *,
    group=None,
    backend: str = "auto",
    initial_state=None,
    return_state: bool = False,
    exchange: str = "allgather",
    offset: int | None = None,
):
    """Lightning Attention over a sequence split across the ranks of a process group. (Chapter 12.)

    Call it on every rank of ``group`` (None: the default group), each with its own contiguous slice of the
    same sequences, in rank order: q, k (batch, heads, n_r, d_k) and v (batch, heads, n_r, d_v), n_r >= 1 and
    free to differ between ranks. Each rank gets back the rows of its slice of
    ``lightning_attention(q_full, k_full, v_full, decay, initial_state=..., return_state=...)``, the single
    call over the whole sequence.

    ``decay``: lambda in (0, 1], a float or one value per head, the same on every rank; a tensor that
    requires grad is learnable (see below). ``initial_state`` (batch, heads, d_k, d_v): the state before the
    first token, given on rank 0 only (None elsewhere). ``return_state=True``: every rank returns
    (o, final_state), the final state of the whole sequence (after the last rank's last token), the same on
    every rank. ``exchange``: "allgather" or "ring" (module docstring), same results. ``offset``: optional,
    this rank's first position in the sequence; given on every rank, the slices are checked to be
    contiguous and in rank order, each starting where the one before ends (without it, rank order is
    assumed: the data alone cannot tell).
    ``backend``: that of each rank's local pass, "auto", "torch" or "triton" (torch tensors only; the
    process group is whatever ``group`` is: gloo for CPU tensors, nccl for CUDA ones).

    Gradients (autograd): dL/dq, dL/dk, dL/dv on every rank and dL/d initial_state on rank 0 are those of
    the sum of all ranks' losses, as in any data- or sequence-parallel training; every rank must
    backpropagate through its result (the backward is a collective). A learnable decay is a weight
    replicated on every rank, like the projections that made q, k and v: each rank's ``decay.grad`` holds
    its share, and their sum over the group (``dist.all_reduce(decay.grad)``, the same reduction those
    weights need) is dL/dlambda.

    Each call costs one small all-gather of metadata (shapes, lambda read on the host, slice lengths,
    offsets) so that every rank raises the same clear error when the ranks disagree, instead of waiting
    forever. Precision: the local passes as in :func:`lightning_edu.lightning_attention`; for
    float16/bfloat16 inputs the correction is added in float32 to an output already rounded once, so o can
    differ from the single call by one more rounding.
    """
    args, plan = _validate(q, k, v, decay, group, backend, initial_state, return_state, exchange, offset)
    lam = args.decay if torch.is_tensor(args.decay) else torch.as_tensor(args.decay, device=q.device)
    o_local, carry = lightning_attention(q, k, v, decay, backend=plan.backend, initial_state=initial_state,
                                         return_state=True)
    counts = torch.tensor(plan.counts, device=q.device)
    factors = _powers(lam, counts.to(lam.device), carry.dtype)[None]  # (1, heads, world): lambda^(n_j)
    factors = [factors[..., j, None, None] for j in range(plan.world)]  # each (1, heads, 1, 1)
    if plan.exchange == "allgather":
        carries = _GatherStates.apply(plan.group, carry)
        states = _prefix_states(list(carries), factors, plan.world if plan.return_state else plan.rank)
        incoming, final, exchanged = states[plan.rank], states[-1], carries  # states[world]: the final state
    else:
        incoming, final = _RingExchange.apply(plan.group, plan.rank, plan.world, carry, factors[plan.rank],
                                              plan.return_state)
        exchanged = (incoming, final)
    # Rank 0's incoming state was folded into its local pass (initial_state): no correction there.
    o = o_local if plan.rank == 0 else _correct(o_local, q, incoming, lam)
    if plan.rank == 0 and _tracks_grad(q, k, v, initial_state, decay):
        o = _Join.apply(o, *exchanged)
    return (o, final) if plan.return_state else o


# ------------------------------------------------------------------------------------------- the cost table


def communication_bytes(n_tokens: int, world: int, heads: int, d_k: int, d_v: int, dtype_bytes: int,
                        state_bytes: int = 4, *, batch: int = 1) -> dict[str, int]:
    """Bytes each rank sends in one forward pass, for a sequence of ``n_tokens`` over ``world`` ranks.

    * ``"lightning_allgather"``: its state, (batch, heads, d_k, d_v) of ``state_bytes`` each (float32
      states by default), to each of the world - 1 other ranks;
    * ``"lightning_ring"``: one state, to the next rank (the last rank sends none);
    * ``"softmax_allgather_kv"``: softmax context parallelism's all-gather of its slice of K and V,
      n_local (d_k + d_v) values of ``dtype_bytes`` per batch and head, n_local = ceil(n_tokens / world),
      to each of the world - 1 other ranks.

    The backward pass sends as much again (the reverse exchange). The states' bytes do not depend on
    n_tokens at all; the keys' and values' grow with it. The metadata of each call (a few integers per
    rank) is left out.
    """
    n_tokens, world, heads, d_k, d_v, dtype_bytes, state_bytes, batch = (
        validate_positive_int(name, value) for name, value in (
            ("n_tokens", n_tokens), ("world", world), ("heads", heads), ("d_k", d_k), ("d_v", d_v),
            ("dtype_bytes", dtype_bytes), ("state_bytes", state_bytes), ("batch", batch)))
    state = batch * heads * d_k * d_v * state_bytes
    n_local = math.ceil(n_tokens / world)
    kv_slice = batch * heads * n_local * (d_k + d_v) * dtype_bytes
    return {"lightning_allgather": (world - 1) * state, "lightning_ring": state if world > 1 else 0,
            "softmax_allgather_kv": (world - 1) * kv_slice}


# ------------------------------------------------------------------------------------- a demo on CPU ranks


def _detached(x: Any) -> Any:
    """``x`` with every tensor detached (results travel back to the caller through torch.save)."""
    if torch.is_tensor(x):
        return x.detach()
    if isinstance(x, (list, tuple)):
        items = [_detached(y) for y in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, dict):
        return {key: _detached(y) for key, y in x.items()}
    return x


_FAILURE_FILE = "error{rank}.json"
_FORK_AUTOGRAD = "Unable to handle autograd's threading in combination with fork-based multiprocessing"
# What a rank's collective says when another rank's process has gone: a consequence, never the cause.
_PEER_GONE = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "Broken pipe",
              "DistBackendError")
_MAX_TIMEOUT = 1e9  # seconds: the collectives count their deadline in int64 nanoseconds (292 years) from now


def _record_failure(folder: str, rank: int) -> None:
    """Write this rank's traceback and the time it raised to the run's folder, atomically (see :func:`_wait`)."""
    record = {"time_ns": time.time_ns(), "traceback": traceback.format_exc()}
    path = os.path.join(folder, _FAILURE_FILE.format(rank=rank))
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:  # the report then falls back to what torch.multiprocessing carries
        pass


def _rank_main(rank: int, fn: Callable, world: int, folder: str, timeout: float, args: tuple) -> None:
    """One CPU rank: join the gloo group through a file store, run ``fn(rank, *args)``, save the result.

    A rank that raises records its traceback first, while its group is still open: the other ranks' collectives
    fail ("Connection reset by peer") only once it has closed, so its record is the earliest (:func:`_wait`)."""
    joined = False
    try:
        if os.uname().sysname == "Linux":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # ranks on one machine: the loopback device
        torch.set_num_threads(1)  # the ranks share the machine's cores
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout))
        joined = True
        # Every rank has joined before any runs fn: a rank that fails at once cannot leave another still
        # connecting, whose "connection closed by peer" would then be the failure reported in its place.
        dist.barrier()
        result = fn(rank, *args)
        torch.save(_detached(result), os.path.join(folder, f"result{rank}.pt"))
    except BaseException:
        _record_failure(folder, rank)
        raise
    finally:
        if joined:
            dist.destroy_process_group()


def _importable(fn: Callable) -> bool:
    """Whether ``fn`` pickles by reference: defined at the top level of a module other than ``__main__``."""
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__") or module not in sys.modules:
        return False
    found = sys.modules[module]
    for part in getattr(fn, "__qualname__", "<>").split("."):
        found = getattr(found, part, None)
    return found is fn


def _picklable(x: Any) -> bool:
    try:
        pickle.dumps(x)
    except Exception:
        return False
    return True


def _default_start_method(fn: Callable, args: tuple, methods: list) -> str:
    """"fork" where the system has it, except on a CUDA machine when "spawn" can start ``fn``; else "spawn"."""
    if "fork" not in methods:
        return "spawn"
    if torch.cuda.is_available() and _importable(fn) and _picklable(args):
        return "spawn"  # a forked rank's backward fails once this process has run one (see run_on_cpu_ranks)
    return "fork"


def run_on_cpu_ranks(fn: Callable, world_size: int, *args, timeout: float = 120.0,
                     start_method: str | None = None) -> list:
    """Run ``fn(rank, *args)`` on ``world_size`` CPU processes joined in a gloo group; return their results.

    A demo on one machine: each rank is a process with one thread, its group initialised through a file
    store in a temporary folder (no port to pick), and ``fn`` may call torch.distributed and
    :func:`sequence_parallel_attention` freely. The list of the ranks' return values comes back in rank
    order, tensors detached.

    ``start_method``: "fork", "spawn" or "forkserver" (those the system has). By default "fork" where the system
    has it (quick, and ``fn`` may be defined in a notebook), else "spawn" (``fn`` and ``args`` must then be
    picklable: ``fn`` defined in a module). Except on a machine with CUDA, where the default is "spawn" whenever
    ``fn`` is importable (defined at the top level of a module other than ``__main__``) and ``args`` pickle:
    there, once this process has run any autograd backward, a forked rank dies in its own backward with torch's
    "Unable to handle autograd's threading in combination with fork-based multiprocessing" (autograd's worker
    threads do not survive a fork). When a rank dies of that anyway (``fn`` defined in a notebook), the
    RuntimeError says so and what to do: define ``fn`` in a module and pass ``start_method="spawn"``, or run the
    ranks before any backward in this process. A spawned rank imports the main module again before it runs
    ``fn``: a script calls this under ``if __name__ == "__main__":`` (a notebook or ``python -c`` need not).

    A rank that raises ends the run: the others are stopped and a RuntimeError names that rank and carries its
    traceback. When the others' collectives fail in turn ("Connection reset by peer"), the rank reported is still
    the one that raised first: each rank records its traceback and the time before its group closes.
    A run still going after ``timeout`` seconds (a positive number, at most 1e9: the collectives count their
    deadline in nanoseconds) is stopped with a TimeoutError; the collectives use the same timeout. Every process
    is joined before this returns.
    """
    world_size = validate_positive_int("world_size", world_size)
    if not callable(fn):
        raise TypeError(f"fn must be callable as fn(rank, *args), got {type(fn).__name__}")
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"timeout must be a positive number of seconds, got {type(timeout).__name__} {timeout!r}")
    if not 0 < timeout <= _MAX_TIMEOUT:  # NaN fails too
        raise ValueError(f"timeout must be a positive, finite number of seconds, at most {_MAX_TIMEOUT:g} (the "
                         f"collectives count their deadline in nanoseconds), got {timeout!r}")
    methods = torch.multiprocessing.get_all_start_methods()
    if start_method is None:
        start_method = _default_start_method(fn, args, methods)
    validate_choice("start_method", start_method, tuple(methods))
    with tempfile.TemporaryDirectory(prefix="lightning_ranks_") as folder:
        context = torch.multiprocessing.start_processes(
            _rank_main, args=(fn, world_size, folder, float(timeout), args), nprocs=world_size, join=False,
            daemon=True, start_method=start_method)
        _wait(context, world_size, float(timeout), folder, start_method)
        return [torch.load(os.path.join(folder, f"result{r}.pt"), weights_only=False) for r in range(world_size)]


def _failure_message(rank: int, world: int, traceback_text: str, start_method: str) -> str:
    """The RuntimeError's message for a rank that raised: its rank and traceback, and for the one failure that a
    fork causes (autograd's threads after a backward in the parent) the cause and the remedy."""
    message = f"rank {rank} of {world} failed:\n{traceback_text.rstrip()}"
    if _FORK_AUTOGRAD in traceback_text and start_method == "fork":
        message += ("\n\nrun_on_cpu_ranks: the ranks were started with start_method='fork' after this process had run "
                    "an autograd backward, and autograd's threads do not survive a fork. Define fn at the top level "
                    "of a module (not in __main__ or a notebook) and pass start_method='spawn', or call "
                    "run_on_cpu_ranks before any backward in this process.")
    return message


def _recorded_failures(folder: str, world: int) -> dict[int, dict]:
    """{rank: {"time_ns", "traceback"}} for every rank that recorded a failure (:func:`_record_failure`)."""
    out = {}
    for r in range(world):
        try:
            with open(os.path.join(folder, _FAILURE_FILE.format(rank=r))) as f:
                out[r] = json.load(f)
        except (OSError, ValueError):
            continue
    return out


def _first_failure(context, folder: str, world: int, start_method: str, exc) -> str:
    """The message of the failure that started it all, whichever rank torch.multiprocessing noticed first.

    The rank that raised first, by its record's time; but a rank that died without a record (killed, or a crash
    below Python) while the first record is only a collective noticing a peer gone, is that dead rank."""
    records = _recorded_failures(folder, world)
    if records:
        first = min(records, key=lambda r: records[r]["time_ns"])
        text = records[first]["traceback"]
        if any(s in text for s in _PEER_GONE):
            for r, process in enumerate(context.processes):
                process.join(0.1)
                if r not in records and process.exitcode not in (None, 0):
                    return f"rank {r} of {world} died (exit code {process.exitcode}) without a Python exception"
        return _failure_message(first, world, text, start_method)
    if isinstance(exc, torch.multiprocessing.ProcessRaisedException):
        return _failure_message(exc.error_index, world, str(exc), start_method)
    message = f"rank {exc.error_index} of {world} died: {exc}"
    if start_method != "fork":  # it may not have reached fn at all: its stderr holds what it printed
        message += (f" (with start_method={start_method!r} each rank first imports the main module again: a script "
                    "must call run_on_cpu_ranks under `if __name__ == \"__main__\":`, or pass start_method='fork')")
    return message


def _wait(context, world: int, timeout: float, folder: str, start_method: str) -> None:
    """Join every rank, or stop them all: a rank's failure becomes a RuntimeError, a hang a TimeoutError."""
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())), grace_period=2.0):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run_on_cpu_ranks: the {world} ranks did not finish within {timeout:g} s "
                                   f"(a rank waiting in a collective that another rank never joined?)")
    except (torch.multiprocessing.ProcessRaisedException, torch.multiprocessing.ProcessExitedException) as exc:
        raise RuntimeError(_first_failure(context, folder, world, start_method, exc)) from None
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
            process.join()
