"""The backend as two ``torch.library`` custom ops, so that ``torch.compile`` sees one op, not Python. (Chapter 08.)

``lightning_attention(..., backend="triton")`` runs the fastest variant's kernels through two operators in the
namespace ``lightning_edu``::

    lightning_edu::la2_forward(Tensor q, Tensor k, Tensor v, Tensor log2_decay, Tensor? initial_state=None,
                               int? block_size=None, bool save_states=True)
                               -> (Tensor o, Tensor final_state, Tensor incoming)
    lightning_edu::la2_backward(Tensor q, Tensor k, Tensor v, Tensor do, Tensor log2_decay,
                                Tensor? initial_state, Tensor? d_final_state, Tensor incoming,
                                int? block_size=None) -> (Tensor dq, Tensor dk, Tensor dv, Tensor d_initial_state)

q, k: (batch, heads, n, d_k); v, do: (batch, heads, n, d_v); log2_decay: float32 (heads,), log2(lambda);
initial_state, d_final_state: (batch, heads, d_k, d_v) or None. o, dq, dk, dv come back in the dtypes of v, q,
k, v, each laid out as the input it matches (o as v, dq as q, ...: :func:`~.la2_fast.output_like`), so that
a model's strided views of one projection go in and come out with no copy through la2_fast's kernels (la3's
dK/dV kernel, the backward for 16-bit d_k = d_v <= 64, copies strided q, k, v, dO in and dK, dV out); final_state and d_initial_state
are float32 and contiguous. ``incoming`` is what the forward saves for the backward's dQ
pass: every segment's incoming state, float32 (batch * heads, num_segments, d_k, d_v), or an empty float32
tensor of shape (0,) when the sequence is one segment or ``save_states`` is False (an op returns tensors, never
None). It is marked non-differentiable. :func:`~lightning_edu.triton_kernels.triton_attention` passes
``save_states=False`` when no gradient can be asked for (grad mode off, or no input requiring one): inference
then writes no segment states (at 32K tokens, d = 128, 16 heads: 8 states of 64 KB per head).

Why an op. Dynamo cannot trace into a Triton launch (Python-side grids, a pre-pass, the two-pass NaN scheme,
int flags), and an ``autograd.Function`` that launches kernels is a graph break. A custom op is one node of
the graph: :func:`torch.compile` (``fullgraph=True``) captures a model that calls the backend, AOTAutograd
traces the backward through :func:`_backward` (which calls ``la2_backward``, and for a learnable decay the
torch-ops tangent pass :func:`~lightning_edu.torch_chunked.decay_gradient`), and Inductor compiles what is
around the two ops. Each op has a fake (meta) implementation that gives its outputs' shapes and dtypes
without launching anything: :func:`launch_plan` computes on shapes alone the segment length the launcher
would pick, so the fake knows the shape of ``incoming``, and the backward recomputes it instead of carrying a
Python int beside the saved tensors.

``custom_op``, not ``triton_op``. ``torch.library.triton_op`` would let Inductor see (and fuse around, or put
in a CUDA graph) the kernels themselves, but every launch would have to go through ``wrap_triton`` and the
host code between launches would be traced with fake tensors: the launchers of ``la2_fast``/``la3`` (grids
from ``sm_count``, the flags of the exact pass, the pre-pass that runs only with more than one segment, the
float64 torch epilogue of :func:`~la2_fast.finish_backward`) would all have to be rewritten that way. And
Inductor generates code for user Triton kernels on GPUs only: on a machine without CUDA, where the kernels run
in Triton's CPU interpreter, a ``triton_op`` could not be compiled at all. A ``custom_op`` is opaque: the
launchers run as they are, in eager, in the interpreter and on a GPU, compiled or not. What it costs: Inductor
cannot fuse the cast of o to another dtype into the kernel, and the op's launches are not captured by CUDA
graphs when the compiled region contains them (``mode="reduce-overhead"`` runs them outside the graphs).
"""

from __future__ import annotations

import math

import torch
import triton
from torch import Tensor

from ..torch_chunked import decay_gradient, first_derivative_only
from . import _tiles
from ._tiles import compile_ahead, is_dense, record_plan, upcast_for_interpreter
from .la2_fast import la2_fast_backward, la2_fast_forward, output_like
from .la2_literal import la2_literal_backward, la2_literal_forward
from .la3 import la3_backward
from .plan import (
    backward_kernel,
    choose_segments,
    interpreted,
    settings,
    short_blocks,
    sliced_plan,
    sm_count,
    tiles_for,
    value_slices,
    whole_dv_forward,
    whole_dv_plan,
)

# The Lightning Attention-2 variants share one signature: forward(q, k, v, log2_decay, initial_state, ...)
# -> (o, final_state) and backward(q, k, v, do, log2_decay, initial_state, d_final_state, ...) ->
# (dq, dk, dv, d_initial_state). LA-1 has its own wrapper in ``la1`` (no state to carry).
VARIANTS = {
    "la2_literal": (la2_literal_forward, la2_literal_backward),
    "la2_fast": (la2_fast_forward, la2_fast_backward),
    "la3": (la2_fast_forward, la3_backward),  # la2_fast's forward, the recompute-heavy backward
}

__all__ = ["VARIANTS", "la2_forward", "la2_backward", "forward_impl", "backward_impl", "EagerLA2", "launch_plan",
           "compute_dtype", "ahead_key", "forget_plans", "recorded_launches"]


_COMPILED: set = set()  # ahead_key of every configuration compiled ahead in this process


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the kernels load x's tiles in: float32 for bfloat16 bound for the CPU interpreter (its bf16
    arithmetic is wrong, see :func:`~._tiles.upcast_for_interpreter`), x's own dtype otherwise."""
    return torch.float32 if x.dtype == torch.bfloat16 and interpreted(x) else x.dtype


def launch_plan(q: Tensor, v: Tensor, block_size: int | None = None,
                save_states: bool = True) -> tuple[dict, int, int]:
    """(cfg, seg_len, num_segments) of the backend's forward on tensors shaped like q and v, from shapes, dtype
    and device alone (it reads no data, so the fake implementations and the backward can call it).

    ``cfg`` is :func:`~.plan.kernel_config`'s; seg_len and num_segments are what
    ``la2_fast_forward`` picks when given no seg_len (its d_v slices, then
    :func:`~.plan.choose_segments`); the forward op passes this seg_len to it explicitly, so the saved
    segment states always have the layout computed here. A forward that saves no states (no backward to follow)
    may instead take :func:`~.plan.sliced_forward`'s plan: 32-column slices of d_v as one segment; or, where
    that does not apply and its tiles load through descriptors, d_v whole (:func:`~.plan.whole_dv_forward`,
    on :func:`~.plan.whole_dv_plan`'s segments, as la2_fast_forward takes them).
    """

    batch, heads, n, d_k = q.shape
    d_v = v.shape[-1]
    cfg = tiles_for(q, v, block_size, compute_dtype(q))
    sliced = None if save_states or block_size is not None else sliced_plan(q, v, cfg["block"])
    if sliced is not None:
        block_dv, num_stages, seg_len = sliced
        return {**cfg, "block_dv": block_dv, "num_stages": num_stages}, seg_len, 1
    if not save_states and block_size is None and whole_dv_forward(q, v):
        tiles, num_seg, seg_len = whole_dv_plan(q, cfg["block"])
        return {**cfg, **tiles}, seg_len, num_seg
    _, slices = value_slices(d_v, cfg["block_dv"])  # as la2_fast_forward will
    num_seg, seg_len = choose_segments(batch * heads * slices, n, cfg["block"], sm_count(q.device), None,
                                       short_blocks(q.device))
    return cfg, seg_len, num_seg


def ahead_key(q: Tensor, k: Tensor, v: Tensor, initial_state: Tensor | None, block_size: int | None,
              save_states: bool, num_segments: int) -> tuple:
    """What decides which kernels a call compiles, roughly: device, dtypes, head dims, layouts (row strides and
    contiguity are compile-time constants), an initial state, the tiles, whether a backward may follow, and
    whether the sequence is one segment and a multiple of 16 long (Triton specialises integer arguments on
    that). A call whose key was seen compiles nothing ahead; one that still meets a new kernel (another
    divisibility of a stride, say) compiles it at its launch, as Triton does by default."""
    n = q.shape[-2]
    return (q.device, q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1],
            tuple((x.stride(-2), x.is_contiguous()) for x in (q, k, v)), initial_state is not None, block_size,
            save_states, n % 16 == 0, num_segments > 1)


_FORWARD_PLANS: dict = {}   # replay key -> LaunchPlan of forward_impl's launchers, or None (not replayable)
_BACKWARD_PLANS: dict = {}  # replay key -> LaunchPlan of backward_impl's launchers, or None
_UNSEEN = object()


def recorded_launches() -> int:
    """The kernel launches in every launch plan recorded so far (calls that cannot be replayed record none): after
    :func:`forget_plans` and one forward + backward, the launches of that call."""
    return sum(len(plan.launches) for plan in (*_FORWARD_PLANS.values(), *_BACKWARD_PLANS.values())
               if plan is not None)


def forget_plans() -> None:
    """Drop every recorded launch plan: the next call of each key runs the launchers' host code again (and records
    anew): for whoever watches that host code run (the tests). A change of settings (:func:`~.plan.override`)
    needs no forgetting: the settings are part of every plan's key."""
    _FORWARD_PLANS.clear()
    _BACKWARD_PLANS.clear()


def _replay_key(tensors: tuple, log2_decay: Tensor, *options) -> tuple | None:
    """The key a call's :class:`~._tiles.LaunchPlan` is filed under, or None when the call is not one to replay.

    A call is replayed when its tensors (q, k, v, and in the backward do and the saved states) and ``log2_decay``
    are plain tensors on one device, dense (:func:`~._tiles.is_dense`: contiguous, on a 16-byte boundary), and
    ``log2_decay`` is float32: then no launcher copies, converts or re-lays out anything, and every choice the
    launchers make (tiles, segments, grids, strides, the kernels' specialisations) follows from the key: shapes,
    dtypes, the device, the options (block size, ...), Triton's debug and instrumentation settings, whether launches
    take the fast path, whether flagged programs are redone in place and whether the passes in time order may take
    descriptor tiles (the backend's :class:`~.plan.Settings`, all of them), and on a GPU the current device, whose stream the launches
    use. In the interpreter bfloat16 is converted (it computes it wrongly), so there a bfloat16 call is not
    replayed. A dimension of length 1 may carry any stride in a contiguous tensor: a replay passes the recorded
    one, which the kernels multiply only by index 0."""
    if not settings().replay or _tiles._AHEAD.get():  # inside compile_ahead the launchers only compile: nothing to record
        return None
    device = tensors[0].device
    for x in (*tensors, log2_decay):
        if type(x) is not torch.Tensor or x.device != device or not is_dense(x):
            return None
    if log2_decay.dtype != torch.float32:
        return None
    if interpreted(tensors[0]):
        if any(x.dtype == torch.bfloat16 for x in tensors):
            return None
        current = None
    else:
        current = torch.cuda.current_device()
    return (device, current, settings(), triton.knobs.runtime.debug,
            triton.knobs.compilation.instrumentation_mode, *options, *((x.shape, x.dtype) for x in tensors),
            log2_decay.shape)


def _replayed(plans: dict, key: tuple | None, inputs: tuple, prepare):
    """A call through its launch plan: replayed when ``plans`` holds one under ``key``; else ``prepare()`` (host
    code that runs before the launchers: checks, tile choices, compiling ahead) gives (launchers, args), and
    ``launchers(*args)`` runs, recorded into ``plans`` on the first call with ``key`` (filed as None when it
    cannot be replayed, and then never recorded again). ``key`` None: never replayed nor recorded."""
    plan = plans.get(key, _UNSEEN) if key is not None else None
    if plan is not None and plan is not _UNSEEN:
        return plan.replay(inputs)
    launchers, args = prepare()
    if plan is None:
        return launchers(*args)
    result, plan = record_plan(launchers, inputs, *args)
    if len(plans) >= 1024:  # a sweep over many shapes starts again
        plans.clear()
    plans[key] = plan
    return result


def _first_call(q, k, v, log2_decay, initial_state, block_size, save_states, num_segments) -> None:
    """On a configuration's first call on a GPU, compile the kernels of its forward, and of its backward when
    one may follow (``save_states``), side by side (:func:`~._tiles.compile_ahead`): the launchers run once on
    these tensors without launching. Chapter 14, section 14.8, shows what it saves (``python -m benchmarks.first_call``,
    notebooks/data/first_call_h100.json).
    What it costs besides: for that moment the device holds the buffers a forward + backward allocates (o, the
    states, dq, dk, dv), freed before the call itself runs."""
    key = ahead_key(q, k, v, initial_state, block_size, save_states, num_segments)
    if key in _COMPILED:
        return
    _COMPILED.add(key)

    def launchers():
        o, _, incoming = forward_impl(q, k, v, log2_decay, initial_state, block_size, save_states, ahead=False)
        if save_states:
            backward_impl(q, k, v, output_like(o), log2_decay, initial_state, None, incoming, block_size)

    compile_ahead(launchers)


def forward_impl(q: Tensor, k: Tensor, v: Tensor, log2_decay: Tensor, initial_state: Tensor | None = None,
                 block_size: int | None = None, save_states: bool = True,
                 ahead: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """What ``lightning_edu::la2_forward`` runs (and :class:`EagerLA2`'s forward): (o in v's dtype, final_state
    fp32, incoming), la2_fast's forward, its segment states saved when ``save_states``. With ``ahead`` (and
    the setting ``compile_ahead``), a configuration's first call on a GPU compiles its kernels side by side first."""
    key = _replay_key((q, k, v), log2_decay, block_size, save_states) if initial_state is None else None

    def prepare():
        cfg, seg_len, num_seg = launch_plan(q, v, block_size, save_states)
        if ahead and settings().compile_ahead and not interpreted(q) and not torch.cuda.is_current_stream_capturing():
            _first_call(q, k, v, log2_decay, initial_state, block_size, save_states, num_seg)
        return _forward_launchers, (q, k, v, log2_decay, initial_state, save_states, seg_len, cfg)

    o, sn, incoming = _replayed(_FORWARD_PLANS, key, (q, k, v, log2_decay), prepare)
    if incoming is None:  # one segment, or not asked: nothing saved, and an op returns a tensor
        incoming = sn.new_empty(0)
    return o.to(v.dtype), sn, incoming


def _forward_launchers(q, k, v, log2_decay, initial_state, save_states, seg_len, cfg):
    """(o, final state, incoming or None): la2_fast's forward on the backend's tiles."""
    # read where they lie (la2_fast.in_place): a strided view of a projection is not copied. The launchers return
    # o and the gradients laid out as output_like gives their inputs (what the fakes promise); upcast copies keep
    # their inputs' dimension order, and .to() keeps the layout.
    qc, kc, vc = upcast_for_interpreter(q, k, v)
    o, sn, *saved = la2_fast_forward(qc, kc, vc, log2_decay.float().contiguous(), initial_state,
                                     save_states=save_states, seg_len=seg_len, **cfg)
    return o, sn, saved[0][1] if saved else None


@torch.library.custom_op("lightning_edu::la2_forward", mutates_args=())
def la2_forward(q: Tensor, k: Tensor, v: Tensor, log2_decay: Tensor, initial_state: Tensor | None = None,
                block_size: int | None = None, save_states: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(o in v's dtype, final_state fp32, incoming): la2_fast's forward, its segment states saved when
    ``save_states``."""
    return forward_impl(q, k, v, log2_decay, initial_state, block_size, save_states)


@la2_forward.register_fake
def _la2_forward_fake(q, k, v, log2_decay, initial_state=None, block_size=None, save_states=True):
    _, _, num_seg = launch_plan(q, v, block_size, save_states)
    batch, heads, _, d_k = q.shape
    d_v = v.shape[-1]
    o = output_like(v)
    sn = q.new_empty((batch, heads, d_k, d_v), dtype=torch.float32)
    if save_states and num_seg > 1:
        incoming = q.new_empty((batch * heads, num_seg, d_k, d_v), dtype=torch.float32)
    else:
        incoming = q.new_empty((0,), dtype=torch.float32)
    return o, sn, incoming


def backward_impl(q: Tensor, k: Tensor, v: Tensor, do: Tensor, log2_decay: Tensor, initial_state: Tensor | None,
                  d_final_state: Tensor | None, incoming: Tensor, block_size: int | None = None,
                  d_initial_state: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """What ``lightning_edu::la2_backward`` runs (and :class:`EagerLA2`'s backward): (dq, dk, dv in q's, k's,
    v's dtypes, d_initial_state fp32) by the backend's backward kernel
    (:func:`~.plan.backward_kernel`), its dQ pass started from ``incoming``. With
    ``d_initial_state`` False (the eager door, when no initial state needs a gradient) None comes back in its
    place and its two small torch ops are skipped."""
    key = None
    if initial_state is None and d_final_state is None and not d_initial_state:
        key = _replay_key((q, k, v, do, incoming), log2_decay, block_size)

    def prepare():
        cfg, seg_len, num_seg = launch_plan(q, v, block_size)
        want = (q.shape[0] * q.shape[1], num_seg, q.shape[-1], v.shape[-1]) if num_seg > 1 else (0,)
        if tuple(incoming.shape) != want:
            raise ValueError(f"incoming must be the forward's saved segment states, shape {want} for these inputs "
                             f"and block_size, got {tuple(incoming.shape)}")
        return _backward_launchers, (q, k, v, do, log2_decay, initial_state, d_final_state, incoming, cfg, seg_len,
                                     num_seg, d_initial_state)

    # a plan is filed only after prepare's check passed, for a key that holds incoming's shape
    return _replayed(_BACKWARD_PLANS, key, (q, k, v, do, log2_decay, incoming), prepare)


def _backward_launchers(q, k, v, do, log2_decay, initial_state, d_final_state, incoming, cfg, seg_len, num_seg,
                        d_initial_state):
    """(dq, dk, dv, d_initial_state or None) by the backend's backward kernel on the backend's tiles."""
    qc, kc, vc, doc = upcast_for_interpreter(q, k, v, do)
    backward = VARIANTS[backward_kernel(qc.shape[-1], vc.shape[-1], qc.dtype)][1]
    dq, dk, dv, ds0 = backward(qc, kc, vc, doc, log2_decay.float().contiguous(), initial_state, d_final_state,
                               saved=(seg_len, incoming if num_seg > 1 else None), d_initial_state=d_initial_state,
                               **cfg)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), ds0


@torch.library.custom_op("lightning_edu::la2_backward", mutates_args=())
def la2_backward(q: Tensor, k: Tensor, v: Tensor, do: Tensor, log2_decay: Tensor, initial_state: Tensor | None,
                 d_final_state: Tensor | None, incoming: Tensor,
                 block_size: int | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv in q's, k's, v's dtypes, d_initial_state fp32) by the backend's backward kernel, its dQ pass
    started from ``incoming``."""
    return backward_impl(q, k, v, do, log2_decay, initial_state, d_final_state, incoming, block_size)


@la2_backward.register_fake
def _la2_backward_fake(q, k, v, do, log2_decay, initial_state, d_final_state, incoming, block_size=None):
    batch, heads, _, d_k = q.shape
    return (output_like(q), output_like(k), output_like(v),
            q.new_empty((batch, heads, d_k, v.shape[-1]), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, log2_decay, initial_state, block_size, _save_states = inputs
    incoming = output[2]
    ctx.set_materialize_grads(False)  # an unused final state must not cost a zero-gradient pass
    ctx.mark_non_differentiable(incoming)
    ctx.save_for_backward(q, k, v, log2_decay, initial_state, incoming)  # as given: upcast again if needed
    ctx.block_size = block_size


def _backward(ctx, do, d_sn, _d_incoming, backward=None):
    """The gradients of la2_forward's inputs: ``backward`` (the op ``la2_backward`` unless given) for q, k, v and
    the initial state, and for a learnable decay the tangent pass in torch ops."""
    backward = backward or la2_backward
    q, k, v, log2_decay, initial_state, incoming = ctx.saved_tensors
    needs = ctx.needs_input_grad  # (q, k, v, log2_decay, initial_state, block_size, save_states)
    if do is None and d_sn is None:
        return None, None, None, None, None, None, None
    if do is None:
        do = torch.zeros_like(v)
    log2_decay = log2_decay.detach()
    dq, dk, dv, ds0 = backward(q, k, v, do, log2_decay, initial_state, d_sn, incoming, ctx.block_size)
    d_log2 = None
    if needs[3]:  # a learnable decay: the tangent pass in torch ops; d/d(log2 lambda) = ln 2 lambda d/dlambda
        # (dL/dlambda first, then the factor lambda in float64: see decay_gradient and log2_decay_tensor)
        qc, kc, vc, doc = upcast_for_interpreter(q, k, v, do)
        lam = torch.exp2(log2_decay.double())
        d_lam = decay_gradient(qc, kc, vc, doc, lam, initial_state, d_sn, wrt="lambda")
        d_log2 = (d_lam * lam * math.log(2.0)).to(log2_decay.dtype)
    d_state = ds0.to(initial_state.dtype) if initial_state is not None and needs[4] else None
    return dq, dk, dv, d_log2, d_state, None, None


la2_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerLA2(torch.autograd.Function):
    """``la2_forward`` with its registered backward, minus the dispatcher: the same implementations
    (:func:`forward_impl`, :func:`backward_impl`) and the same context code, called as an autograd Function.

    Why a second door to the same kernels. Through the dispatcher each custom-op call pays for its schema
    handling, the autograd wrapper that ``register_autograd`` installs, and the alias checks on its outputs, a
    host cost several times that of the replayed kernels of a short sequence (chapter 14, section 14.8;
    ``python -m benchmarks.host``, notebooks/data/host_h100.json).
    :func:`~lightning_edu.triton_kernels.triton_attention` takes this door for plain tensors in eager mode when a
    gradient may follow (with none to follow it calls :func:`forward_impl` alone), and the op under
    :func:`torch.compile` (which cannot trace a Triton launch inside a Function) and for tensor subclasses (fake,
    functional and meta tensors know the op, not this class).
    """

    @staticmethod
    def forward(ctx, q, k, v, log2_decay, initial_state, block_size, save_states):
        output = forward_impl(q, k, v, log2_decay, initial_state, block_size, save_states)
        _setup_context(ctx, (q, k, v, log2_decay, initial_state, block_size, save_states), output)
        return output

    @staticmethod
    def backward(ctx, do, d_sn, d_incoming):
        # Under create_graph=True the kernels' backward becomes a node that refuses to be differentiated again,
        # as the op's does, rather than let a second derivative come back without the attention's term.
        need_ds0 = ctx.needs_input_grad[4]  # an initial state that requires a gradient

        def kernels(*args):
            return first_derivative_only("the triton backend", backward_impl, *args, need_ds0)

        return _backward(ctx, do, d_sn, d_incoming, backward=kernels)
