"""The shared machinery of every exercise check.

Every public ``check_...`` function is declared with :func:`exercise`, which gives it the same behaviour:

* ``check_x(fn)`` draws the check's fixed inputs (what the notebook shows); ``check_x(fn, seed=None)`` draws
  fresh ones and names their seed, so a grader's hidden test cannot be passed by an answer fitted to the
  visible inputs, and ``check_x(fn, seed=s)`` reproduces a failure seen with seed ``s``.
* the reader's function may not call the package's own implementation of what it is asked to write, from any
  thread or process it starts (:mod:`._integrity`); the message names the function it called.
* whatever the reader's function does -- raise, return a list, NaN, a string, the wrong shape, crash its
  process, never return -- the check ends in :class:`ExerciseError` with a message, never in a crash of the
  check itself: the check runs in a process of its own, and each call of the reader's function has a time limit
  (:mod:`._isolation`).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import secrets
import warnings

import numpy as np

from ..checks import to_numpy
from . import _integrity, _isolation
from ._errors import ExerciseError, IntegrityError
from ._isolation import _short  # a value's repr for a message, cut to 60 characters

__all__ = [
    "ExerciseError",
    "IntegrityError",
    "exercise",
    "expect_array",
    "expect_shape",
    "expect_close",
    "expect_count",
    "passed",
    "seeded",
    "wrong_rows",
    "without_overflow",
    "reader_lines",
    "lines_by_size",
    "refuse_low_precision",
    "precision_hint",
    "is_shape_error",
    "call_reader",
]


# The seed note of the check now running: "" for the fixed inputs, "fresh inputs, seed 123" otherwise.
_NOTE: contextvars.ContextVar[str] = contextvars.ContextVar("lightning_edu_exercise_note", default="")


def passed(message: str) -> None:
    """Print the success line of a check (with the seed of its inputs, when they are not the fixed ones)."""
    note = _NOTE.get()
    print(f"Correct: {message}" + (f" ({note})" if note else ""))


def call_reader(fn, name: str, args, where: str = "", shape_hint: str = ""):
    """``fn(*args)``, the reader's function; what it raises becomes an ExerciseError naming it (never a crash of
    the check). ``where``: the inputs, as the message should name them ("for d_k = 5, ..."); ``shape_hint``: what
    to say when the error is one of shapes (a product or a sum of arrays whose shapes do not fit, usually a
    transpose missing, :func:`is_shape_error`)."""
    try:
        return fn(*args)
    except ExerciseError:
        raise
    except Exception as exc:  # the reader's bug, reported, never a crash of the check
        hint = f". Hint: {shape_hint}" if shape_hint and is_shape_error(exc) else ""
        raise ExerciseError(f"your {name} raised {type(exc).__name__}{' ' + where if where else ''}: {exc}{hint}") from exc


_SHAPE_WORDS = ("matmul", "broadcast", "core dimension", "not aligned", "mat1 and mat2", "must match the size",
                "cannot be multiplied", "size mismatch", "shape mismatch")


def is_shape_error(exc: BaseException) -> bool:
    """Whether ``exc`` is numpy's or torch's complaint about shapes that do not fit (``a @ b`` with the inner
    sizes different, ``a + b`` that cannot broadcast): the usual sign of a transpose missing or misplaced."""
    return isinstance(exc, (ValueError, RuntimeError, IndexError)) and any(w in str(exc) for w in _SHAPE_WORDS)


def precision_hint(got, ref, *, rtol: float = 1e-9) -> str:
    """A hint when ``got`` differs from ``ref`` by more than ``rtol`` but by no more than float32's rounding
    (1e-4 of the largest |ref|): the algorithm is right and a buffer or a factor is float32 (``np.zeros(...,
    dtype=np.float32)``, ``np.float32(lam)``, ``torch.zeros`` without ``dtype=``). Empty otherwise."""
    try:
        got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    except (TypeError, ValueError):
        return ""
    if got.shape != ref.shape or not ref.size or not np.isfinite(got).all():
        return ""
    scale = float(np.max(np.abs(ref)))
    diff = float(np.max(np.abs(got - ref)))
    if not (rtol * scale < diff <= 1e-4 * scale):
        return ""
    return (f"your values agree with the reference to {diff / scale:.1g} of its largest entry: that is the rounding "
            "of float32 (about 6e-8 per operation), not a mistake in the algorithm. A buffer or a factor in float32 "
            "(np.zeros(..., dtype=np.float32), np.float32(...), torch.zeros without dtype=) rounds every sum into "
            "it; keep everything in the inputs' float64")


def without_overflow(name: str, call):
    """``call()``, the reader's function called on the check's inputs, with float overflow raised instead of
    silenced (every check runs under ``np.errstate(all="ignore")``). An answer that forms lambda ** -299 and then
    discards it (``np.where(gap >= 0, decay ** gap, 0)``) returns the right values, but it formed an inf on the
    way: the mistake the decay chapters teach to avoid, since a mask that multiplies instead of selecting turns
    that inf into NaN. It fails here with a message that says so."""
    try:
        with np.errstate(over="raise"):
            return call()
    except (FloatingPointError, OverflowError) as exc:
        raise ExerciseError(
            f"{name} overflowed ({exc}): it formed a negative power such as lambda ** (i - j) with i < j "
            "(0.05 ** -299 is inf in float64), even if np.where then threw it away. Build M from non-negative powers: "
            "clamp the exponent first, lambda ** np.maximum(i - j, 0), then select with np.where"
        ) from exc


def refuse_low_precision(name: str, x) -> None:
    """A float32/float16/bfloat16 array or tensor where the check compares with float64 to 1e-9 or so: say so,
    rather than let the rounding pass for a mistake in the algorithm (a buffer from ``torch.zeros(...)`` or
    ``np.zeros(..., dtype=np.float32)`` is the usual cause)."""
    dtype = str(getattr(x, "dtype", "")).replace("torch.", "")
    if dtype in ("float32", "float16", "bfloat16"):
        raise ExerciseError(f"{name} is {dtype}: the check compares with float64 to about 1e-9, which {dtype} cannot "
                            "reach. Keep the inputs' float64: create buffers with the inputs' dtype (torch.zeros "
                            "makes float32 unless given dtype=...)")


def reader_lines(call):
    """(``call()``, the number of lines of Python the reader's own code ran in it). The reader's code is any code
    outside this package and outside the interpreter's installation (numpy, the standard library): a notebook
    cell, or a test file. A check uses the count to tell a loop over the tokens, one line per token, from the
    few steps an algorithm is asked to take: numpy's vectorised work runs in C and counts nothing. A tracer
    already set (a debugger, coverage) is restored afterwards."""
    import os
    import sys

    skip = tuple(os.path.normcase(os.path.realpath(p)) + os.sep for p in
                 {os.path.dirname(os.path.dirname(__file__)), sys.prefix, sys.base_prefix, sys.exec_prefix})
    mine: dict[str, bool] = {}
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if name not in mine:
            real = os.path.normcase(os.path.realpath(name)) if not name.startswith("<") else name
            mine[name] = not name.startswith("<frozen") and not real.startswith(skip)
        return local if mine[name] else None

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        result = call()
    finally:
        sys.settrace(previous)
    return result, count


def lines_by_size(run, sizes) -> dict:
    """{size: the lines of Python the reader's code ran in ``run(size)``} (:func:`reader_lines`) for each of
    ``sizes``. How that count grows tells a loop over blocks or tokens (at least a line more per block) from
    batched work (the same count at every size), where the values cannot."""
    return {size: reader_lines(lambda: run(size))[1] for size in sizes}


def exception_chain(exc: BaseException, limit: int = 8):
    """``exc`` and the exceptions it was raised from or during, at most ``limit`` (Triton's interpreter wraps a
    kernel's own exception in its own)."""
    seen = 0
    while exc is not None and seen < limit:
        yield exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1


def seeded(seed: int) -> np.random.Generator:
    """The generator of a check's extra inputs: its offset ``seed`` (never 0 here) drawn into a fresh stream."""
    return np.random.default_rng([7919, int(seed)])


# ------------------------------------------------------------------------------------------- answers


def _torch_tensor_type():
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return ()
    return (torch.Tensor,)


def expect_array(name: str, got) -> np.ndarray:
    """``got`` as a float64 numpy array, or an ExerciseError saying why it is not an array of real numbers.

    An exercise that asks for an array gets a numpy array or a torch tensor; a Python list, a scalar or a string
    is refused with a message (a list of rows usually means a loop that should have been one array operation).
    """
    if got is None:
        raise ExerciseError(f"{name}: your function returned None -- did you forget `return`?")
    if isinstance(got, (list, tuple)):
        raise ExerciseError(f"{name} is a Python {type(got).__name__}, not an array: return a numpy array (or a torch "
                            "tensor in the PyTorch exercises), e.g. np.stack(rows) or np.asarray(values)")
    if not isinstance(got, (np.ndarray, *_torch_tensor_type())):
        raise ExerciseError(f"{name} is {type(got).__name__} ({_short(got)}), not an array: return a numpy array (or a "
                            "torch tensor in the PyTorch exercises)")
    dtype = got.dtype
    if isinstance(got, np.ndarray) and dtype.kind not in "fiu":
        raise ExerciseError(f"{name} has dtype {dtype}: expected an array of real numbers (float64)")
    if not isinstance(got, np.ndarray) and (getattr(dtype, "is_complex", False) or str(dtype) == "torch.bool"):
        raise ExerciseError(f"{name} has dtype {dtype}: expected a tensor of real numbers (float64)")
    try:
        return to_numpy(got)
    except Exception as exc:  # noqa: BLE001 - e.g. a tensor on a meta device
        raise ExerciseError(f"{name} could not be read as numbers: {type(exc).__name__}: {exc}") from exc


def expect_shape(name: str, got, expected_shape) -> np.ndarray:
    arr = expect_array(name, got)
    if arr.shape != tuple(expected_shape):
        raise ExerciseError(f"{name} has shape {arr.shape}, expected {tuple(expected_shape)}")
    return arr


def expect_count(name: str, got, *, what: str = "a count") -> int:
    """``got`` as a Python int: an int or numpy integer, or a float that is a whole number; else ExerciseError."""
    if got is None:
        raise ExerciseError(f"{name} returned None -- did you forget `return`?")
    if isinstance(got, (bool, np.bool_)):
        raise ExerciseError(f"{name} returned {got!r}, a bool; {what} is an int")
    if isinstance(got, (int, np.integer)):
        return int(got)
    if isinstance(got, (float, np.floating)):
        if not np.isfinite(got):
            raise ExerciseError(f"{name} returned {got!r}; {what} is a finite whole number")
        if float(got).is_integer():
            return int(got)
        raise ExerciseError(f"{name} returned {got!r}, not a whole number; {what} is an int")
    raise ExerciseError(f"{name} returned {_short(got)} of type {type(got).__name__}; {what} is an int")


def wrong_rows(got, ref, *, rtol: float = 1e-9, axis: int = -2) -> np.ndarray:
    """Indices along ``axis`` (the sequence, or the block axis) where ``got`` differs from ``ref``: by more than
    ``rtol`` times the largest |ref|, or where ``got`` is not finite (a NaN compares as equal to nothing).

    The one way every checker locates its first (or, for a reverse sweep, last) wrong row or block.
    """
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    scale = max(float(np.max(np.abs(ref))), 1e-300) if ref.size else 1.0
    with np.errstate(invalid="ignore", over="ignore"):
        bad = ~(np.abs(got - ref) <= rtol * scale)  # NaN and inf fail the comparison, so they count as wrong
    bad = np.moveaxis(bad, axis, 0)
    return np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))


def expect_close(name: str, got, ref, *, rtol: float = 1e-9, axis: int = -2, block_size: int | None = None, hint: str = "") -> np.ndarray:
    """Raise unless ``got`` matches ``ref`` to relative error ``rtol``; locate the first wrong rows.

    ``axis`` is the sequence axis; with ``block_size`` the message names the first wrong block too.
    """
    ref = to_numpy(ref)
    arr = expect_shape(name, got, ref.shape)
    if not np.isfinite(arr).all():
        rows = np.flatnonzero(~np.isfinite(np.moveaxis(arr, axis, 0)).reshape(arr.shape[axis], -1).all(axis=1))
        kind = "NaN" if np.isnan(arr).any() else "inf"
        where = f"rows {int(rows[0])}..{int(rows[-1])} ({len(rows)} of {arr.shape[axis]})"
        if block_size:
            where = f"block {int(rows[0]) // block_size} first; {where}"
        raise ExerciseError(f"{name} contains {kind} in {where}: with finite inputs every entry is finite"
                            + (f" ({hint})" if hint else ""))
    scale = max(float(np.max(np.abs(ref))), 1e-300) if ref.size else 1.0
    rows = wrong_rows(arr, ref, rtol=rtol, axis=axis)
    if not rows.size:
        return arr
    first = int(rows[0])
    where = f"rows {first}..{int(rows[-1])} ({len(rows)} of {ref.shape[axis]} wrong)"
    if block_size:
        where = f"block {first // block_size} (rows {first - first % block_size}-{first - first % block_size + block_size - 1}); {where}"
    diff = float(np.max(np.abs(arr - ref)))
    message = f"{name} differs first in {where}; max |difference| {diff:.2g} vs max |reference| {scale:.2g}"
    raise ExerciseError(message + (f". Hint: {hint}" if hint else ""))


# ------------------------------------------------------------------------------------------- the declaration


def _resolve_seed(seed) -> tuple[int, str]:
    if seed is None:
        fresh = secrets.randbelow(2**31 - 2) + 1
        return fresh, f"fresh inputs, seed {fresh}"
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ExerciseError(f"seed must be None (fresh inputs), 0 (the fixed inputs) or a positive int, got {seed!r}")
    seed = int(seed)
    return seed, (f"inputs of seed {seed}" if seed else "")


def _reader_error(exc: BaseException, label: str) -> ExerciseError | None:
    """What the reader's code raised: NotImplementedError becomes a message at once (a released notebook's
    placeholder); anything else is marked as the reader's, for the message of :func:`exercise`."""
    if isinstance(exc, NotImplementedError):
        return ExerciseError(f"{label} is not implemented yet: it raised NotImplementedError. Write your code in "
                             "place of `raise NotImplementedError()`")
    try:
        exc._lightning_edu_reader = label  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an exception type without a __dict__: reported as the check's own
        pass
    return None


def exercise(number: str, *, allowed=(), strict=(), reveals=(), substitutes=None, kernel: bool = False):
    """Declare the check of exercise ``number`` (e.g. ``"4.3"``).

    ``allowed``: dotted names of package functions the reader may call (``"lightning_edu.numpy_reference.elu_plus_one"``);
    ``strict``: dotted names that fail even when reached through an allowed function; ``reveals``: names of
    package functions whose source shows this exercise's answer (a course hides ``show_source`` of them in the
    students' copy, see :mod:`lightning_edu.assignments`); ``substitutes``: {name in the reader's namespace:
    function} used in place of the reader's answers to earlier exercises while this one is checked;
    ``kernel``: the answer is a Triton kernel (scanned, launched as is).

    The decorated check takes ``(fn, *, seed=0)``: ``seed`` 0 draws the fixed inputs, ``None`` fresh ones (the
    seed is printed), a positive int reproduces those of that seed. It prints ``Correct: ...`` or raises
    :class:`ExerciseError`.
    """

    def declare(check):
        takes_seed = "seed" in inspect.signature(check).parameters

        @functools.wraps(check)
        def run(fn, *args, seed: int | None = 0, **kwargs) -> None:
            offset, note = _resolve_seed(seed)
            if not takes_seed:  # a check without random inputs (it tests an input the reader made) runs as is
                offset, note = 0, ""
            label = getattr(_integrity._unwrap_kernel(fn), "__name__", None) or type(fn).__name__
            suffix = (f" [{note}: {check.__name__}({label}, seed={offset}) reproduces them]" if offset else "")
            if not (callable(fn) or hasattr(fn, "fn") or (kernel and hasattr(fn, "__getitem__"))):
                raise ExerciseError(f"{check.__name__} needs your function, got {_short(fn)} of type {type(fn).__name__}")
            allowed_objs = [_integrity.resolve(name) for name in allowed]
            strict_objs = [_integrity.resolve(name) for name in strict]
            _integrity.scan(fn, allowed=allowed_objs, label=label, kernel=kernel)

            def body():
                if kernel:
                    target = fn
                else:
                    target = _integrity.guarded(fn, allowed=allowed_objs, strict=strict_objs, substitutes=substitutes,
                                                label=label, on_error=lambda exc: _reader_error(exc, label))
                token = _NOTE.set(note)
                try:
                    with warnings.catch_warnings(), np.errstate(all="ignore"):
                        # A warning on stderr would cost the points in nbgrader; the values decide, not warnings.
                        warnings.simplefilter("ignore")
                        if takes_seed:
                            check(target, *args, seed=offset, **kwargs)
                        else:
                            check(target, *args, **kwargs)
                except ExerciseError as exc:
                    if suffix:
                        exc.args = (f"{exc.args[0] if exc.args else ''}{suffix}",) + tuple(exc.args[1:])
                    raise
                except Exception as exc:  # noqa: BLE001 - never a crash of the check: say what happened
                    raise _as_exercise_error(exc, label, suffix) from exc
                finally:
                    _NOTE.reset(token)

            # The check runs in a process of its own (a crash, a loop or a thread of the reader's stays there):
            # _isolation's docstring.
            if not kernel:
                _integrity.prepare()
            _isolation.run_check(body, label=label, suffix=suffix)

        run.exercise = number
        run.reveals = tuple(reveals)
        run.allowed = tuple(allowed)
        run.check = check
        return run

    return declare


def _as_exercise_error(exc: Exception, label: str, suffix: str) -> ExerciseError:
    reader = getattr(exc, "_lightning_edu_reader", None)
    if isinstance(exc, NotImplementedError) and reader:
        return ExerciseError(f"{label} is not implemented yet: it raised NotImplementedError. Write your code in place "
                             "of `raise NotImplementedError()`" + suffix)
    if reader:
        return ExerciseError(f"your {label} raised {type(exc).__name__}: {exc}" + suffix)
    return ExerciseError(f"the check could not use what your {label} returned ({type(exc).__name__}: {exc}); make "
                         "sure it returns what the exercise asks for: the type, shape and dtype in its statement"
                         + suffix)
