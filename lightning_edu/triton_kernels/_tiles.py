"""Small helpers shared by the Triton kernels: launch-time tile choices, the bf16 guard of the CPU
interpreter, and the ``@triton.jit`` helpers that keep non-finite values causal.

Non-finite values and causality. Two traps make a NaN or inf at a later token leak into earlier rows of its
block. (a) A score tile masked by *multiplying* with a mask that holds 0 above the diagonal: NaN * 0 = NaN.
(b) The next product, ``P @ V``: the dense tile product multiplies P's zero upper triangle by V's later rows,
and 0 * NaN = NaN again. The exact tiles: :func:`apply_decay` with SAFE selects dropped entries away
(``tl.where``); :func:`finite_operand` zeroes the non-finite entries of the right operand of the intra-block
product and records, per column, the first (causal tile) or last (anti-causal tile) row holding one;
:func:`poison` then sets to NaN exactly the output entries that depend on such an entry. State updates
(KV += K^T V, ...) keep the raw operands, so a non-finite value still reaches every later block through the
state, as the algebra says it must.

Two passes, so that finite inputs pay (almost) nothing. The exact tiles cost shared-memory round trips and
layout changes on every tile, and compiled into the same kernel behind a branch that never runs they may
raise its register count for the whole kernel: on the first kernels of this package, exact tiles in every
sweep, or an exact re-sweep in the same kernel, made them several times slower. So each kernel is compiled
with the constexpr SAFE off (the fast pass) and on (the exact pass), and by default launched twice:

* The fast pass (SAFE=False, the usual grid) is the plain kernel (masks that multiply, raw
  operands), plus one flag per program: whether its carried state (LA-2) or its output tile (LA-1) ended
  non-finite. Every inexact result of the fast pass comes from a non-finite entry of a K- or V-like operand
  (one that meets a dropped entry of the score tile, or is the right operand of the intra-block product),
  and every such entry also enters a dense product into that state or output, where 0 * NaN = NaN makes it
  non-finite: no inexact program goes unflagged. The flag is set in whichever way left the compiled fast
  kernel as it was (measured): :func:`clear_flag` then :func:`flag_nonfinite` (masked stores, no
  reduction), or :func:`stored_nonfinite` (the stored tile read back and reduced).
* The exact pass (SAFE=True, about one program per SM: :func:`exact_pass_grid`) scans the flags with one
  vector load per program and redoes only the flagged programs, rewriting their outputs (states and flags it
  leaves alone: the fast pass computed the states exactly). On finite inputs it costs one vector load of flags
  per program on the GPU and one more launch on the host.

A flag can also be raised by a non-finite value the fast pass handled exactly (a q, an initial state, an
fp16 overflow): that only costs the exact pass's time, never a wrong result.

In place, where it costs little. The backend's kernels with 16-bit tiles and a state of at most 64 x 64
(:func:`redo_in_place`) hold both passes in one program: the fast sweep, its flag, then (:func:`flagged_here`)
the exact sweep of the same program when its flag is set: their GPU time barely moves, while a short forward +
backward, bound by the host, launches three kernels fewer (:func:`redo_in_place`). The exact pass of the other
kernels (la1, la2_literal, la2_fast's fused dK/dV, the one-pass forward of ``lookback``, la2_tma's descriptor
kernel, float32 tiles, larger states) stays a launch of its own.

How the kernels are written (every kernel of this package, so that one reads like the next):

* **Pointers** are capitals named after the tensor (``Q``, ``K``, ``V``, ``O``, ``DO``, ``DQ``, ``S0``, ``SN``,
  ``SEG``, ``FLAG``, ``LOG2_DECAY``). A program moves each of them to its own (batch, head) once, at the top
  (:func:`head_start`, in 64 bits, so that no head's start overflows 32 bits however large the batch); below
  that line every offset is within one head, in 32 bits (n * d < 2**31: up to 16M tokens at d = 128):
  ``rows * D + offs_k`` for an (n, d) tensor, ``state_offs`` for a (d_k, d_v) state. la2_fast's kernels, the
  backend's, also read and write (batch, heads, n, d) tensors in place whatever their layout, as long as the
  head dim is contiguous: they take each tensor's batch, head and row strides (``sqb, sqh, sqn`` for Q, and so
  on), move to a head with :func:`head_offset` and address a row as ``rows * sqn + offs_k``. A model's
  ``qkv(x).view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)`` is such a tensor: no copy on the way in, and an output
  laid out as (batch, n, heads, d) costs none on the way out.
* **Offsets**: ``offs_r`` (rows of a block, 0 .. BLOCK-1), ``offs_k`` / ``offs_v`` (columns of d_k / d_v),
  ``rows`` / ``cols`` (positions in the sequence); masks ``k_ok``, ``v_ok``, ``row_ok``.
* **Compile-time constants**, one meaning each: ``D_K``, ``D_V`` the head dims; ``PAD_K``, ``PAD_V`` a whole
  head dim padded to a tile width (:func:`pad_dim`); ``BLOCK_DK``, ``BLOCK_DV`` the slice of d_k or d_v one
  program owns; ``BLOCK`` (LA-2: rows per block), ``BLOCK_M`` / ``BLOCK_N`` (LA-1: query / key rows),
  ``CHUNK`` / ``MICRO`` (LA-3); ``PRECISION`` the ``input_precision`` of every ``tl.dot`` (:func:`dot_precision`);
  ``SAFE`` the exact pass, ``SCAN`` the flags one exact-pass program scans.
* **Counts are not specialised on; lengths are.** Triton compiles a kernel again for each integer argument that
  is 1 or a multiple of 16, so that it may fold or align with it. The head count (``H`` or ``heads``) and the
  number of programs (``n_programs``) are listed in ``do_not_specialize``: one compilation serves every head
  count and grid. The sequence length ``n`` and ``seg_len`` stay specialised, as do the strides: a forward with
  ``n`` unspecialised ran slower, while unspecialising the counts changed nothing measurable.
* **Dots** carry their shapes in a comment, ``(rows, inner) @ (inner, cols)``.
* The decay tile (:func:`decay_tile`), the exact pass's dispatch (:func:`flagged_range`) and the tile widths
  (:func:`pad_dim`) live here, once.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import operator
import os
from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from .plan import cdiv, interpreted, next_power_of_2, settings, sm_count

__all__ = [
    "launch", "launch_key", "launch_keyed", "LaunchPlan", "record_plan", "aligned", "dense", "compile_ahead", "dot_precision",
    "upcast_for_interpreter", "refuse_interpreted_bf16", "exact_pass_grid", "head_start", "head_offset",
    "flagged_range", "dropped", "decay_tile", "apply_decay", "finite_operand", "poison", "stored_nonfinite",
    "clear_flag", "flag_nonfinite", "flagged_here",
]


_AHEAD = contextvars.ContextVar("lightning_edu_compile_ahead", default=False)


_LAUNCHED: dict = {}  # launch_key -> (compiled kernel, the values of the parameters not passed by position)


def launch(kernel, grid):
    """``kernel[grid]``, the launch; inside :func:`compile_ahead`, a warm-up instead: the kernel is compiled for
    these arguments (handed to a compiler thread) and nothing runs. The backend's launchers launch through this.
    On a GPU (with the setting ``fast_launch``, :class:`~.plan.Settings`) a launch whose specialisation was launched before skips Triton's
    launch-time work: :func:`_fast_launch`. Inside :func:`record_plan` the launch also goes into the plan
    being recorded."""
    if _AHEAD.get():
        return functools.partial(kernel.warmup, grid=grid)
    recorder = _RECORDER.get()
    if recorder is not None:
        return functools.partial(_recorded_launch, recorder, kernel, grid)
    if settings().fast_launch and isinstance(kernel, JITFunction):  # not the interpreter's functions, nor a stand-in
        return functools.partial(_fast_launch, kernel, grid)
    return kernel[grid]


def _spec(x):
    """What Triton may specialise a (not constexpr) argument on, or more: an integer's divisibility by 16, whether
    it is 1, and its width (i32, i64, u64); a tensor's dtype and whether its address is 16-byte aligned; a tensor
    descriptor's tensor (as a tensor), tile shape, padding, shape and strides (as integers); a None; a bool's
    value; any other value's type."""
    if type(x) is int:
        return x % 16 == 0, x == 1, -2**31 <= x < 2**31, x < 2**63
    if isinstance(x, torch.Tensor):
        return x.dtype, aligned(x)
    if isinstance(x, TensorDescriptor):
        return (TensorDescriptor, _spec(x.base), tuple(x.block_shape), x.padding,
                tuple(_spec(int(s)) for s in (*x.shape, *x.strides)))
    return x if x is None or type(x) is bool else type(x)


_CONSTEXPR: dict = {}  # kernel -> for each parameter, whether it is a tl.constexpr


def launch_key(kernel, args, meta, device: int) -> tuple:
    """The key of :func:`_fast_launch`: the kernel, the device (an index), Triton's debug and instrumentation
    settings, the keyword arguments (constexprs and options) by value, the positional constexprs by value, and
    :func:`_spec` of every other positional argument. Two launches with one key compile to one kernel."""
    constexpr = _CONSTEXPR.get(kernel)
    if constexpr is None:  # as Triton tells one (KernelParam.is_constexpr), from the kernel's Python signature
        constexpr = _CONSTEXPR[kernel] = tuple("constexpr" in str(p.annotation)
                                               for p in inspect.signature(kernel.fn).parameters.values())
    return (kernel, device, triton.knobs.runtime.debug,
            triton.knobs.compilation.instrumentation_mode, tuple(meta.items()),
            tuple([x if const else _spec(x) for x, const in zip(args, constexpr)]))


def _fast_launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``, with Triton's launch-time work done once per specialisation.

    Why. A short call of the backend is bound by the host, a forward + backward launches 6 to 10 kernels, and
    each ``kernel[grid]`` launch does several times the work of the compiled kernel's own launcher (binding and
    specialising 13 to 26 arguments, the cache key, the stream, launch metadata). Chapter 14, section 14.8, shows the host's
    time per call (``python -m benchmarks.host``, notebooks/data/host_h100.json).

    How. The key (:func:`launch_key`) holds everything Triton specialises a launch on, or finer: every constexpr
    by value, whether passed by keyword or by position (a row stride is one), and what Triton reads of every
    other argument (:func:`_spec`). Two launches with one key compile to one kernel. The first launch with a key
    goes through ``kernel[grid]`` (compiling if needed) and keeps the compiled kernel it returns; later ones call
    that kernel's launcher as Triton does, with the same arguments, launch metadata and launch hooks (profilers
    use them). A kernel with pre-run hooks launches the slow way. What is skipped: Triton's check that the
    kernel's global variables have not changed since it was compiled (this package's kernels read none).
    """
    if kernel.pre_run_hooks:
        return kernel[grid](*args, **meta)
    key = launch_key(kernel, args, meta, torch.cuda.current_device())
    hit = _LAUNCHED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **meta)
        if len(_LAUNCHED) >= 4096:  # a sweep over many lengths or constants starts again
            _LAUNCHED.clear()
        _LAUNCHED[key] = (compiled, _rest(kernel, args, meta))
        return compiled
    compiled, rest = hit
    _run_compiled(compiled, grid, rest, key[1], *args)
    return compiled


_KEYED: dict = {}  # (caller's key, device, Triton's debug and instrumentation settings) -> (compiled, rest)


def launch_keyed(key, kernel, grid, *args, **meta):
    """``launch(kernel, grid)(*args, **meta)`` for a caller that names its launch's specialisation itself.

    ``key`` must determine everything :func:`launch_key` reads of this launch: the kernel, the keyword arguments'
    values, and of each other argument what :func:`_spec` reads (a tensor's dtype and 16-byte alignment, an
    integer's divisibility by 16, whether it is 1, its width). A launch whose key (with the current device and
    Triton's debug and instrumentation settings) was launched before calls the kernel it compiled to, through its
    own launcher, without computing :func:`launch_key`. Why: for a launch of a few microseconds of GPU work, a
    decoding step's, computing that key costs the host more than the launcher does. Inside :func:`compile_ahead`
    or :func:`record_plan`, with ``fast_launch`` off, or for a kernel that is not a ``JITFunction`` (the
    interpreter's) it is :func:`launch` itself."""
    if (_AHEAD.get() or _RECORDER.get() is not None or not settings().fast_launch
            or not isinstance(kernel, JITFunction) or kernel.pre_run_hooks):
        return launch(kernel, grid)(*args, **meta)
    device = torch.cuda.current_device()
    full = (key, device, triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)
    hit = _KEYED.get(full)
    if hit is None:
        compiled = _fast_launch(kernel, grid, *args, **meta)
        if len(_KEYED) >= 4096:
            _KEYED.clear()
        _KEYED[full] = (compiled, _rest(kernel, args, meta))
        return compiled
    _run_compiled(hit[0], grid, hit[1], device, *args)
    return hit[0]


def _rest(kernel, args, meta) -> tuple:
    """The values of a kernel's parameters not passed by position: given by keyword, or their defaults."""
    return tuple(meta[p.name] if p.name in meta else p.default for p in kernel.params[len(args):])


def _run_compiled(compiled, grid, rest, device: int, *args):
    """A compiled kernel's own launcher, called as Triton calls it: on ``device``'s current stream, with the
    launch metadata and Triton's launch hooks (profilers use them)."""
    runtime = triton.knobs.runtime
    stream = torch._C._cuda_getCurrentRawStream(device)
    compiled.run(*_grid3(grid), stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *args, *rest), runtime.launch_enter_hook,
                 runtime.launch_exit_hook, *args, *rest)


def _grid3(grid) -> tuple:
    """A grid of one to three dimensions as the three a launcher takes, the missing ones 1."""
    return (*grid, 1, 1)[:3]


_RECORDER = contextvars.ContextVar("lightning_edu_launch_recorder", default=None)


def _recorded_launch(recorder: list, kernel, grid, *args, **meta):
    """Launch as :func:`launch` would, and append to ``recorder`` a runner that launches the same kernel, on the
    same grid with the same keyword arguments, on other positional arguments."""
    if settings().fast_launch and isinstance(kernel, JITFunction) and not kernel.pre_run_hooks:
        compiled = _fast_launch(kernel, grid, *args, **meta)
        # the current device is part of the plan's key (ops._replay_key): a replay runs on the same one
        runner = functools.partial(_run_compiled, compiled, grid, _rest(kernel, args, meta),
                                   torch.cuda.current_device())
        recorder.append((runner, args))
        return compiled
    recorder.append((functools.partial(_run_launch, kernel, grid, meta), args))
    return kernel[grid](*args, **meta)


def _run_launch(kernel, grid, meta, *args):
    kernel[grid](*args, **meta)


class LaunchPlan:
    """A launcher's calls, recorded once and replayed: the buffers it allocated, the kernels it launched (with
    the same grids and constants) and where its outputs came from. :meth:`replay` allocates the buffers afresh
    and launches the same kernels on new inputs of the same shapes, strides and dtypes, and none of the host
    code that chose them runs again.

    Why. A short call is bound by the host, and the launchers' Python (tile choices, segment counts, grids,
    strides, launch keys) computes the same answers for every call with the same shapes. The backward is where
    this matters most: autograd runs it on a thread of its own, where the same Python took the host several
    times as long (chapter 14, section 14.8).

    What a plan may hold, checked as it is built (:func:`record_plan` returns None otherwise): every tensor
    handed to a kernel is either one of the call's inputs (the same object) or a buffer the launchers allocated
    during the call: a tensor of its own storage, at offset 0, never written by a torch operation (its version
    counter still 0; under ``torch.inference_mode`` tensors have none, and this check is skipped), and shared
    with no other tensor. A tensor descriptor (:class:`TensorDescriptor`) must describe one of those tensors: it
    holds its tensor's address, so a replay builds it afresh on the replay's tensor, with the recorded shape,
    strides, tile and padding (``dataclasses.replace``; Triton's launcher encodes the TMA's copy of it at each
    launch, as it does for every call). What the caller must hold: the launchers allocate with
    ``torch.empty``-like calls, write their buffers only through kernels, and choose everything from the key the
    caller files the plan under (shapes, strides, dtypes, device, options). The backend's callers
    (:mod:`.ops`) record only calls whose inputs are contiguous, aligned and need no conversion, where that holds.
    """

    __slots__ = ("buffers", "launches", "outputs", "before", "_blank", "_steps", "_direct", "_pick_outputs")

    # A template entry is (kind, x): (0, input index), (1, buffer index), (2, value), or (3, (kind, index,
    # descriptor)): a tensor descriptor like the recorded ``descriptor``, of the input (kind 0) or buffer (1).

    def __init__(self, buffers, launches, outputs):
        self.buffers = buffers    # (shape, stride, dtype, device) per buffer, numbered in the order of first use
        self.launches = launches  # (runner, template): template entries as above
        self.outputs = outputs    # template entries, as above
        # How many buffers exist before each launch: those it or an earlier launch uses. A replay allocates each
        # buffer just before the first launch that needs it, so on a call bound by the host the first kernel is
        # on its way while the later buffers are being allocated.
        self.before, count = [], 0
        for _, template in launches:
            count = max([count, *(x + 1 for kind, x in template if kind == 1),
                         *(x[1] + 1 for kind, x in template if kind == 3 and x[0] == 1)])
            self.before.append(count)
        # A replay works in one list, its pool: a slot per buffer, then every value the launches pass, then the
        # call's inputs. Each launch's arguments are picked from the pool by one operator.itemgetter (C code),
        # not rebuilt by a Python loop over its template (a dozen to two dozen entries a launch).
        direct = _direct_launches(launches)
        values: list = []
        derived: list = [[] for _ in launches]  # per launch: (pool index, its tensor's pool index, descriptor)

        def slot(kind, x, n=None):  # a pool index; an input's is negative until the values are counted
            if kind == 1:
                return x
            if kind == 2:
                values.append(x)
                return len(buffers) + len(values) - 1
            if kind == 3:  # a slot of its own, filled at each replay just before launch n
                values.append(None)
                derived[n].append((len(buffers) + len(values) - 1, slot(*x[:2]), x[2]))
                return derived[n][-1][0]
            return -1 - x

        picks = [[slot(kind, x, n) for kind, x in template] for n, (_, template) in enumerate(launches)]
        rests = [[slot(2, x) for x in rest] for *_, rest in direct[1]] if direct is not None else None
        out = [slot(kind, x) for kind, x in outputs]
        first_input = len(buffers) + len(values)

        def place(slots):
            return [first_input - 1 - i if i < 0 else i for i in slots]

        self._blank = (None,) * len(buffers) + tuple(values)
        self._steps = []
        for n, ((runner, _), ix) in enumerate(zip(launches, picks)):
            new = range(self.before[n - 1] if n else 0, self.before[n])
            allocs = tuple((b, *buffers[b]) for b in new)
            rebuilt = tuple((at, *place([of]), desc) for at, of, desc in derived[n])
            self._steps.append((allocs, rebuilt, runner, _picker(place(ix)),
                                None if rests is None else _picker(place(ix) + place(rests[n]))))
        self._direct = None if direct is None else (direct[0], tuple(call[:6] for call in direct[1]))
        self._pick_outputs = _picker(place(out))

    def replay(self, inputs: tuple) -> tuple:
        pool = [*self._blank, *inputs]
        empty = torch.empty_strided
        runtime = triton.knobs.runtime
        if self._direct is not None and _no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook):
            # Every launch a compiled kernel's, on one device, and no launch hook set: each kernel's own launcher is
            # called as _run_compiled would call it, with the stream looked up once and neither launch metadata
            # (built only for a hook) nor hooks: the launcher alone costs the host less than _run_compiled's
            # wrapper (chapter 14, section 14.8, gives the measurement).
            device, calls = self._direct
            stream = torch._C._cuda_getCurrentRawStream(device)
            for (allocs, rebuilt, _, _, pick), (run, x, y, z, function, packed) in zip(self._steps, calls):
                for b, shape, stride, dtype, on in allocs:
                    pool[b] = empty(shape, stride, dtype=dtype, device=on)
                for at, of, desc in rebuilt:
                    pool[at] = replace(desc, base=pool[of])
                run(x, y, z, stream, function, packed, None, None, None, *pick(pool))
        else:
            for allocs, rebuilt, runner, pick, _ in self._steps:
                for b, shape, stride, dtype, on in allocs:
                    pool[b] = empty(shape, stride, dtype=dtype, device=on)
                for at, of, desc in rebuilt:
                    pool[at] = replace(desc, base=pool[of])
                runner(*pick(pool))
        return self._pick_outputs(pool)


def _picker(indices: list):
    """pool -> the tuple of pool[i] for i in indices (an itemgetter, which returns a lone item bare)."""
    if len(indices) == 1:
        (i,) = indices
        return lambda pool: (pool[i],)
    return operator.itemgetter(*indices) if indices else (lambda pool: ())


_HOOK_CHAIN = getattr(triton.knobs, "HookChain", ())  # newer Tritons keep launch hooks in chains, empty by default


def _no_hook(hook) -> bool:
    """Whether a launch hook of ``triton.knobs.runtime`` calls nothing: None, or an empty chain of hooks."""
    return hook is None or (isinstance(hook, _HOOK_CHAIN) and not hook.calls)


def _direct_launches(launches) -> tuple | None:
    """(device, calls) when every launch of a plan is a compiled kernel's (:func:`_run_compiled`) on one device:
    per launch, its launcher, grid, function handle, packed metadata and trailing parameter values, each
    looked up once here instead of at every replay. None otherwise (a stand-in, the interpreter, pre-run hooks)."""
    calls, devices = [], set()
    for runner, template in launches:
        if not (isinstance(runner, functools.partial) and runner.func is _run_compiled and not runner.keywords):
            return None
        compiled, grid, rest, device = runner.args
        calls.append((compiled.run, *_grid3(grid), compiled.function, compiled.packed_metadata, rest))
        devices.add(device)
    return (devices.pop(), tuple(calls)) if len(devices) == 1 else None


def record_plan(run, inputs: tuple, *args, **kwargs):
    """``(run(*args, **kwargs), plan)``: the result of the call, and a :class:`LaunchPlan` of it for ``inputs``
    (the tensors a replay is given, in this order), or None when the call cannot be replayed. ``run`` must
    return a flat tuple of tensors (each an input or a buffer) and Nones."""
    recorder: list = []
    token = _RECORDER.set(recorder)
    try:
        result = run(*args, **kwargs)
    finally:
        _RECORDER.reset(token)
    return result, _build_plan(recorder, inputs, result)


def _build_plan(recorder, inputs, result):
    index = {id(x): i for i, x in enumerate(inputs) if x is not None}
    storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor) and x.numel()}
    buffers, where = [], {}

    def entry(x):
        if isinstance(x, TensorDescriptor):  # rebuilt at each replay on the replay's tensor (LaunchPlan)
            kind, at = entry(x.base)
            if kind == 2:
                raise _NotReplayable
            return 3, (kind, at, x)
        if not isinstance(x, torch.Tensor):
            return 2, x
        if id(x) in index:
            return 0, index[id(x)]
        if id(x) not in where:
            storage = x.untyped_storage()
            written = not x.is_inference() and x._version != 0  # an inference tensor has no version counter
            if (written or x.storage_offset() != 0 or storage.data_ptr() in storages
                    or storage.nbytes() != x.numel() * x.element_size()):
                raise _NotReplayable
            storages.add(storage.data_ptr())
            where[id(x)] = len(buffers)
            buffers.append((tuple(x.shape), x.stride(), x.dtype, x.device))
        return 1, where[id(x)]

    try:
        launches = [(runner, tuple(entry(x) for x in args)) for runner, args in recorder]
        outputs = []
        for x in result:
            if isinstance(x, torch.Tensor) and id(x) not in index and id(x) not in where:
                raise _NotReplayable  # made by a torch operation, not by a kernel
            outputs.append(entry(x))
    except _NotReplayable:
        return None
    return LaunchPlan(buffers, launches, tuple(outputs))


class _NotReplayable(Exception):
    pass


def compile_ahead(run, *args, workers: int | None = None, **kwargs) -> bool:
    """Call ``run(*args, **kwargs)`` (host code that launches kernels through :func:`launch`) without launching
    anything, compiling every kernel it would launch, in parallel threads; return once all are compiled.

    Why. Triton compiles a kernel the first time it is launched with new compile-time constants, and a launcher
    waits for each compilation before the next launch: the first forward + backward of the backend compiles
    eight or more kernels one after another. Here they compile side by side (Triton's ``AsyncCompileMode``, a
    thread pool of ``workers``, default one per CPU core up to 16): most of a compilation runs in C++ (MLIR
    passes) and in ``ptxas``, outside Python's global lock. The tensors ``run`` allocates are real but never
    written by a kernel; torch operations between launches run on them as usual. A later real call finds every
    kernel compiled. Returns False, having done nothing, when this Triton has no ``AsyncCompileMode``.
    """
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: kernels compile at their first launch, one by one
        return False
    from concurrent.futures import ThreadPoolExecutor

    workers = workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool):
        token = _AHEAD.set(True)
        try:
            run(*args, **kwargs)
        finally:
            _AHEAD.reset(token)
    return True


def dot_precision(x: torch.Tensor) -> str:
    """``input_precision`` of tl.dot: full fp32 ("ieee") for fp32 inputs, the correctness rung; "tf32" for
    16-bit inputs, whose operands are already coarser than tf32."""
    return "ieee" if x.dtype in (torch.float32, torch.float64) else "tf32"


def exact_pass_grid(programs: int, device) -> tuple[tuple[int], int]:
    """(grid, SCAN) of an exact pass over ``programs`` fast-pass programs: about one program per SM, each
    scanning SCAN flags (a power of two, at least 16) with one vector load and redoing the flagged ones."""
    scan = max(16, next_power_of_2(cdiv(programs, sm_count(device))))
    return (cdiv(programs, scan),), scan


def aligned(x) -> bool:
    """Whether tensor x starts on a 16-byte boundary. Every tensor torch allocates does; a view at an offset (a
    slice of a larger buffer, ``x[1:]`` of a flat one) may not. See :func:`dense`."""
    return x.data_ptr() % 16 == 0


def is_dense(x) -> bool:
    """Whether the kernels take tensor x as it is: contiguous and on a 16-byte boundary (:func:`aligned`).
    :func:`dense` copies any other; the launch plans of :mod:`.ops` replay only calls whose tensors are all dense."""
    return x.is_contiguous() and aligned(x)


def dense(x):
    """x itself when it is contiguous and starts on a 16-byte boundary (:func:`is_dense`), else a contiguous copy
    (a fresh allocation, which is aligned); None as None. The kernels are handed only aligned tensors.

    Why. Triton specialises a launch on whether each pointer is 16-byte aligned and compiles another kernel
    when one is not, with narrower loads. Compiled by Triton 3.6 for a GPU of compute capability 9.0, la2_fast's
    main kernel for a 16-bit key tensor one element off an aligned start gave wrong outputs at d_k = 64,
    d_v = 32 (o, and dV, whose pass reads Q as its key), and in bf16 with one pipeline stage it read outside its
    tensors (an illegal memory access); the same values from an aligned copy were right (chapter 07). A copy
    costs one trip through memory, for inputs that are rare: torch aligns every tensor it allocates."""
    if x is None or is_dense(x):
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def upcast_for_interpreter(*xs):
    """bfloat16 tensors bound for Triton's CPU interpreter, as float32 (the interpreter computes bf16 wrongly);
    everything else (CUDA tensors, other dtypes, None) as given."""
    return tuple(x.float() if x is not None and x.dtype == torch.bfloat16 and interpreted(x) else x for x in xs)


def refuse_interpreted_bf16(who: str, *tensors) -> None:
    """Raise TypeError for bfloat16 tensors headed for the CPU interpreter, whose bf16 arithmetic is wrong
    (values ~1e10 where ~1e2 is right). On CUDA nothing is checked; anything but a torch tensor is skipped."""
    for x in tensors:
        if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16 and interpreted(x):
            raise TypeError(
                f"{who}: Triton's CPU interpreter computes bfloat16 wrongly; pass float32/float16 tensors, "
                f"or use lightning_attention(..., backend='triton'), which upcasts"
            )


@triton.jit
def head_start(bh, rows, width):
    """Offset of (batch*head) ``bh``'s first element in a contiguous (batch*heads, rows, width) tensor, in 64 bits:
    ``bh * rows * width`` passes 2**31 when the tensor holds 2**31 elements (4 GiB of bf16), a training batch."""
    return tl.cast(bh, tl.int64) * rows * width  # bh may be a loop index: a Python int in the interpreter


@triton.jit
def head_offset(bh, H, rows, width, stride_b, stride_h, CONTIGUOUS: tl.constexpr):
    """Offset of (batch*head) ``bh``'s first element, batch ``bh // H`` and head ``bh % H``, in a (batch, heads,
    rows, width) tensor with batch stride ``stride_b`` and head stride ``stride_h``, in 64 bits. With CONTIGUOUS
    (the tensor is), the same offset as :func:`head_start` computes it: the reversed passes of la2_fast ran
    slower with the offset computed from the strides (see ``_la2_fast_forward_kernel``)."""
    if CONTIGUOUS:
        return head_start(bh, rows, width)
    bh = tl.cast(bh, tl.int64)  # bh may be a loop index: a Python int in the interpreter
    return (bh // H) * stride_b + (bh % H) * stride_h


@triton.jit
def flagged_range(FLAG, n_programs, SCAN: tl.constexpr):
    """The exact pass's share of the fast pass's programs: (first, stop), SCAN programs from program_id(0) * SCAN,
    read with one vector load of their flags; stop = first (nothing to redo) when none of them is flagged.
    The caller loops ``for i in range(first, stop)`` and redoes program i when ``tl.load(FLAG + i) != 0``."""
    first = tl.program_id(0) * SCAN
    ids = first + tl.arange(0, SCAN)
    any_flagged = tl.max(tl.load(FLAG + ids, mask=ids < n_programs, other=0), axis=0) != 0
    return first, tl.where(any_flagged, tl.minimum(first + SCAN, n_programs), first)


@triton.jit
def dropped(SAFE: tl.constexpr):
    """The value a decay tile holds on dropped (above-diagonal or padded) entries: -1 in the exact pass, where
    :func:`apply_decay` selects them away, 0 in the fast pass, where it multiplies."""
    if SAFE:
        return -1.0
    else:
        return 0.0


@triton.jit
def decay_tile(log2_lam, rows, cols, SAFE: tl.constexpr):
    """The decay mask of a score tile: lambda^(rows[r] - cols[s]) where rows[r] >= cols[s], :func:`dropped` above
    the diagonal. Positions may be absolute (LA-1's query and key blocks) or within one block (LA-2's M, with
    rows = cols = offs_r). The exponent is clamped at 0 before exp2, so no negative power of lambda (which
    overflows) is ever formed; lambda = 1 gives exp2(0) = 1 exactly."""
    distance = rows[:, None] - cols[None, :]
    return tl.where(distance >= 0, tl.exp2(log2_lam * tl.maximum(distance, 0).to(tl.float32)), dropped(SAFE))


@triton.jit
def apply_decay(dot, decay, SAFE: tl.constexpr):
    """A masked score tile: ``dot * decay`` on kept entries (decay = lambda^distance, which may underflow to 0),
    0 on dropped ones. SAFE (the exact pass): dropped entries (decay = -1) are *selected* away, so a NaN or inf
    there never becomes NaN * 0 = NaN. Fast pass: the plain multiply by a decay tile holding 0 there, which
    adds nothing to the fast kernel; a non-finite dot entry in a dropped place always comes from an operand the fast pass's state
    check sees (module docstring), so the exact pass redoes that program."""
    if SAFE:
        return tl.where(decay >= 0, dot * decay, 0.0)
    else:
        return dot * decay


@triton.jit
def finite_operand(x, pos, CAUSAL: tl.constexpr, AXIS: tl.constexpr = 0):
    """The right operand ``x`` of a masked tile product, made safe: returns (x with its non-finite entries
    set to 0, edge). ``pos`` holds the positions of x's rows (along ``AXIS``: 0 for an (rows, d) tile, 1 for
    a transposed (d, rows) tile); padded rows are loaded as 0 and never count. ``edge`` has one entry per
    column of the row-major operand: for a CAUSAL tile (output row r sees operand rows s <= r) the first
    position holding a non-finite value (2**30 if none), else (anti-causal: row s sees rows r >= s) the last
    one (-1 if none). Cost: one test, two selects, one reduction over the rows.
    """
    ok = (x - x) == 0  # False exactly for inf and NaN
    if AXIS == 0:
        p = pos[:, None]
    else:
        p = pos[None, :]
    if CAUSAL:
        edge = tl.min(tl.where(ok, 2**30, p), axis=AXIS)
    else:
        edge = tl.max(tl.where(ok, -1, p), axis=AXIS)
    return tl.where(ok, x, 0.0), edge


@triton.jit
def poison(out, pos, edge, CAUSAL: tl.constexpr):
    """``out`` (rows at positions ``pos``, one column per entry of ``edge`` from :func:`finite_operand`) with
    NaN exactly where the product depends on a non-finite operand entry: pos >= edge (causal) or
    pos <= edge (anti-causal)."""
    if CAUSAL:
        hit = pos[:, None] >= edge[None, :]
    else:
        hit = pos[:, None] <= edge[None, :]
    return tl.where(hit, float("nan"), out)


@triton.jit
def stored_nonfinite(ptrs, mask):
    """Fast pass, last thing in a program: whether the tile it just stored at ``ptrs`` (masked by ``mask``)
    holds an inf or NaN, as a scalar to store as its flag. The tile is read back (from L2, after a barrier)
    rather than tested in registers: testing the accumulator changed LA-1's compiled forward kernel and slowed
    it, the read-back leaves it (almost) as it was."""
    tl.debug_barrier()
    back = tl.load(ptrs, mask=mask, other=0.0)
    return tl.sum(tl.sum(back.to(tl.float32) * 0.0, axis=1), axis=0) != 0.0


@triton.jit
def clear_flag(flag):
    """Fast pass, first thing in a program: its flag := 0 (the barrier orders this store before any later one)."""
    tl.store(flag, 0)
    tl.debug_barrier()


@triton.jit
def flagged_here(flag):
    """In a fast pass that redoes its own flagged program (the setting ``exact_in_place``, :func:`~.plan.redo_in_place`), after :func:`flag_nonfinite`:
    whether this program's flag is set. The barrier makes every thread's flag store visible to every thread, so
    the whole program takes the same branch; no reduction over the tile (see :func:`flag_nonfinite`)."""
    tl.debug_barrier()
    return tl.load(flag) != 0


@triton.jit
def flag_nonfinite(flag, x):
    """Fast pass, last thing in a program: flag := 1 if the 2-D tile ``x`` (its final state, or the output tile it
    just stored) holds an inf or NaN (x * 0 != 0 exactly then). A store masked to the lanes holding one, not a
    reduction: a cross-warp reduction here changed the compiled kernel and slowed LA-1's dK/dV kernel."""
    tl.store(tl.broadcast_to(flag, x.shape), 1, mask=(x * 0.0) != 0.0)
