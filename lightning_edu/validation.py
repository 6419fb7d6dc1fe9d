"""The one place where arguments are checked (every public function calls in here).

Each error names the argument, what was expected and what was given, so a reader who passes a
(batch, seq, heads, dim) tensor by mistake learns exactly which axis is wrong instead of meeting a
broadcasting error deep inside numpy or, worse, a silently wrong answer.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

BACKENDS = ("auto", "numpy", "torch", "triton")

__all__ = [
    "BACKENDS", "AttentionArgs", "StepArgs", "validate_attention_args", "validate_step_args", "validate_cu_seqlens",
    "validate_decay", "device_decay", "validate_block_size", "validate_flag", "validate_choice", "validate_int",
    "validate_positive_int", "validate_kernel_dtype", "validate_head_dims", "check_finite_scalar",
]


try:  # a dependency, and imported with the package anyway (lightning_edu/__init__.py)
    import torch as _TORCH
except ImportError:  # pragma: no cover
    _TORCH = None


def _torch():
    return _TORCH


def _kind(x: Any) -> str | None:
    """'numpy' for numpy arrays, 'torch' for torch tensors, None otherwise. (torch is bound once, at import: a
    lookup in sys.modules here would have torch.compile trace that dictionary, which another thread importing a
    module can change under it.)"""
    if isinstance(x, np.ndarray):
        return "numpy"
    if _TORCH is not None and isinstance(x, _TORCH.Tensor):
        return "torch"
    return None


def _describe(x: Any) -> str:
    kind = _kind(x)
    if kind == "numpy":
        return f"numpy.ndarray of shape {tuple(x.shape)} and dtype {x.dtype}"
    if kind == "torch":
        return f"torch.Tensor of shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__}"


def _is_float(x: Any) -> bool:
    if _kind(x) == "numpy":
        return np.issubdtype(x.dtype, np.floating)
    return bool(x.is_floating_point())


@dataclass(frozen=True)
class AttentionArgs:
    """Checked and normalised arguments of one attention call.

    ``decay`` is a float64 numpy array of shape (heads,), whatever form it was given in, except for the torch
    and triton backends given a torch tensor on a GPU or one that requires grad: then it is that tensor, shape
    (heads,), its values unread on the host (see :func:`validate_decay`; consumers call :func:`device_decay`);
    and for those backends under :func:`torch.compile`, where a number or list comes as a tuple of floats.
    ``cu_seqlens`` (a packed batch) is a tuple of Python ints on the host, or None.
    """

    q: Any
    k: Any
    v: Any
    decay: np.ndarray
    backend: str
    block_size: int | None
    initial_state: Any
    do: Any
    kind: str
    batch: int
    heads: int
    seq_len: int
    d_k: int
    d_v: int
    cu_seqlens: tuple[int, ...] | None = None

    @property
    def num_seqs(self) -> int:
        """Sequences in the call: the packed ones with cu_seqlens, else the batch."""
        return self.batch if self.cu_seqlens is None else len(self.cu_seqlens) - 1


@dataclass(frozen=True)
class StepArgs:
    """Checked and normalised arguments of one decoding step (one token per batch and head).

    q, k: (batch, heads, d_k); v: (batch, heads, d_v); state: (batch, heads, d_k, d_v) or None (zeros).
    ``decay`` is a float64 numpy array of shape (heads,), or a torch tensor, as in :class:`AttentionArgs`.
    """

    q: Any
    k: Any
    v: Any
    state: Any
    decay: np.ndarray
    backend: str
    kind: str
    batch: int
    heads: int
    d_k: int
    d_v: int


def validate_block_size(block_size: Any, name: str = "block_size", *, required: bool = False) -> int | None:
    """None (unless ``required``), or a positive Python/numpy integer (bool is refused: True is not a block size)."""
    if block_size is None and not required:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        expected = "a positive integer" if required else "a positive integer or None"
        raise TypeError(f"{name} must be {expected}, got {type(block_size).__name__} {block_size!r}")
    if block_size < 1:
        raise ValueError(f"{name} must be a positive integer, got {block_size}")
    return int(block_size)


def validate_decay(decay: Any, heads: int | None = None, name: str = "decay", *, keep_tensor: bool = False,
                   allow_grad: bool = False):
    """Return lambda as a float64 array of shape (heads,), checking 0 < lambda <= 1 everywhere.

    ``decay`` may be a Python/numpy number (shared by every head) or a 1-D sequence, numpy array or
    torch tensor with one value per head.  With ``heads=None`` the number of values is not checked and a
    scalar gives an array of shape (1,).

    Three kinds of torch tensor are returned as tensors of shape (heads,) instead, when ``keep_tensor``
    (the torch and triton backends) allows it:

    * one on a GPU: its shape and dtype are checked, its values are not read, since reading them would make
      the host wait for the GPU on every call. :func:`device_decay` turns a lambda outside (0, 1] into NaN
      on the device, so that head's outputs come out NaN rather than silently wrong;
    * one that requires grad, where ``allow_grad`` says the caller computes dL/dlambda (its values are
      checked when it lives on the CPU);
    * any tensor while :func:`torch.compile` traces the call: its values are then values of the graph, not
      constants the tracer could branch on, so they are checked on the device as a GPU tensor's are (a model's
      decay buffer compiles without a graph break, wherever the model lives).

    A tensor that requires grad anywhere else is refused (TypeError): detaching it would drop its gradient
    without a word.

    While :func:`torch.compile` traces a call of those backends, a Python number or list is checked as here and
    returned as a tuple of Python floats, constants of the graph, instead of an array: Dynamo traces numpy
    calls as tensor operations, so an array built here would be a tensor of the graph and its values unknown to
    the tracer (:func:`device_decay` makes a tensor of the floats).
    """
    if isinstance(decay, bool) or decay is None:
        raise TypeError(f"{name} must be a float in (0, 1] or one value per head, got {type(decay).__name__} {decay!r}")
    if isinstance(decay, np.ma.MaskedArray):
        raise TypeError(f"{name} must be a plain array, got a numpy masked array (its mask would be ignored); use .filled()")
    if isinstance(decay, (numbers.Real, list, tuple)) and not isinstance(decay, np.ndarray):
        # Python numbers: checked as Python floats, so that torch.compile sees constants (no numpy, no branch on data)
        items = [decay] if isinstance(decay, numbers.Real) else list(decay)
        if all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in items):
            py = [float(x) for x in items]
            if isinstance(decay, numbers.Real):
                py = py * (heads if heads is not None else 1)
            elif heads is not None and len(py) != heads:
                raise ValueError(f"{name} must have one value per head: expected length {heads}, got length {len(py)}")
            for i, x in enumerate(py):
                if not (0 < x <= 1):
                    where = "" if isinstance(decay, numbers.Real) or len(py) == 1 else f" (head {i})"
                    raise ValueError(f"{name} must lie in (0, 1]{where}, got {x!r}")
            if keep_tensor and _torch().compiler.is_compiling():
                return tuple(py)  # constants of the traced graph: an array built here would be traced as a tensor
            return np.array(py, dtype=np.float64)
    if keep_tensor and isinstance(decay, np.ndarray) and _torch().compiler.is_compiling():
        # Dynamo traces an array (a numpy scalar too) as a tensor, an input of the graph: checked as a tensor is
        decay = _torch().as_tensor(decay, dtype=_torch().float64)
    tensor = None
    if _kind(decay) == "torch":
        if not decay.is_floating_point():
            raise TypeError(f"{name} must hold floats in (0, 1], got a tensor of dtype {decay.dtype}")
        wants_grad = decay.requires_grad and _torch().is_grad_enabled()
        if wants_grad and not allow_grad:
            raise TypeError(
                f"{name} requires grad, but this call computes no gradient with respect to lambda (only "
                f"lightning_attention, normalized_attention and their step functions with backend 'torch' or "
                f"'triton', and hybrid_attention with backend 'torch', do); pass {name}.detach() (or a float) to treat "
                f"lambda as a constant"
            )
        compiling = _torch().compiler.is_compiling()  # then a CPU tensor's values are graph values, not constants
        if keep_tensor and (decay.device.type != "cpu" or wants_grad or compiling):
            tensor = decay
        if tensor is not None and (decay.device.type != "cpu" or compiling):
            if decay.ndim > 1:
                raise ValueError(f"{name} must be a scalar or 1-D with one value per head, got shape {tuple(decay.shape)}")
            if decay.ndim == 1 and heads is not None and decay.shape[0] != heads:
                raise ValueError(f"{name} must have one value per head: expected length {heads}, got length {decay.shape[0]}")
            return decay.reshape(-1).expand(heads or 1) if decay.ndim == 0 else decay
        values = decay.detach().to("cpu", dtype=_torch().float64).numpy()
    elif isinstance(decay, numbers.Real):
        values = np.asarray(float(decay), dtype=np.float64)
    else:
        try:
            values = np.asarray(decay)
        except Exception as exc:  # pragma: no cover - exotic inputs
            raise TypeError(f"{name} must be a float in (0, 1] or one value per head, got {type(decay).__name__}") from exc
        if values.dtype == object or not (np.issubdtype(values.dtype, np.floating) or np.issubdtype(values.dtype, np.integer)):
            raise TypeError(f"{name} must be a float in (0, 1] or one value per head, got {type(decay).__name__} of dtype {values.dtype}")
        values = values.astype(np.float64)
    scalar = values.ndim == 0
    if scalar:
        values = np.full(heads if heads is not None else 1, float(values))
    elif values.ndim != 1:
        raise ValueError(f"{name} must be a scalar or 1-D with one value per head, got shape {values.shape}")
    elif heads is not None and values.shape[0] != heads:
        raise ValueError(f"{name} must have one value per head: expected length {heads}, got length {values.shape[0]}")
    bad = ~((values > 0) & (values <= 1))  # NaN fails both comparisons
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        where = "" if scalar or values.shape[0] == 1 else f" (head {i})"  # a shared scalar belongs to no one head
        raise ValueError(f"{name} must lie in (0, 1]{where}, got {float(values[i])!r}")  # float: no np.float64(...) in the message
    if tensor is not None:  # a CPU tensor that requires grad: checked above, returned with its graph
        return tensor.reshape(-1).expand(values.shape[0]) if tensor.ndim == 0 else tensor
    return values


def device_decay(decay, device, dtype):
    """lambda as a (heads,) torch tensor of ``dtype`` on ``device``, from what :func:`validate_decay` returned.

    A float64 numpy array is copied to the device. A tensor keeps its autograd graph; if it lives on a GPU its
    values were never read on the host, so here, on the device, a lambda outside (0, 1] (or NaN) becomes NaN:
    the outputs of that head turn NaN instead of silently wrong, and the host never waits for the GPU.
    """
    torch = _torch()
    if isinstance(decay, tuple):  # Python floats (validate_decay under torch.compile): no numpy in a traced graph
        return torch.tensor(decay, dtype=torch.float64).to(device=device, dtype=dtype)
    if not torch.is_tensor(decay):  # a float64 array (or the floats of a caller that validated them itself)
        return torch.as_tensor(np.asarray(decay, dtype=np.float64), dtype=torch.float64).to(device=device, dtype=dtype)
    lam = decay.to(device=device, dtype=dtype)
    if decay.device.type == "cpu" and not torch.compiler.is_compiling():  # read and checked by validate_decay
        return lam
    return torch.where((lam > 0) & (lam <= 1), lam, torch.nan)


def _check_tensor(name: str, x: Any, kind: str | None) -> str:
    k = _kind(x)
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(f"{name} must be a plain numpy array, got a numpy masked array (its mask would be ignored); use .filled()")
    if k is None:
        raise TypeError(f"{name} must be a numpy.ndarray or torch.Tensor, got {_describe(x)}")
    if kind is not None and k != kind:
        raise TypeError(f"{name} must be the same array type as q ({kind}), got {_describe(x)}: do not mix numpy and torch")
    if not _is_float(x):
        raise TypeError(f"{name} must hold floating-point numbers, got dtype {x.dtype}")
    return k


def _same_dtype_and_device(kind: str, q: Any, **others: Any) -> None:
    """Torch tensors must share q's dtype and device (numpy arrays are all computed in float64)."""
    if kind != "torch":
        return
    for name, x in others.items():
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the same dtype as q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {x.device}")


def _resolve_backend(backend: Any, kind: str, q: Any, who: str | None = None) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, one of {BACKENDS}, got {type(backend).__name__} {backend!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if kind == "numpy":
            return "numpy"
        # Triton's tl.dot has no float64: float64 CUDA tensors go to the torch backend.
        return "triton" if q.is_cuda and str(q.dtype).replace("torch.", "") in KERNEL_DTYPES else "torch"
    if backend == "numpy" and kind != "numpy":
        if who is not None:
            raise TypeError(f"{who} is a float64 numpy reference and takes numpy arrays, got q as {_describe(q)}; convert with .numpy()")
        raise TypeError(f"backend='numpy' takes numpy arrays, got q as {_describe(q)}; use backend='torch' or convert with .numpy()")
    if backend in ("torch", "triton") and kind != "torch":
        raise TypeError(f"backend={backend!r} takes torch tensors, got q as {_describe(q)}; use backend='numpy' or torch.from_numpy")
    if backend == "triton" and not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before import for the CPU interpreter), got q on {q.device}"
        )
    return backend


def validate_attention_args(
    q: Any,
    k: Any,
    v: Any,
    decay: Any = 1.0,
    *,
    backend: Any = "auto",
    block_size: Any = None,
    initial_state: Any = None,
    do: Any = None,
    d_final_state: Any = None,
    who: str | None = None,
    need_do: bool = False,
    cu_seqlens: Any = None,
    decay_grad: bool = False,
) -> AttentionArgs:
    """Check every argument of an attention call; return them normalised.

    Shapes: q, k (batch, heads, seq_len, d_k); v and do (batch, heads, seq_len, d_v);
    initial_state and d_final_state (batch, heads, d_k, d_v). d_k may differ from d_v.
    A packed batch (``cu_seqlens`` given, see :func:`validate_cu_seqlens`): q, k, v, do hold every sequence
    on one batch row, (1, heads, total, d), and the states are (num_seqs, heads, d_k, d_v).
    ``who`` names a numpy-only function (no ``backend`` argument) in the error for torch inputs.
    ``need_do`` marks a backward call, where ``do`` = dL/do is required and, while grad mode is on, no tensor may
    require grad (the gradients it returns have no graph: a gradient through them would be lost). ``decay_grad``
    says the caller returns dL/dlambda through autograd (the torch and triton backends of
    :func:`lightning_attention`): only then may decay be a tensor that requires grad.
    """
    if need_do and do is None:
        raise TypeError("do (the gradient dL/do, shaped like the output o) is required for the backward pass, got None")
    kind = _check_tensor("q", q, None)
    _check_tensor("k", k, kind)
    _check_tensor("v", v, kind)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            want = "(batch, heads, seq_len, d_v)" if name == "v" else "(batch, heads, seq_len, d_k)"
            raise ValueError(f"{name} must be 4-D {want}, got {x.ndim}-D shape {tuple(x.shape)}")
    batch, heads, seq_len, d_k = (int(s) for s in q.shape)
    axes = ("batch", "heads", "seq_len")
    for name, x in (("k", k), ("v", v)):
        for axis, (want, got) in enumerate(zip(q.shape[:3], x.shape[:3])):
            if want != got:
                raise ValueError(f"{name} must match q in {axes[axis]} (axis {axis}): expected {want}, got {got} (shape {tuple(x.shape)})")
    if k.shape[3] != d_k:
        raise ValueError(f"k must have the same d_k as q (axis 3): expected {d_k}, got {k.shape[3]}")
    d_v = int(v.shape[3])
    if seq_len < 1 or d_k < 1 or d_v < 1 or batch < 1 or heads < 1:
        raise ValueError(f"every axis must have length >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    _same_dtype_and_device(kind, q, k=k, v=v)
    block = validate_block_size(block_size)
    backend = _resolve_backend(backend, kind, q, who)
    # A GPU tensor of lambdas stays on the GPU (no host wait).
    tensor_ok = backend in ("torch", "triton")
    lam = validate_decay(decay, heads, keep_tensor=tensor_ok, allow_grad=tensor_ok and decay_grad and not need_do)
    if backend == "triton" and block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"block_size for backend='triton' must be a power of two >= 16 (a tl.dot tile), got {block}")
    if backend == "triton":
        validate_head_dims(d_k, d_v, 256, "backend='triton'")
        validate_kernel_dtype("q (backend='triton')", q)
    seqs = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(f"with cu_seqlens, q, k and v hold the packed sequences on one batch row, shape "
                             f"(1, heads, total, d); got batch {batch} (q shape {tuple(q.shape)})")
        cu_seqlens = validate_cu_seqlens(cu_seqlens, seq_len)
        seqs = len(cu_seqlens) - 1
    for name, x, shape in (
        ("initial_state", initial_state, (seqs, heads, d_k, d_v)),
        ("do", do, (batch, heads, seq_len, d_v)),
        ("d_final_state", d_final_state, (seqs, heads, d_k, d_v)),
    ):
        if x is None:
            continue
        _check_tensor(name, x, kind)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(x.shape)}")
        if kind == "torch" and x.device != q.device:
            raise ValueError(f"{name} must be on the same device as q ({q.device}), got {x.device}")
    if kind == "torch" and do is not None and do.dtype != q.dtype:
        raise TypeError(f"do must have the same dtype as q ({q.dtype}), got {do.dtype}")
    if need_do and kind == "torch" and _torch().is_grad_enabled():
        # The backward's outputs carry no autograd graph (no second derivative), so a gradient through them
        # would be dropped: refused, as a decay that requires grad is.
        for name, x in (("q", q), ("k", k), ("v", v), ("do", do), ("initial_state", initial_state),
                        ("d_final_state", d_final_state)):
            if x is not None and x.requires_grad:
                raise TypeError(f"{name} requires grad, but the gradients this call returns are not differentiable "
                                f"(no second derivative); pass {name}.detach() to treat it as a constant, or call "
                                f"it under torch.no_grad()")
    return AttentionArgs(q, k, v, lam, backend, block, initial_state, do, kind, batch, heads, seq_len, d_k, d_v,
                         cu_seqlens)


def validate_cu_seqlens(cu_seqlens: Any, total: int) -> tuple[int, ...]:
    """The boundaries of a packed batch, checked: a 1-D integer sequence of length num_seqs + 1 that starts
    at 0, never decreases (an empty sequence repeats a boundary) and ends at ``total``, the packed length
    (the convention of flash-attn and fla). Returned as a tuple of Python ints.

    It must live on the host: a list or tuple of ints, a numpy array or a CPU tensor. Reading a CUDA tensor
    would make the host wait for the GPU on every call, so a CUDA tensor is refused; keep a CPU copy beside
    it, as fla's ``cu_seqlens_cpu`` does. While :func:`torch.compile` traces the call only Python ints will do
    (a TypeError otherwise): Dynamo makes a tensor or a numpy array an input of the graph, whose values the
    tracer does not know, and the boundaries set the shapes of the slices.
    """
    torch = _torch()
    traced = (torch.Tensor, np.ndarray)
    if torch.compiler.is_compiling() and (isinstance(cu_seqlens, traced) or (
            isinstance(cu_seqlens, (list, tuple)) and any(isinstance(x, traced) for x in cu_seqlens))):
        # Dynamo makes a tensor, an array or a numpy integer an input of the graph, its values unknown to the tracer
        # (a numpy scalar is traced as an array), and the boundaries set the shapes of the slices
        listed = isinstance(cu_seqlens, (list, tuple))
        given = "a list holding numpy or torch scalars" if listed else type(cu_seqlens).__name__
        raise TypeError(f"cu_seqlens must be a list or tuple of Python ints while torch.compile traces the call, got "
                        f"{given}: the boundaries set the shapes of the slices, and the tracer does not know the "
                        f"values of a tensor or an array (they are inputs of the graph); convert it with "
                        f"cu_seqlens.tolist() outside the compiled function")
    if torch is not None and isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.device.type != "cpu":
            raise ValueError(f"cu_seqlens must be on the host (a list, a numpy array or a CPU tensor): reading a "
                             f"tensor on {cu_seqlens.device} would synchronise with the GPU; pass cu_seqlens.cpu() "
                             "once and keep it")
        if cu_seqlens.is_floating_point() or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
        values = cu_seqlens.tolist()
        ndim = cu_seqlens.ndim
    elif isinstance(cu_seqlens, np.ndarray):
        if not np.issubdtype(cu_seqlens.dtype, np.integer):
            raise TypeError(f"cu_seqlens must hold integers, got dtype {cu_seqlens.dtype}")
        values = cu_seqlens.tolist()
        ndim = cu_seqlens.ndim
    elif isinstance(cu_seqlens, (list, tuple)):
        if any(isinstance(x, (list, tuple, np.ndarray)) for x in cu_seqlens):
            raise ValueError(f"cu_seqlens must be 1-D (num_seqs + 1 boundaries), got nested {list(cu_seqlens)!r}")
        if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in cu_seqlens):
            raise TypeError(f"cu_seqlens must hold integers, got {list(cu_seqlens)!r}")
        values, ndim = [int(x) for x in cu_seqlens], 1
    else:
        raise TypeError(f"cu_seqlens must be a list of ints, a numpy array or a CPU tensor, got "
                        f"{type(cu_seqlens).__name__}")
    if ndim != 1:
        raise ValueError(f"cu_seqlens must be 1-D (num_seqs + 1 boundaries), got {ndim}-D")
    if len(values) < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 boundaries (one sequence), got {values}")
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]} (cu_seqlens = {values})")
    drops = [i for i in range(1, len(values)) if values[i] < values[i - 1]]
    if drops:
        i = drops[0]
        raise ValueError(f"cu_seqlens must never decrease, got {values[i - 1]} then {values[i]} at positions "
                         f"{i - 1}, {i}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens must end at the packed length {total} (q.shape[2]), got {values[-1]}")
    return tuple(values)


_FLOAT_ONLY = frozenset({float})
_STEPS_SEEN: dict = {}  # _step_signature -> what validate_step_args derived for it (a step that passed)


def _step_signature(q, k, v, state, decay, backend, who) -> tuple | None:
    """Everything :func:`_validate_step` reads of a step's arguments, as a key, for arguments whose check does not
    depend on their values: plain torch tensors (type, shape, dtype, device of each), the backend and ``who``
    (strings), grad mode, TRITON_INTERPRET (whether the triton backend takes CPU tensors), and a decay that is a
    Python float, a list of Python floats (by value) or a tensor on a
    GPU (type, shape, dtype, device, requires_grad: its values are never read). None for anything else (numpy
    arrays, tensor subclasses, a CPU tensor decay, whose values are read; any call while torch.compile traces)."""
    tensor = _TORCH.Tensor
    if type(q) is not tensor or type(k) is not tensor or type(v) is not tensor or type(backend) is not str:
        return None
    if state is not None and type(state) is not tensor:
        return None
    if type(decay) is float:
        lam = decay
    elif type(decay) is list and set(map(type, decay)) == _FLOAT_ONLY:  # a C loop: this runs before every step
        lam = tuple(decay)
    elif type(decay) is tensor and decay.device.type != "cpu":
        lam = (tensor, decay.shape, decay.dtype, decay.device, decay.requires_grad)
    else:
        return None
    if _TORCH.compiler.is_compiling():
        return None
    return (lam, backend, who, _TORCH.is_grad_enabled(), os.environ.get("TRITON_INTERPRET"), q.shape, q.dtype,
            q.device, k.shape, k.dtype, k.device, v.shape, v.dtype, v.device,
            None if state is None else (state.shape, state.dtype, state.device))


def validate_step_args(
    q: Any,
    k: Any,
    v: Any,
    state: Any = None,
    decay: Any = 1.0,
    backend: Any = "auto",
    who: str = "lightning_attention_step",
) -> StepArgs:
    """Check every argument of one decoding step; return them normalised.

    Shapes: q, k (batch, heads, d_k); v (batch, heads, d_v); state (batch, heads, d_k, d_v) or None. There is
    no sequence axis: a step takes one token per batch and head. ``who`` names the function in the hint given
    for a 4-D input. Decay and backend follow the rules of :func:`validate_attention_args`.

    A decoding loop passes arguments of the same kinds at every token, and their checks read no values (but a
    decay's on the host): a step whose :func:`_step_signature` passed before is not checked again, its normalised
    arguments built from what that check derived. Why: the checks cost the host more than the step's kernel launch.
    """
    key = _step_signature(q, k, v, state, decay, backend, who)
    seen = _STEPS_SEEN.get(key) if key is not None else None
    if seen is not None:
        lam, rest = seen
        if lam is None:  # a GPU tensor: as _validate_step returns it
            lam = decay.reshape(-1).expand(rest[3]) if decay.ndim == 0 else decay
        else:  # the float64 array of a float or list, a copy (the caller may hand it on as a tensor's memory)
            lam = lam.copy()
        return StepArgs(q, k, v, state, lam, *rest)
    args = _validate_step(q, k, v, state, decay, backend, who)
    if key is not None:
        if len(_STEPS_SEEN) >= 256:
            _STEPS_SEEN.clear()
        kept = None if isinstance(args.decay, _TORCH.Tensor) else args.decay.copy()
        _STEPS_SEEN[key] = (kept, (args.backend, args.kind, args.batch, args.heads, args.d_k, args.d_v))
    return args


def _validate_step(q, k, v, state, decay, backend, who) -> StepArgs:
    """:func:`validate_step_args`'s checks."""
    kind = _check_tensor("q", q, None)
    _check_tensor("k", k, kind)
    _check_tensor("v", v, kind)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            want = "(batch, heads, d_v)" if name == "v" else "(batch, heads, d_k)"
            hint = ""
            if x.ndim == 4 and x.shape[2] == 1:
                hint = f": {who} takes one token with no sequence axis, so drop it ({name}[:, :, 0])"
            elif x.ndim == 4:
                hint = f": {who} takes one token; for a whole sequence call lightning_attention"
            raise ValueError(f"{name} must be 3-D {want}, got {x.ndim}-D shape {tuple(x.shape)}{hint}")
    batch, heads, d_k = (int(s) for s in q.shape)
    axes = ("batch", "heads")
    for name, x in (("k", k), ("v", v)):
        for axis, (want, got) in enumerate(zip(q.shape[:2], x.shape[:2])):
            if want != got:
                raise ValueError(f"{name} must match q in {axes[axis]} (axis {axis}): expected {want}, got {got} "
                                 f"(shape {tuple(x.shape)})")
    if k.shape[2] != d_k:
        raise ValueError(f"k must have the same d_k as q (axis 2): expected {d_k}, got {k.shape[2]}")
    d_v = int(v.shape[2])
    if d_k < 1 or d_v < 1 or batch < 1 or heads < 1:
        raise ValueError(f"every axis must have length >= 1, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    _same_dtype_and_device(kind, q, k=k, v=v)
    backend = _resolve_backend(backend, kind, q)
    tensor_ok = backend in ("torch", "triton")
    lam = validate_decay(decay, heads, keep_tensor=tensor_ok, allow_grad=tensor_ok)
    if backend == "triton":
        validate_head_dims(d_k, d_v, 256, "backend='triton'")
        validate_kernel_dtype("q (backend='triton')", q)
    if state is not None:
        _check_tensor("state", state, kind)
        shape = (batch, heads, d_k, d_v)
        if tuple(state.shape) != shape:
            raise ValueError(f"state must have shape (batch, heads, d_k, d_v) = {shape}, got {tuple(state.shape)}")
        if kind == "torch" and state.device != q.device:
            raise ValueError(f"state must be on the same device as q ({q.device}), got {state.device}")
    return StepArgs(q, k, v, state, lam, backend, kind, batch, heads, d_k, d_v)


def validate_flag(name: str, value: Any) -> bool:
    """A real bool: ``return_state=1`` or ``causal="no"`` is refused rather than read as truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def check_finite_scalar(name: str, value: Any) -> float:
    """A finite real number, e.g. a scale or a hardware figure of the cost model. Not a real number (a string, a
    bool, a complex number, an array): TypeError. A real number that is NaN or infinite: ValueError, as any right
    type with a wrong value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a finite real number, got {type(value).__name__} {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number, got {value!r}")
    return float(value)


def validate_choice(name: str, value: Any, choices: tuple) -> str:
    """One of a fixed set of strings (e.g. ``scan`` in ("sequential", "log")); the error lists them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def validate_int(name: str, value: Any, minimum: int) -> int:
    """A Python/numpy integer >= ``minimum`` (bool refused), e.g. a layer index or a count. Returns int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def validate_positive_int(name: str, value: Any) -> int:
    """A positive Python/numpy integer (bool refused), e.g. n, d_k, batch in the cost model. Returns int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a positive integer, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {value}")
    return int(value)


KERNEL_DTYPES = ("float32", "float16", "bfloat16")


def validate_kernel_dtype(name: str, x: Any) -> None:
    """Triton kernels load fp32, fp16 or bf16 tiles (``tl.dot`` has no float64 on a GPU). (Chapter 07.)"""
    dtype = str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")
    if dtype not in KERNEL_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16 for the Triton kernels, got {dtype}")


def validate_head_dims(d_k: int, d_v: int, max_dim: int, who: str) -> None:
    """A kernel that keeps a whole d_k x d_v state on chip refuses head dims it cannot hold."""
    if max(d_k, d_v) > max_dim:
        raise ValueError(f"{who} supports d_k, d_v <= {max_dim} (its state lives on chip), got d_k={d_k}, d_v={d_v}")


# --------------------------------------------------------------------------------------------------
# Feature maps, the normaliser and the softmax/linear hybrid (chapter 11):
# lightning_edu.api.normalized_attention, hybrid_attention and lightning_edu.feature_maps.
# --------------------------------------------------------------------------------------------------

#: The feature maps known by name: phi(x) = x, elu(x) + 1 (Katharopoulos et al., 2020), ReLU(x)^2.
FEATURE_MAP_NAMES = ("identity", "elu+1", "relu2")

#: The forms of attention whose explicit weight matrix lightning_edu.feature_maps.attention_weights builds.
WEIGHT_METHODS = ("softmax", "linear", "normalized", "hybrid", "hybrid_separate")

__all__ += ["FEATURE_MAP_NAMES", "WEIGHT_METHODS", "validate_feature_map", "validate_eps", "validate_feature_output",
            "validate_augmented_state", "validate_hybrid_args", "validate_single_head"]


def _is_torch_module(x: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return isinstance(x, torch.nn.Module)


def validate_feature_map(feature_map: Any, kind: str, name: str = "feature_map"):
    """A feature map name from :data:`FEATURE_MAP_NAMES`, or a callable that maps (..., d) to (..., d').

    A torch module (such as :class:`lightning_edu.feature_maps.LearnedReLU2`) only takes torch tensors: given
    numpy arrays (``kind == "numpy"``) it is refused with a TypeError that points at its numpy twin. Returns
    the name or the callable unchanged.
    """
    if isinstance(feature_map, str):
        if feature_map not in FEATURE_MAP_NAMES:
            raise ValueError(f"{name} must be one of {FEATURE_MAP_NAMES} or a callable, got {feature_map!r}")
        return feature_map
    if not callable(feature_map):
        raise TypeError(f"{name} must be one of {FEATURE_MAP_NAMES} or a callable (..., d) -> (..., d'), got "
                        f"{type(feature_map).__name__} {feature_map!r}")
    if kind == "numpy" and _is_torch_module(feature_map):
        twin = " (LearnedReLU2 has one: .numpy())" if hasattr(feature_map, "numpy") else ""
        raise TypeError(f"{name} is a torch.nn.Module ({type(feature_map).__name__}) but q is a numpy array: pass "
                        f"torch tensors, or a numpy function{twin}")
    return feature_map


def validate_eps(eps: Any, name: str = "eps") -> float:
    """The constant added to a normaliser: a finite real number >= 0 (0 allowed: no guard at all)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"{name} must be a finite real number >= 0, got {type(eps).__name__} {eps!r}")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{name} must be a finite real number >= 0, got {float(eps)!r}")
    return float(eps)


def validate_feature_output(name: str, out: Any, x: Any, kind: str, d_feature: int | None = None) -> int:
    """What a feature map returned for ``x`` (..., d): an array of the same kind with shape (..., d').

    Torch: same dtype and device as ``x`` (a float32 map applied to float64 inputs would otherwise fail later,
    far from the cause). ``d_feature``, when given, is the d' that phi(q) had: phi(k) must match it.
    Returns d'.
    """
    got = _kind(out)
    if got != kind:
        raise TypeError(f"{name} must return a {'numpy.ndarray' if kind == 'numpy' else 'torch.Tensor'} like its "
                        f"input, got {_describe(out)}")
    if not _is_float(out):
        raise TypeError(f"{name} must return floating-point numbers, got dtype {out.dtype}")
    if out.ndim != x.ndim or tuple(out.shape[:-1]) != tuple(x.shape[:-1]) or out.shape[-1] < 1:
        raise ValueError(f"{name} must map shape (..., d) to (..., d') keeping the leading axes: given "
                         f"{tuple(x.shape)}, it returned {tuple(out.shape)}")
    if kind == "torch":
        if out.dtype != x.dtype:
            raise TypeError(f"{name} must keep the dtype of its input ({x.dtype}), got {out.dtype}")
        if out.device != x.device:
            raise ValueError(f"{name} must keep the device of its input ({x.device}), got {out.device}")
    d_out = int(out.shape[-1])
    if d_feature is not None and d_out != d_feature:
        raise ValueError(f"{name} must have the same feature dimension d' as the map of q: expected {d_feature}, "
                         f"got {d_out}")
    return d_out


def validate_augmented_state(name: str, state: Any, shape: tuple, kind: str, q: Any) -> None:
    """The state of normalized attention: S with z as its last column, (batch, heads, d', d_v + 1)."""
    if state is None:
        return
    _check_tensor(name, state, kind)
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape (batch, heads, d_feature, d_v + 1) = {tuple(shape)} (S with the "
                         f"normaliser z as its last column), got {tuple(state.shape)}")
    if kind == "torch" and state.device != q.device:
        raise ValueError(f"{name} must be on the same device as q ({q.device}), got {state.device}")


def validate_hybrid_args(q: Any, k: Any, v: Any, decay: Any, block_size: Any, scale: Any, backend: Any) -> tuple:
    """Check the arguments of :func:`lightning_edu.api.hybrid_attention`: (args, block_size, scale).

    Backends: "numpy" and "torch" ("auto": numpy for numpy arrays, torch for any tensor, CUDA included).
    "triton" is refused: the in-block part is a softmax, which no Lightning Attention kernel computes.
    ``block_size`` is required (a positive integer, any value: it need not divide n); ``scale`` None means
    d_k^-0.5, else a finite real number.
    """
    if isinstance(backend, str) and backend == "triton":
        raise ValueError("backend='triton' is not supported by hybrid_attention: its in-block part is a causal softmax, "
                         "which no Lightning Attention kernel computes; use backend='torch' (CUDA tensors included) "
                         "or 'numpy'")
    if backend == "auto" and _kind(q) == "torch":
        backend = "torch"
    args = validate_attention_args(q, k, v, decay, backend=backend, decay_grad=True)
    block = validate_block_size(block_size, required=True)  # the length of the softmax blocks
    scale = args.d_k ** -0.5 if scale is None else check_finite_scalar("scale", scale)
    return args, block, scale


def validate_single_head(q: Any, k: Any, v: Any = None) -> tuple:
    """One head as 2-D float arrays: q, k (n, d_k), v (n, d_v) or None. Returned as float64 numpy arrays."""
    arrays = [("q", q), ("k", k)] + ([("v", v)] if v is not None else [])
    out = []
    for name, x in arrays:
        kind = _check_tensor(name, x, None)
        if kind == "torch":
            x = x.detach().cpu().double().numpy()
        if x.ndim != 2:
            want = "(n, d_v)" if name == "v" else "(n, d_k)"
            raise ValueError(f"{name} must be 2-D {want}, one head, got {x.ndim}-D shape {tuple(x.shape)}")
        out.append(np.asarray(x, dtype=np.float64))
    n, d_k = out[0].shape
    if out[1].shape != (n, d_k):
        raise ValueError(f"k must have the shape of q {(n, d_k)}, got {out[1].shape}")
    if v is not None and out[2].shape[0] != n:
        raise ValueError(f"v must have n = {n} rows like q, got shape {out[2].shape}")
    if n < 1 or d_k < 1:
        raise ValueError(f"every axis must have length >= 1, got q {out[0].shape}")
    return tuple(out) if v is not None else (out[0], out[1])


def validate_feature_input(name: str, x: Any, d: int, W: Any = None) -> None:
    """The input of a learned feature map: last axis d; with torch weights ``W``, W's dtype and device (any
    16-bit or float32 x under ``torch.autocast``, which casts both sides of the product itself)."""
    if _kind(x) is None:
        raise TypeError(f"{name} must be a numpy.ndarray or torch.Tensor, got {_describe(x)}")
    if x.ndim < 1 or x.shape[-1] != d:
        raise ValueError(f"{name} must have d = {d} as its last axis, got shape {tuple(x.shape)}")
    if W is not None:
        import torch
        autocast = torch.is_autocast_enabled(x.device.type) and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        if x.dtype != W.dtype and not autocast:
            raise TypeError(f"{name} must have the dtype of the map's weights ({W.dtype}), got {x.dtype}: convert "
                            f"the module with .to({x.dtype})")
        if x.device != W.device:
            raise ValueError(f"{name} must be on the device of the map's weights ({W.device}), got {x.device}")


def validate_normalized_args(q: Any, k: Any, v: Any, decay: Any, feature_map: Any, eps: Any, backend: Any,
                             return_state: Any, *, step: bool = False, state: Any = None) -> tuple:
    """Check the arguments of :func:`lightning_edu.api.normalized_attention` (or, with ``step``, of
    :func:`lightning_edu.api.normalized_attention_step`) before the feature map runs.

    Returns (args, feature_map, eps, return_state). The feature dimension d' is known only once the map has
    run: its output is checked by :func:`validate_feature_output`, the state by :func:`validate_augmented_state`.
    The ones column makes v one wider, so backend "triton" needs d_v + 1 <= 256.
    """
    if step:
        args = validate_step_args(q, k, v, None, decay, backend, who="normalized_attention_step")
    else:
        args = validate_attention_args(q, k, v, decay, backend=backend, decay_grad=True)
    feature_map = validate_feature_map(feature_map, args.kind)
    eps = validate_eps(eps)
    return_state = validate_flag("return_state", return_state)
    if args.backend == "triton" and args.d_v + 1 > 256:
        raise ValueError(f"backend='triton' supports d_v + 1 <= 256 here (a column of ones is appended to v for the "
                         f"normaliser), got d_v={args.d_v}")
    return args, feature_map, eps, return_state


__all__ += ["validate_feature_input", "validate_normalized_args"]


def validate_tokens(tokens: Any, vocab: int, max_len: int, name: str = "tokens") -> bool:
    """The input of a language model: an int32/int64 tensor (batch, n) with batch, n >= 1 and n <= ``max_len``.

    The ids must lie in [0, vocab). They are read here, on the host, only for a CPU tensor outside
    :func:`torch.compile`, where that costs one pass and no wait; on a GPU (or while compiling, or on the meta
    device) reading them would make the host wait for the GPU on every step, so the caller checks them on the
    device instead (:class:`lightning_edu.models.Decoder` turns the outputs of an id out of range into NaN).
    Returns whether the ids were checked here.
    """
    torch = _torch()
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int32, torch.int64) or tokens.ndim != 2:
        got = _describe(tokens) if _kind(tokens) else type(tokens).__name__
        raise TypeError(f"{name} must be an int32/int64 tensor of shape (batch, n), got {got}")
    batch, n = (int(s) for s in tokens.shape)
    if batch < 1 or n < 1:
        raise ValueError(f"{name} must hold at least one sequence of at least one token, got shape {(batch, n)}")
    if n > max_len:
        raise ValueError(f"{name}: sequence length {n} exceeds max_len={max_len}")
    if tokens.device.type != "cpu" or torch.compiler.is_compiling():
        return False
    bad = (tokens < 0) | (tokens >= vocab)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name} must be ids in [0, vocab) = [0, {vocab - 1}], got {int(tokens[where])} at "
                         f"(batch, position) {where}")
    return True


__all__ += ["validate_tokens"]
