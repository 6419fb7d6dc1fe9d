"""Exercises 13.1 (fit the cost model) and 13.2 (a perplexity gap): right answers pass on fixed and fresh inputs,
each planted mistake is rejected with the message that names it, and the package's own function is refused."""

import math

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError, IntegrityError
from lightning_edu.exercises.ch13 import check_fit_tgs, check_perplexity_gap
from lightning_edu.models.tgs import fit_tgs as package_fit_tgs


def _fit(kind="right"):
    def fit_tgs(contexts, tgs):
        T, x = np.asarray(contexts, float), np.asarray(tgs, float)
        if kind == "tgs itself":
            b, a = np.polyfit(T, x, 1)
        elif kind == "against 1/T":
            b, a = np.polyfit(1 / T, 1 / x, 1)
        else:
            b, a = np.polyfit(T, 1 / x, 1)
        if kind == "swapped":
            return b, a
        if kind == "microseconds":
            return a * 1e6, b * 1e6
        if kind == "two points":  # a line through the first and last point only: not least squares
            b = (1 / x[-1] - 1 / x[0]) / (T[-1] - T[0])
            return 1 / x[0] - b * T[0], b
        return a, b

    return fit_tgs


def test_fit_right_answer_passes(capsys):
    check_fit_tgs(_fit())
    check_fit_tgs(_fit(), seed=None)
    assert capsys.readouterr().out.count("Correct:") == 2


@pytest.mark.parametrize("kind,words", [
    ("swapped", "swapped"), ("tgs itself", "fitted to TGS itself"), ("against 1/T", "against 1 / T"),
    ("microseconds", "microseconds"), ("two points", "first and the last point"),
])
def test_fit_mistakes_are_named(kind, words):
    with pytest.raises(ExerciseError, match=words):
        check_fit_tgs(_fit(kind))


def test_fit_package_function_is_refused():
    with pytest.raises(IntegrityError):
        check_fit_tgs(package_fit_tgs)


def test_fit_reference_matches_the_package_on_recorded_shapes():
    # The checker's lines are exact: the package's fit recovers them, so checker and chapter agree.
    T = np.array([1024, 4096, 16384, 65536, 94208], float)
    for a, b in [(12e-6, 0.4e-9), (5e-6, 0.0)]:
        got = package_fit_tgs(T, 1 / (a + b * T))
        assert math.isclose(got[0], a, rel_tol=1e-9) and abs(got[1] - b) < 1e-18


def _gap(kind="right"):
    def perplexity_gap(loss, baseline_loss):
        d = loss - baseline_loss
        return {"right": 100 * (math.exp(d) - 1), "loss ratio": 100 * (loss / baseline_loss - 1),
                "no minus one": 100 * math.exp(d), "fraction": math.exp(d) - 1, "sign": 100 * (math.exp(-d) - 1),
                "bits": 100 * (2 ** d - 1), "off": 100 * (math.exp(d) - 1) + 0.5}[kind]

    return perplexity_gap


def test_gap_right_answer_passes(capsys):
    check_perplexity_gap(_gap())
    check_perplexity_gap(_gap(), seed=None)
    assert capsys.readouterr().out.count("Correct:") == 2


@pytest.mark.parametrize("kind,words", [
    ("loss ratio", "compared the losses"), ("no minus one", "minus 1"), ("fraction", "percent"),
    ("sign", "sign is reversed"), ("bits", "in bits"), ("off", "expected"),
])
def test_gap_mistakes_are_named(kind, words):
    with pytest.raises(ExerciseError, match=words):
        check_perplexity_gap(_gap(kind))


def test_gap_of_the_chapter_numbers():
    # 1.3323 vs 1.2994 nats per byte: 3.3 % more perplexity, not the 2.5 % a ratio of losses suggests.
    assert round(_gap()(1.3323, 1.2994), 1) == 3.3
    assert round(_gap("loss ratio")(1.3323, 1.2994), 1) == 2.5
