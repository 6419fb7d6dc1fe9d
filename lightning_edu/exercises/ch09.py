"""Checks for the exercises of chapter 09 (a recompute-heavy backward, Lightning Attention-3).

:func:`check_dv_phase` and :func:`check_dq_phase` call the reader's numpy functions on seeded random chunks
of one head (chunk lengths that the micro-chunk size divides and lengths that it does not) and compare with
:func:`lightning_edu.numpy_la3.intra_dv` and :func:`~lightning_edu.numpy_la3.intra_dq` (float64). A failure
names the first wrong micro-chunk and its rows, and recognises the typical mistakes: a diagonal tile used
without its causal mask, the design note's dQ stored per key micro-chunk, a wrong decay exponent, and a C x C
matrix formed where the exercise asks for tiles (peak memory on a 2048-row chunk).
"""

from __future__ import annotations

import numpy as np

from ..numpy_la3 import intra_dq, intra_dv
from ._core import (ExerciseError, call_reader, exercise, expect_shape, passed, precision_hint, refuse_low_precision,
                    wrong_rows)

__all__ = ["check_dv_phase", "check_dq_phase"]

_CASES = [  # (C rows of the chunk, d_k, d_v, lambda, micro-chunk size c)
    (48, 8, 5, 0.9, 16),
    (37, 6, 4, 0.7, 8),
    (16, 3, 7, 0.95, 16),
]
_RTOL = 1e-9


def _inputs(case: int, rows: int, d_k: int, d_v: int, seed: int = 0):
    rng = np.random.default_rng(900 + case + seed)
    q, k = rng.standard_normal((2, rows, d_k))
    v, do = rng.standard_normal((2, rows, d_v))
    return q, k, v, do


def _call(fn, name: str, args, shape):
    out = call_reader(fn, name, [a.copy() if isinstance(a, np.ndarray) else a for a in args])
    refuse_low_precision(name, out)
    try:
        return expect_shape(name, out, shape).astype(np.float64)
    except ExerciseError:
        raise
    except Exception as exc:
        raise ExerciseError(f"{name} returned {type(out).__name__}, which is not an array of numbers: {exc}") from exc


def _dense_decay(rows: int, lam: float, micro: int, diagonal: str = "masked") -> np.ndarray:
    """The C x C decay lambda^(r-s) for r >= s; above the diagonal 0 ("masked"), or, inside the diagonal
    micro-chunk tiles only, 1 ("unmasked": exponent clamped at 0, no mask) or lambda^(r-s) ("negative")."""
    r = np.arange(rows)
    gap = r[:, None] - r[None, :]
    with np.errstate(over="ignore"):
        out = np.where(gap >= 0, lam ** np.maximum(gap, 0).astype(np.float64), 0.0)
        same_tile = (r[:, None] // micro) == (r[None, :] // micro)
        if diagonal == "unmasked":
            out = np.where(same_tile & (gap < 0), 1.0, out)
        elif diagonal == "negative":
            out = np.where(same_tile & (gap < 0), lam ** gap.astype(np.float64), out)
    return out


def _dq_per_j(do, v, k, lam: float, micro: int):
    """The note's storing: dq_acc_j = sum_{i >= j} [(dO_i V_j^T) * L_ij] K_j written into micro-chunk j's rows
    (defined when c divides C)."""
    rows = do.shape[0]
    if rows % micro:
        return None
    L = _dense_decay(rows, lam, micro)
    out = np.zeros((rows, k.shape[1]))
    for j in range(0, rows, micro):
        acc = np.zeros((micro, k.shape[1]))
        for i in range(j, rows, micro):
            da = (do[i:i + micro] @ v[j:j + micro].T) * L[i:i + micro, j:j + micro]
            acc += da @ k[j:j + micro]
        out[j:j + micro] = acc
    return out


def _same(got, ref) -> bool:
    return ref is not None and got.shape == ref.shape and not wrong_rows(got, ref, rtol=_RTOL, axis=0).size


def _where(got, ref, micro: int) -> str:
    rows = wrong_rows(got, ref, rtol=_RTOL, axis=0)
    first = int(rows[0])
    tile = first // micro
    last_row = min(ref.shape[0], (tile + 1) * micro) - 1
    diff = float(np.nanmax(np.abs(got - ref))) if np.isfinite(got).any() else float("nan")
    return (f"micro-chunk {tile} (rows {tile * micro}-{last_row}) is the first wrong one; {len(rows)} of "
            f"{ref.shape[0]} rows differ, max |difference| {diff:.2g}")


def _check(fn, name: str, reference, dense, make_args, per_j=None, seed: int = 0) -> bool:
    for case, (rows, d_k, d_v, lam, micro) in enumerate(_CASES):
        q, k, v, do = _inputs(case, rows, d_k, d_v, seed)
        args, ref, width = make_args(q, k, v, do, lam, micro)
        got = _call(fn, name, args, (rows, width))
        where = f"for a chunk of {rows} rows, d_k = {d_k}, d_v = {d_v}, lambda = {lam}, micro = {micro}"
        if _same(got, ref):
            continue
        if not np.isfinite(got).all():
            bad = int(np.flatnonzero(~np.isfinite(got).all(axis=1))[0])
            raise ExerciseError(f"{name} has NaN or inf in row {bad} (micro-chunk {bad // micro}) {where}: every "
                                "decay factor is lambda to a non-negative power, and finite inputs give finite gradients")
        rounding = precision_hint(got, ref, rtol=_RTOL)
        if rounding:
            raise ExerciseError(f"{name} differs {where}: {_where(got, ref, micro)}. Hint: {rounding}")
        if any(_same(got, dense(q, k, v, do, lam, micro, d)) for d in ("unmasked", "negative")):
            raise ExerciseError(f"{name} differs {where}: {_where(got, ref, micro)}. Hint: on a diagonal tile (i = j) "
                                "keep only the pairs with the key at or before the query (r >= s) -- select them with "
                                "the `keep` mask of tile_decay; the entries above the diagonal must not count")
        if per_j is not None and _same(got, per_j(q, k, v, do, lam, micro)):
            raise ExerciseError(f"{name} differs {where}: {_where(got, ref, micro)}. Hint: this is the design "
                                "note's mistake: one accumulator per key micro-chunk j, summed over the queries i >= j "
                                "and stored into micro-chunk j. dQ belongs to the queries: loop i outside, j <= i "
                                "inside, and store the accumulator into micro-chunk i")
        at_one = _call(fn, name, make_args(q, k, v, do, 1.0, micro)[0], (rows, width))
        if _same(at_one, make_args(q, k, v, do, 1.0, micro)[1]):
            raise ExerciseError(f"{name} differs {where}: {_where(got, ref, micro)}. Hint: it is right at "
                                "lambda = 1, so the decay is off: tile (i, j) needs lambda^((i - j) c + r - s), the "
                                "distance between query row r of micro-chunk i and key row s of micro-chunk j")
        raise ExerciseError(f"{name} differs {where}: {_where(got, ref, micro)}")
    _check_tiled(fn, name, make_args, seed)
    return True


_LONG = (2048, 4, 4, 0.99, 64)  # a chunk long enough that a C x C matrix (32 MiB in float64) stands out


def _check_tiled(fn, name: str, make_args, seed: int) -> None:
    """Right values are not the whole exercise: the phase must work on micro-chunk tiles, never on the C x C
    matrix. On a 2048-row chunk with 64-row micro-chunks, tiles need about 0.1 MiB; the check allows a quarter of
    the 32 MiB a C x C float64 matrix takes, measured with tracemalloc (numpy reports its buffers there)."""
    from ..measure import peak_memory_numpy

    rows, d_k, d_v, lam, micro = _LONG
    q, k, v, do = _inputs(len(_CASES), rows, d_k, d_v, seed)
    args, ref, width = make_args(q, k, v, do, lam, micro)
    out = {}
    peak = peak_memory_numpy(lambda: out.setdefault("got", _call(fn, name, args, (rows, width))))
    where = f"for a chunk of {rows} rows, d_k = {d_k}, d_v = {d_v}, lambda = {lam}, micro = {micro}"
    if not _same(out["got"], ref):
        raise ExerciseError(f"{name} differs {where}: {_where(out['got'], ref, micro)}")
    square = rows * rows * 8
    if peak > square / 4:
        raise ExerciseError(f"{name} gives the right values but allocated {peak / 2**20:.1f} MiB {where}: a {rows} x "
                            f"{rows} float64 matrix takes {square / 2**20:.0f} MiB. Never form the C x C scores or "
                            f"decay: work tile by tile, at most {micro} x {micro} at a time (tile_decay gives one tile's)")


@exercise("9.1", reveals=("intra_dv", "_intra_key_side"), allowed=("lightning_edu.numpy_la3.tile_decay",))
def check_dv_phase(dv_phase, seed: int = 0) -> None:
    """``dv_phase(q, k, do, lam, micro)`` must return the intra-chunk dV of one chunk of one head, (C, d_v):
    dV_j = sum_{i >= j} [(Q_i K_j^T) * L_ij]^T dO_i (``numpy_la3.intra_dv``)."""

    def make_args(q, k, v, do, lam, micro):
        return (q, k, do, lam, micro), intra_dv(q, k, do, lam, micro), do.shape[1]

    def dense(q, k, v, do, lam, micro, diagonal):
        return ((q @ k.T) * _dense_decay(q.shape[0], lam, micro, diagonal)).T @ do

    _check(dv_phase, "dv_phase", intra_dv, dense, make_args, seed=seed)
    passed("the dV phase matches numpy_la3.intra_dv on every chunk, partial last micro-chunks included, tile by "
           "tile (no C x C matrix at C = 2048)")


@exercise("9.2", reveals=("intra_dq", "_intra_query_side"), allowed=("lightning_edu.numpy_la3.tile_decay",))
def check_dq_phase(dq_phase, seed: int = 0) -> None:
    """``dq_phase(do, v, k, lam, micro)`` must return the intra-chunk dQ of one chunk of one head, (C, d_k):
    dQ_i = sum_{j <= i} [(dO_i V_j^T) * L_ij] K_j (``numpy_la3.intra_dq``)."""

    def make_args(q, k, v, do, lam, micro):
        return (do, v, k, lam, micro), intra_dq(do, v, k, lam, micro), k.shape[1]

    def dense(q, k, v, do, lam, micro, diagonal):
        return ((do @ v.T) * _dense_decay(q.shape[0], lam, micro, diagonal)) @ k

    def per_j(q, k, v, do, lam, micro):
        return _dq_per_j(do, v, k, lam, micro)

    _check(dq_phase, "dq_phase", intra_dq, dense, make_args, per_j, seed=seed)
    passed("the dQ phase matches numpy_la3.intra_dq on every chunk, partial last micro-chunks included, tile by "
           "tile (no C x C matrix at C = 2048)")
