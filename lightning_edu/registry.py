"""Every implementation of the book's function, registered once: the ladder as data.

Each rung (numpy -> torch -> triton) holds several forms of the same function, per batch and head
``KV_t = lambda KV_{t-1} + k_t^T v_t``, ``o_t = q_t KV_t``. Each form is one :class:`Implementation`
record saying what it supports (dtypes, head dims, initial and final state, a backward), which
implementation (on its rung or one rung down) it is checked against, and its benchmark defaults. The
public API (:mod:`lightning_edu.api`) dispatches through it and the tests (``tests/test_registry.py``)
iterate over :data:`IMPLEMENTATIONS`, and the GPU benchmark (:mod:`benchmarks.bench`) builds one method
per Triton record whose ``bench`` defaults are set.

Every record's ``forward`` and ``backward`` take arguments that :mod:`lightning_edu.validation` has already
checked (an :class:`~lightning_edu.validation.AttentionArgs`), so nothing validates twice:

* ``forward(args, *, option=...) -> (o, final_state)``, final_state None where ``final_state`` is False;
* ``backward(args, d_final_state, *, option=...) -> (dq, dk, dv, d_initial_state)``, d_initial_state None
  where ``initial_state`` is False.

A hook names the options it takes as parameters (keyword-only in the Triton rung's :mod:`.triton_kernels.hooks`);
a ``**`` catch-all declares none. The record passes each hook the options it declares, and refuses, with a
TypeError naming the implementation, the option and the options that hook takes, a keyword the hook does not
declare and a record option neither of its hooks declares: a misspelt option is an error, never ignored.

A record's ``op`` says which function it computes: "attention", the whole sequence above, or "step", one
decoding step ``KV = lambda KV + k^T v``, ``o = q KV`` for one token per batch and head. A step record's
``forward`` takes a :class:`~lightning_edu.validation.StepArgs` and returns (o, new_state); the steps are
checked against ``numpy.step``, one step of the recurrence, the ground truth of that op. Each rung has one
backend record per op: what ``lightning_attention(..., backend=rung)`` and
``lightning_attention_step(..., backend=rung)`` run.

Adding a rung or a variant (a recompute-heavy backward, a decoding kernel) is one new module plus one
:func:`register` call here: see CONTRIBUTING.md.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from .validation import AttentionArgs, StepArgs, validate_head_dims, validate_kernel_dtype

__all__ = [
    "Implementation", "IMPLEMENTATIONS", "register", "get", "backend_for", "check_supports", "RUNGS", "TOLERANCES",
]

RUNGS = ("numpy", "torch", "triton")
OPS = ("attention", "step")  # a whole sequence (lightning_attention), one decoding step (lightning_attention_step)

# The largest relative error against float64 that a check between two implementations tolerates, by the
# dtype of the one being checked (small random problems; the precision table covers long sequences).
TOLERANCES = {"float64": 1e-10, "float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}


_MODULES: dict[str, Any] = {}  # module name -> the module, once imported


def _resolve(path: str | None) -> Callable | None:
    """The function a "module:function" path names, read from its module at every call (so a patched function is
    the one called). The module is imported on its first use and kept: a later call, one that torch.compile traces
    among them, finds it here (Dynamo can trace neither an import nor, safely, sys.modules, which another thread
    importing a module may change during the trace; the backends' modules are imported with the registry)."""
    if path is None:
        return None
    module, name = path.split(":")
    loaded = _MODULES.get(module)
    if loaded is None:
        loaded = sys.modules.get(module)  # already imported: no importlib call (torch.compile cannot trace one)
        loaded = _MODULES[module] = loaded if loaded is not None else importlib.import_module(module)
    return getattr(loaded, name)


# (hook path, "forward" or "backward") -> the options that hook declares, filled on a hook's first use (for the
# backends at import, below: a call that torch.compile traces then finds them here and inspects nothing)
_DECLARED: dict[tuple[str, str], frozenset[str]] = {}
_KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _declared(path: str, fn: Callable, role: str) -> frozenset[str]:
    """The options a hook declares: its parameters that a keyword can set, after ``args`` (and, for a backward,
    ``d_final_state``); a ``**`` catch-all declares none, since the registry never passes it anything."""
    key = (path, role)
    declared = _DECLARED.get(key)
    if declared is None:
        leading = 1 if role == "forward" else 2
        params = list(inspect.signature(fn).parameters.values())[leading:]
        declared = _DECLARED[key] = frozenset(p.name for p in params if p.kind in _KEYWORD)
    return declared


def _accepted(declared: frozenset[str]) -> str:
    return f"takes the options {sorted(declared)}" if declared else "takes no options"


@dataclass(frozen=True)
class Implementation:
    """One form of the function on one rung.

    ``forward``/``backward`` are "module:function" paths, imported on first use, so that a record's module is
    imported only when it runs; the backends' modules are the exception, imported with the registry (see the end
    of this module), the Triton rung's kernels among them. (Triton itself is imported before that, where it is
    installed, by torch's :mod:`torch._dynamo`, which :mod:`.torch_chunked` imports.) ``options`` are fixed
    keyword arguments that make this variant (e.g. ``fused_dkdv=True``); each goes to the hooks that declare it,
    and one that neither hook declares is refused when a hook is looked up (:meth:`options_for`). ``bench`` holds
    its benchmark defaults, or is None when it is not benchmarked. ``op`` is the function it computes, one of
    :data:`OPS`: "attention" (a sequence) or "step" (one token).
    """

    name: str
    rung: str
    chapter: str
    what: str
    forward_path: str
    backward_path: str | None = None
    dtypes: tuple[str, ...] = ("float64",)
    max_head_dim: int | None = None
    initial_state: bool = True
    final_state: bool = True
    differentiable: bool = False
    checked_against: str | None = None
    backend: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    bench: Mapping[str, Any] | None = None
    op: str = "attention"

    @property
    def forward(self) -> Callable:
        fn = _resolve(self.forward_path)
        options = self.options_for("forward", fn) if self.options else {}  # a backend's call: nothing to check
        return lambda args, **kw: fn(args, **(self.options_for("forward", fn, kw) if kw else options))

    @property
    def backward(self) -> Callable | None:
        fn = _resolve(self.backward_path)
        if fn is None:
            return None
        options = self.options_for("backward", fn) if self.options else {}
        return lambda args, d_final_state=None, **kw: fn(args, d_final_state,
                                                         **(self.options_for("backward", fn, kw) if kw else options))

    def declared_options(self, role: str) -> frozenset[str]:
        """The options the ``role`` ("forward" or "backward") hook declares; empty where there is no such hook."""
        path = self.forward_path if role == "forward" else self.backward_path
        return frozenset() if path is None else _declared(path, _resolve(path), role)

    def options_for(self, role: str, fn: Callable | None = None, given: Mapping[str, Any] | None = None) -> dict:
        """The keywords the ``role`` hook is called with: this record's options that it declares, then ``given``
        (a caller's), over them. A given option the hook does not declare, or a record option neither hook
        declares, is a TypeError naming this implementation, the option and the options the hook takes."""
        path = self.forward_path if role == "forward" else self.backward_path
        declared = _declared(path, fn if fn is not None else _resolve(path), role)
        for name in given or ():
            if name not in declared:
                raise TypeError(f"implementation {self.name!r}: its {role} ({path}) takes no option {name!r}; "
                                f"it {_accepted(declared)}")
        mine = {name: value for name, value in self.options.items() if name in declared}
        if len(mine) < len(self.options):
            other = self.declared_options("backward" if role == "forward" else "forward")
            for name in self.options:
                if name not in declared and name not in other:
                    raise TypeError(f"implementation {self.name!r} is registered with option {name!r}, which "
                                    f"neither of its hooks takes; its {role} ({path}) {_accepted(declared)}")
        return {**mine, **given} if given else mine

    @property
    def has_backward(self) -> bool:
        return self.backward_path is not None


IMPLEMENTATIONS: dict[str, Implementation] = {}
# (rung, op) -> the backend implementation of that op on that rung, filled by register()
_BACKENDS: dict[tuple[str, str], Implementation] = {}


def register(impl: Implementation) -> Implementation:
    """Add one implementation; its name must be new and what it is checked against must exist already
    and compute the same op."""
    if impl.name in IMPLEMENTATIONS:
        raise ValueError(f"implementation {impl.name!r} is registered twice")
    if impl.rung not in RUNGS:
        raise ValueError(f"rung must be one of {RUNGS}, got {impl.rung!r} for {impl.name!r}")
    if impl.op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {impl.op!r} for {impl.name!r}")
    if impl.checked_against is not None and impl.checked_against not in IMPLEMENTATIONS:
        raise ValueError(f"{impl.name!r} is checked against {impl.checked_against!r}, which is not registered (yet)")
    if impl.checked_against is not None and IMPLEMENTATIONS[impl.checked_against].op != impl.op:
        raise ValueError(f"{impl.name!r} computes op {impl.op!r} but is checked against {impl.checked_against!r}, "
                         f"which computes op {IMPLEMENTATIONS[impl.checked_against].op!r}")
    if impl.backend and (impl.rung, impl.op) in _BACKENDS:
        raise ValueError(f"rung {impl.rung!r} already has a backend implementation of op {impl.op!r}")
    IMPLEMENTATIONS[impl.name] = impl
    if impl.backend:
        _BACKENDS[impl.rung, impl.op] = impl
    return impl


def get(name: str) -> Implementation:
    """The implementation of that name; the error lists the registered ones."""
    if not isinstance(name, str) or name not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {sorted(IMPLEMENTATIONS)}, got {name!r}")
    return IMPLEMENTATIONS[name]


def by_rung(rung: str) -> list[Implementation]:
    return [impl for impl in IMPLEMENTATIONS.values() if impl.rung == rung]


def backend_for(rung: str, op: str = "attention") -> Implementation:
    """What ``lightning_attention(..., backend=rung)`` runs, or with ``op="step"`` what
    ``lightning_attention_step(..., backend=rung)`` runs."""
    if (rung, op) not in _BACKENDS:
        raise ValueError(f"(rung, op) must be one of {sorted(_BACKENDS)}, got {(rung, op)!r}")
    return _BACKENDS[rung, op]


def check_supports(impl: Implementation, args: AttentionArgs | StepArgs, *, backward: bool = False,
                   d_final_state: Any = None) -> None:
    """Refuse, with the implementation named, a call it does not support (instead of a wrong answer)."""
    who = f"implementation {impl.name!r}"
    given = "step" if isinstance(args, StepArgs) else "attention"
    if given != impl.op:
        raise TypeError(f"{who} computes op {impl.op!r}, so it takes "
                        f"{'StepArgs' if impl.op == 'step' else 'AttentionArgs'}, got {type(args).__name__}")
    if impl.rung == "triton":
        validate_kernel_dtype(f"q ({who})", args.q)
    elif impl.rung == "torch":  # the numpy rung takes any float array and computes in float64
        dtype = str(args.q.dtype).replace("torch.", "")
        if dtype not in impl.dtypes:
            raise TypeError(f"{who} computes in {', '.join(impl.dtypes)}, got q of dtype {dtype}")
    if impl.max_head_dim is not None:
        validate_head_dims(args.d_k, args.d_v, impl.max_head_dim, who)
    initial_state = args.state if isinstance(args, StepArgs) else args.initial_state
    if initial_state is not None and not impl.initial_state:
        raise ValueError(f"{who} takes no initial_state (it computes o from a zero state only)")
    if backward and not impl.has_backward:
        raise ValueError(f"{who} has no backward; use one of {sorted(i.name for i in IMPLEMENTATIONS.values() if i.has_backward)}")
    if backward and d_final_state is not None and not impl.final_state:
        raise ValueError(f"{who} returns no final state, so it takes no d_final_state")


# ------------------------------------------------------------------------------------------------------
# The ladder. Rung 1: float64 numpy, closest to the math.

_NR = "lightning_edu.numpy_reference"
_NB = "lightning_edu.numpy_blockwise"
_TC = "lightning_edu.torch_chunked"
_TK = "lightning_edu.triton_kernels.hooks"

register(Implementation(
    "numpy.recurrent", "numpy", "02", "the per-token recurrence: the ground truth every form is checked against",
    f"{_NR}:recurrent_from_args"))
register(Implementation(
    "numpy.masked", "numpy", "03", "the masked left product [(Q K^T) * M] V, O(n^2 d)",
    f"{_NR}:masked_from_args", initial_state=False, final_state=False, checked_against="numpy.recurrent"))
register(Implementation(
    "numpy.cumsum", "numpy", "02", "all n prefix states at once, by a doubling scan",
    f"{_NR}:cumsum_from_args", initial_state=False, final_state=False, checked_against="numpy.recurrent"))
register(Implementation(
    "numpy.blockwise", "numpy", "04-05", "Algorithms 1 and 2, block by block",
    f"{_NB}:algorithm1", f"{_NB}:algorithm2", checked_against="numpy.recurrent", backend=True))
register(Implementation(
    "numpy.la3", "numpy", "09", "the recompute-heavy backward: micro-chunk tiles, never a C x C matrix",
    f"{_NB}:algorithm1", "lightning_edu.numpy_la3:micro_schedule", checked_against="numpy.blockwise"))

# Rung 2: PyTorch, vectorised, differentiable.
_TORCH_DTYPES = ("float64", "float32", "float16", "bfloat16")
register(Implementation(
    "torch.recurrent", "torch", "06", "the per-token recurrence in torch: n dependent steps",
    f"{_TC}:recurrent_from_args", dtypes=_TORCH_DTYPES, differentiable=True, checked_against="numpy.blockwise",
    bench={"max_n": 4096}))
register(Implementation(
    "torch.masked", "torch", "06", "the quadratic masked product in torch",
    f"{_TC}:masked_from_args", dtypes=_TORCH_DTYPES, initial_state=False, final_state=False, differentiable=True,
    checked_against="numpy.blockwise", bench={"max_n": 8192}))
register(Implementation(
    "torch.loop", "torch", "06", "Algorithm 1 ported line by line: a Python loop over blocks, autograd backward",
    f"{_TC}:loop_from_args", dtypes=_TORCH_DTYPES, differentiable=True, checked_against="numpy.blockwise", bench={}))
register(Implementation(
    "torch.chunked", "torch", "06", "chunk-parallel Algorithm 1 with the hand-written chunk-parallel Algorithm 2",
    f"{_TC}:forward_from_args", f"{_TC}:backward_from_args", dtypes=_TORCH_DTYPES, differentiable=True,
    checked_against="numpy.blockwise", backend=True, bench={}))
register(Implementation(
    "torch.chunked.log_scan", "torch", "06", "the chunk-parallel form with a log-depth (doubling) scan of the states",
    f"{_TC}:forward_from_args", f"{_TC}:backward_from_args", dtypes=_TORCH_DTYPES, differentiable=True,
    checked_against="numpy.blockwise", options={"scan": "log"}, bench={}))

# Rung 3: Triton kernels. On a machine without CUDA they run in Triton's CPU interpreter.
_KERNEL_DTYPES = ("float32", "float16", "bfloat16")
register(Implementation(
    "triton.la1", "triton", "07-08", "Lightning Attention-1: the tiled masked left product, O(n^2 d)",
    f"{_TK}:la1_from_args", f"{_TK}:la1_backward_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=128,
    initial_state=False, final_state=False, differentiable=True, checked_against="torch.chunked",
    bench={"max_T": 32768}))
register(Implementation(
    "triton.la2_literal", "triton", "07-08", "Algorithms 1 and 2 as written: one program per (batch, head)",
    f"{_TK}:la2_literal_from_args", f"{_TK}:la2_literal_backward_from_args", dtypes=_KERNEL_DTYPES,
    max_head_dim=128, checked_against="torch.chunked", bench={}))
register(Implementation(
    "triton.la2_fast", "triton", "07-08", "segments, 16-bit dots, the backward as three reversed forwards",
    f"{_TK}:la2_fast_from_args", f"{_TK}:la2_fast_backward_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=256,
    differentiable=True, checked_against="torch.chunked", backend=True, bench={}))
register(Implementation(
    "triton.la2_fast.one_segment", "triton", "07-08", "la2_fast without segments: one program per (batch, head, d_v slice)",
    f"{_TK}:la2_fast_from_args", f"{_TK}:la2_fast_backward_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=256,
    checked_against="torch.chunked", options={"segments": False}, bench={}))
register(Implementation(
    "triton.la2_fast.no_state_reuse", "triton", "08", "la2_fast whose backward recomputes the segment states it could reuse",
    f"{_TK}:la2_fast_from_args", f"{_TK}:la2_fast_backward_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=256,
    checked_against="torch.chunked", options={"reuse_states": False}, bench={}))
register(Implementation(
    "triton.la2_fast.fused_dkdv", "triton", "08", "la2_fast with dK and dV fused in one reverse kernel (measured slower)",
    f"{_TK}:la2_fast_from_args", f"{_TK}:la2_fast_backward_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=256,
    checked_against="torch.chunked", options={"fused_dkdv": True}, bench={}))
register(Implementation(
    "triton.la3", "triton", "09", "the recompute-heavy backward: dK and dV from micro-chunk tiles in one reverse sweep",
    f"{_TK}:la2_fast_from_args", f"{_TK}:la3_backward_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=128,
    checked_against="torch.chunked", bench={}))

register(Implementation(
    "triton.one_pass", "triton", "07", "the forward in one pass, segments handing states on by decoupled look-back (measured slower)",
    f"{_TK}:one_pass_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=128, checked_against="torch.chunked"))
register(Implementation(
    "triton.one_pass.chained", "triton", "07", "the forward in one pass, segments handing states on by a chained scan (measured slower)",
    f"{_TK}:one_pass_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=128, checked_against="torch.chunked",
    options={"lookback": False}))
register(Implementation(
    "triton.la2_tma", "triton", "07", "la2_fast's forward with its tiles loaded and stored by the TMA (tensor descriptors)",
    f"{_TK}:tma_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=128, checked_against="torch.chunked"))

# One decoding step: KV = lambda KV + k^T v, o = q KV for one token per (batch, head), the state carried from
# a prefill (lightning_attention(..., return_state=True)) or a previous step. No backward hook: the torch step is
# plain tensor ops, differentiable by autograd, and the triton step's custom op has its backward registered.
register(Implementation(
    "numpy.step", "numpy", "02", "one step of the per-token recurrence: the ground truth of every decoding step",
    f"{_NR}:step_from_args", backend=True, op="step"))
register(Implementation(
    "torch.step", "torch", "06", "one step of the recurrence in torch tensor ops, differentiable by autograd",
    f"{_TC}:step_from_args", dtypes=_TORCH_DTYPES, differentiable=True, checked_against="numpy.step", backend=True,
    op="step"))
register(Implementation(
    "triton.decode", "triton", "10", "one decoding step in one Triton kernel launch, its backward in torch ops",
    f"{_TK}:decode_from_args", dtypes=_KERNEL_DTYPES, max_head_dim=256, differentiable=True,
    checked_against="torch.step", backend=True,
    bench=None, op="step"))

# The backends' modules are imported now, once: ``lightning_attention`` looks its backend up on every call, and
# a call that torch.compile traces cannot import a module (Dynamo refuses importlib), so a model compiled
# before its first eager call would otherwise break its graph there. Resolving also files the options their hooks
# declare (``_DECLARED``), so a traced call inspects no signature either. This imports the Triton rung's hooks
# and kernels with the registry.
for _impl in _BACKENDS.values():
    _impl.declared_options("forward"), _impl.declared_options("backward")  # resolving a path imports its module
del _impl
