"""The chapter 09 exercise checks: the model solutions (as in the notebook) pass, and typical mistakes get a
message that names what is wrong and where."""

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError
from lightning_edu.exercises.ch09 import check_dq_phase, check_dv_phase
from lightning_edu.numpy_la3 import tile_decay


def tiles(rows, micro):
    return [(start, min(micro, rows - start)) for start in range(0, rows, micro)]


def make_dv_phase(mistake=None):
    def dv_phase(q, k, do, lam, micro):
        dv = np.zeros((k.shape[0], do.shape[1]))
        for sj, cj in tiles(k.shape[0], micro):
            for si, ci in tiles(q.shape[0], micro):
                if si < sj:
                    continue
                factor, keep = tile_decay(lam, si, ci, sj, cj)
                if mistake == "exponent":
                    factor, _ = tile_decay(lam, si + 1, ci, sj, cj)
                scores = (q[si:si + ci] @ k[sj:sj + cj].T) * factor[0]
                if mistake != "no_mask":
                    scores = np.where(keep, scores, 0.0)
                dv[sj:sj + cj] += scores.T @ do[si:si + ci]
        if mistake == "shape":
            return dv.T
        if mistake == "nan":
            dv[5] = np.nan
        return dv
    return dv_phase


def make_dq_phase(mistake=None):
    def dq_phase(do, v, k, lam, micro):
        dq = np.zeros((do.shape[0], k.shape[1]))
        if mistake == "per_j":  # the design note: one accumulator per key micro-chunk, stored there
            for sj, cj in tiles(k.shape[0], micro):
                acc = np.zeros((cj, k.shape[1]))
                for si, ci in tiles(do.shape[0], micro):
                    if si >= sj:
                        factor, keep = tile_decay(lam, si, ci, sj, cj)
                        acc += np.where(keep, (do[si:si + ci] @ v[sj:sj + cj].T) * factor[0], 0.0) @ k[sj:sj + cj]
                dq[sj:sj + cj] = acc
            return dq
        for si, ci in tiles(do.shape[0], micro):
            for sj, cj in tiles(k.shape[0], micro):
                if sj > si:
                    continue
                factor, keep = tile_decay(lam, si, ci, sj, cj)
                if mistake == "exponent":
                    factor = lam ** np.abs(np.arange(ci)[:, None] - np.arange(cj)[None, :])[None]
                scores = (do[si:si + ci] @ v[sj:sj + cj].T) * factor[0]
                if mistake != "no_mask":
                    scores = np.where(keep, scores, 0.0)
                dq[si:si + ci] += scores @ k[sj:sj + cj]
        return dq
    return dq_phase


def test_model_solutions_pass(capsys):
    check_dv_phase(make_dv_phase())
    check_dq_phase(make_dq_phase())
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, pattern", [
    ("no_mask", "diagonal tile"),
    ("exponent", "right at lambda = 1"),
    ("shape", "shape"),
    ("nan", "NaN"),
])
def test_dv_mistakes_are_named(mistake, pattern):
    with pytest.raises(ExerciseError, match=pattern) as info:
        check_dv_phase(make_dv_phase(mistake))
    if mistake in ("no_mask", "exponent"):
        assert "micro-chunk" in str(info.value) and "rows" in str(info.value)


@pytest.mark.parametrize("mistake, pattern", [
    ("no_mask", "diagonal tile"),
    ("per_j", "design note"),
    ("exponent", "right at lambda = 1"),
])
def test_dq_mistakes_are_named(mistake, pattern):
    with pytest.raises(ExerciseError, match=pattern):
        check_dq_phase(make_dq_phase(mistake))


def _dense_factor(rows, lam):
    gap = np.arange(rows)[:, None] - np.arange(rows)[None, :]
    return np.where(gap >= 0, lam ** np.maximum(gap, 0), 0.0)


def test_a_dense_c_by_c_answer_is_refused_for_its_memory():
    # the right values in one line each, through the C x C matrix the exercises forbid
    def dense_dv(q, k, do, lam, micro):
        return ((q @ k.T) * _dense_factor(len(q), lam)).T @ do

    def dense_dq(do, v, k, lam, micro):
        return ((do @ v.T) * _dense_factor(len(do), lam)) @ k

    for check, fn in ((check_dv_phase, dense_dv), (check_dq_phase, dense_dq)):
        with pytest.raises(ExerciseError, match=r"right values but allocated .* 2048 x 2048 float64 matrix"):
            check(fn)


def test_a_raising_or_empty_function_is_reported_not_crashed():
    def boom(*args):
        raise IndexError("index 16 is out of bounds")

    with pytest.raises(ExerciseError, match="raised IndexError"):
        check_dq_phase(boom)
    with pytest.raises(ExerciseError, match="returned None"):
        check_dv_phase(lambda *args: None)
    with pytest.raises(ExerciseError):
        check_dv_phase(lambda *args: "not an array")


def test_a_float32_buffer_is_named_as_such_not_blamed_on_the_algorithm():
    def float32_dv(q, k, do, lam, micro, back_to_float64=False):
        dv = np.zeros((k.shape[0], do.shape[1]), dtype=np.float32)
        for sj, cj in tiles(k.shape[0], micro):
            for si, ci in tiles(q.shape[0], micro):
                if si >= sj:
                    factor, keep = tile_decay(lam, si, ci, sj, cj)
                    dv[sj:sj + cj] += np.where(keep, (q[si:si + ci] @ k[sj:sj + cj].T) * factor[0], 0.0).T @ do[si:si + ci]
        return dv.astype(np.float64) if back_to_float64 else dv

    with pytest.raises(ExerciseError, match="dv_phase is float32: the check compares with float64"):
        check_dv_phase(float32_dv)
    with pytest.raises(ExerciseError) as info:
        check_dv_phase(lambda *a: float32_dv(*a, back_to_float64=True))
    assert "that is the rounding of float32" in str(info.value) and "not a mistake in the algorithm" in str(info.value)
