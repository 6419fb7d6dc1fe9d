"""Exercises 14.1 (the fraction of the HBM floor) and 14.2 (interleaved rounds): right answers pass on fixed and
fresh inputs, each planted mistake is rejected with the message that names it, the package's byte count is refused
as an answer, and the checker's fraction is the one the benchmark records."""

import statistics

import numpy as np
import pytest

from lightning_edu.book import load_recorded
from lightning_edu.costs import hbm_floor_bytes
from lightning_edu.exercises import ExerciseError, IntegrityError
from lightning_edu.exercises.ch14 import check_floor_fraction, check_interleaved_medians, interleaved_order


def _fraction(kind="right"):
    def floor_fraction(ms, batch, T, heads, d, elem_bytes, bandwidth, training):
        tensors = {"right": 11 if training else 4, "backward only": 7 if training else 4,
                   "forward only": 4, "always eleven": 11}.get(kind, 11 if training else 4)
        nbytes = tensors * batch * T * heads * d * (1 if kind == "elements" else elem_bytes)
        seconds = ms if kind == "ms as s" else ms * 1e-3
        fraction = nbytes / bandwidth / seconds
        if kind == "upside down":
            return 1 / fraction
        if kind == "off":
            return fraction * 1.01
        return fraction

    return floor_fraction


def test_floor_fraction_right_answer_passes(capsys):
    for seed in (0, None, 5):
        check_floor_fraction(_fraction(), seed=seed)
    assert capsys.readouterr().out.count("Correct: floor_fraction agrees") == 3


@pytest.mark.parametrize("kind,words", [
    ("backward only", "only the backward's 7 tensors"), ("forward only", "only the forward's 4 tensors"),
    ("always eleven", "with training false the call is a forward"), ("elements", "counted elements"),
    ("ms as s", "milliseconds as if it were seconds"), ("upside down", "upside down"), ("off", "expected"),
])
def test_floor_fraction_mistakes(kind, words):
    with pytest.raises(ExerciseError, match=words):
        check_floor_fraction(_fraction(kind))


def test_floor_fraction_refuses_the_package_count():
    def floor_fraction(ms, batch, T, heads, d, elem_bytes, bandwidth, training):
        nbytes = hbm_floor_bytes(batch, T, heads, d, elem_bytes)
        if training:
            nbytes += hbm_floor_bytes(batch, T, heads, d, elem_bytes, backward=True)
        return nbytes / bandwidth / (ms * 1e-3)

    with pytest.raises(IntegrityError, match="hbm_floor_bytes"):
        check_floor_fraction(floor_fraction)


def test_floor_fraction_is_the_benchmarks():
    # The model answer reproduces the fractions the benchmark recorded (chapter 14, section 14.1).
    bench = load_recorded("bench_h100_d128")
    answer = _fraction()
    for row in (r for r in bench["results"] if r["method"] == "triton"):
        shape = (row["batch"], row["T"], row["heads"], row["D"], 2, bench["copy_bandwidth_bytes_per_s"])
        assert answer(row["fwd_ms"], *shape, False) == pytest.approx(row["fwd_floor_frac"], rel=1e-12)
        assert answer(row["fwdbwd_ms"], *shape, True) == pytest.approx(row["fwdbwd_floor_frac"], rel=1e-12)


def _medians(kind="right"):
    def interleaved_medians(measures, rounds):
        names = list(measures)
        times = {name: [] for name in names}
        if kind == "by method":
            for name in names:
                times[name] = [measures[name]() for _ in range(rounds)]
        else:
            for r in range(rounds):
                start = 0 if kind == "no rotation" else r % len(names)
                for name in names[start:] + names[:start]:
                    times[name].append(measures[name]())
                    if kind == "twice" and r == 0:
                        measures[name]()
        summary = {"mean": statistics.mean, "min": min}.get(kind, statistics.median)
        medians = [summary(times[name]) for name in names]
        if kind == "dict":
            return dict(zip(names, medians))
        if kind == "list":
            return medians
        if kind == "one short":
            medians = medians[:-1]
        if kind == "reversed":
            medians = medians[::-1]
        return np.array(medians)

    return interleaved_medians


def test_interleaved_right_answer_passes(capsys):
    for seed in (0, None, 3):
        check_interleaved_medians(_medians(), seed=seed)
    assert capsys.readouterr().out.count("Correct: interleaved_medians follows") == 3


@pytest.mark.parametrize("kind,words", [
    ("by method", "every round of one method before the next"), ("no rotation", "same order in every round"),
    ("mean", "the mean"), ("min", "the fastest"), ("twice", "times in all"), ("dict", "not an array"),
    ("list", "not an array"), ("one short", "has shape"), ("reversed", "whose median is"),
])
def test_interleaved_mistakes(kind, words):
    with pytest.raises(ExerciseError, match=words):
        check_interleaved_medians(_medians(kind))


def test_interleaved_order_is_the_benchmarks():
    # The checker's schedule is the one benchmarks/bench.py's interleaved() runs (chapter 14, section 14.1).
    from benchmarks.bench import interleaved

    assert interleaved_order(["a", "b", "c"], 4) == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert interleaved_order(["x"], 3) == ["x", "x", "x"]
    for names, rounds in ((list("abc"), 4), (list("abcde"), 7), (["only"], 2)):
        calls = []
        interleaved({name: (lambda name=name: calls.append(name) or {"t_ms": 1.0}) for name in names}, rounds)
        assert calls == interleaved_order(names, rounds)
    assert np.array_equal(np.unique(interleaved_order(list("abcd"), 8), return_counts=True)[1], [8, 8, 8, 8])
