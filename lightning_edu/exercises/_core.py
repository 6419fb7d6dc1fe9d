"""The shared machinery of every exercise check."""

from __future__ import annotations

import numpy as np

from ..checks import to_numpy

__all__ = ["ExerciseError", "expect_shape", "expect_close", "passed", "wrong_rows"]


class ExerciseError(AssertionError):
    """Raised by a check with a message that says what is wrong and where."""


def passed(message: str) -> bool:
    print(f"Correct: {message}")
    return True


def expect_shape(name: str, got, expected_shape) -> np.ndarray:
    if got is None:
        raise ExerciseError(f"{name}: your function returned None -- did you forget `return`?")
    arr = to_numpy(got)
    if arr.shape != tuple(expected_shape):
        raise ExerciseError(f"{name} has shape {arr.shape}, expected {tuple(expected_shape)}")
    return arr


def wrong_rows(got, ref, *, rtol: float = 1e-9, axis: int = -2) -> np.ndarray:
    """Indices along ``axis`` (the sequence, or the block axis) where ``got`` differs from ``ref``: by more than
    ``rtol`` times the largest |ref|, or where ``got`` is not finite (a NaN compares as equal to nothing).

    The one way every checker locates its first (or, for a reverse sweep, last) wrong row or block.
    """
    got, ref = np.asarray(got, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    scale = max(float(np.max(np.abs(ref))), 1e-300) if ref.size else 1.0
    with np.errstate(invalid="ignore"):
        bad = ~(np.abs(got - ref) <= rtol * scale)  # NaN and inf fail the comparison, so they count as wrong
    bad = np.moveaxis(bad, axis, 0)
    return np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))


def expect_close(name: str, got, ref, *, rtol: float = 1e-9, axis: int = -2, block_size: int | None = None, hint: str = "") -> np.ndarray:
    """Raise unless ``got`` matches ``ref`` to relative error ``rtol``; locate the first wrong rows.

    ``axis`` is the sequence axis; with ``block_size`` the message names the first wrong block too.
    """
    ref = to_numpy(ref)
    arr = expect_shape(name, got, ref.shape)
    if np.isnan(arr).any():
        raise ExerciseError(f"{name} contains NaN" + (f" ({hint})" if hint else ""))
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
