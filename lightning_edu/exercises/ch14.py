"""Checks for the exercises of chapter 14 (the appendix: performance engineering, method and recorded data).

* :func:`check_floor_fraction` -- plain Python: the fraction of the HBM floor a measured call reached, the bytes
  that must move (4 tensors of (batch, heads, T, d) for a forward, 4 + 7 for a forward + backward) over the copy
  bandwidth, divided by the measured time; against :func:`lightning_edu.costs.hbm_floor_bytes`, on the benchmark's
  recorded shapes and on random ones. It recognises a forward + backward counted as 7 tensors (the backward alone)
  or as 4, milliseconds taken for seconds, the bytes per element left out, and the fraction turned upside down.
* :func:`check_interleaved_medians` -- plain Python: the benchmark's schedule of interleaved rounds (round r calls
  every method once, the methods' order rotated to start at the r-th) and the median of each method's times. The
  stand-in methods run on a host whose speed changes from call to call and return what the host's clock says, so
  only the schedule's medians come out right; the check records the order of the calls and names a method timed
  all its rounds at once, rounds in one unrotated order, and a mean or a minimum taken for the median. The answer is
  a numpy array of the medians, in the order of the methods.
"""

from __future__ import annotations

import math

import numpy as np

from ._core import ExerciseError, call_reader, exercise, expect_shape, passed, seeded

__all__ = ["check_floor_fraction", "check_interleaved_medians", "interleaved_order"]

# (batch, T, heads, d, elem_bytes, bandwidth in bytes/s, ms, training): the benchmark's shapes (32K tokens per call,
# 16 heads, bf16, the H100's and the H200's copy bandwidth), a forward and a forward + backward each.
_FLOOR_CASES = [
    (16, 2048, 16, 128, 2, 3.0007e12, 0.2244, False),
    (16, 2048, 16, 128, 2, 3.0007e12, 1.0545, True),
    (1, 32768, 16, 64, 2, 4.25e12, 0.1107, False),
    (1, 131072, 16, 128, 2, 4.24e12, 4.798, True),
    (4, 8192, 16, 64, 4, 3.0e12, 0.9, True),
]


def _floor(batch, T, heads, d, elem_bytes, bandwidth, ms, training) -> float:
    from ..costs import hbm_floor_bytes

    nbytes = hbm_floor_bytes(batch, T, heads, d, elem_bytes)
    if training:
        nbytes += hbm_floor_bytes(batch, T, heads, d, elem_bytes, backward=True)
    return nbytes / bandwidth / (ms * 1e-3)


def _floor_slips(batch, T, heads, d, elem_bytes, bandwidth, ms, training) -> dict[str, float]:
    """What each usual slip returns -> what it is (a later entry wins where two slips give one number)."""
    one = batch * T * heads * d * elem_bytes / bandwidth / (ms * 1e-3)  # one tensor's share
    right = (11 if training else 4) * one
    slips = {
        right / 1e3: "divided by the time in milliseconds as if it were seconds: ms * 1e-3 is the time in seconds",
        right / elem_bytes: "counted elements, not bytes: multiply by elem_bytes (2 for bf16)",
        1 / right: "turned the fraction upside down: it is the floor's time over the measured time, at most 1",
    }
    if training:
        slips[7 * one] = ("counted only the backward's 7 tensors: a forward + backward moves the forward's 4 "
                          "(q, k, v in, o out) and the backward's 7 (q, k, v, dO in, dq, dk, dv out)")
        slips[4 * one] = "counted only the forward's 4 tensors: with training the call also runs the backward, 7 more"
    else:
        slips[11 * one] = "counted the backward's tensors too: with training false the call is a forward, 4 tensors"
    return slips


@exercise("14.1", reveals=("hbm_floor_bytes",))
def check_floor_fraction(floor_fraction, seed: int = 0) -> None:
    """``floor_fraction(ms, batch, T, heads, d, elem_bytes, bandwidth, training)`` must return the floor's time, the
    bytes that must move over ``bandwidth``, divided by the measured ``ms``: 4 tensors of (batch, heads, T, d) for a
    forward, 4 + 7 with ``training``, ``elem_bytes`` per element."""
    cases = list(_FLOOR_CASES)
    if seed:
        rng = seeded(seed)
        cases = [(int(rng.integers(1, 17)), 64 * int(rng.integers(1, 2049)), int(rng.integers(1, 33)),
                  int(rng.choice([32, 64, 96, 128])), int(rng.choice([2, 4])), float(rng.uniform(1e12, 5e12)),
                  float(np.round(rng.uniform(0.05, 20.0), 4)), bool(training)) for training in (False, True, True)]
    for batch, T, heads, d, elem_bytes, bandwidth, ms, training in cases:
        where = (f"for ms = {ms}, batch = {batch}, T = {T}, heads = {heads}, d = {d}, elem_bytes = {elem_bytes}, "
                 f"bandwidth = {bandwidth:.4g}, training = {training}")
        out = call_reader(floor_fraction, "floor_fraction",
                          (ms, batch, T, heads, d, elem_bytes, bandwidth, training), where)
        if isinstance(out, (bool, np.bool_)) or out is None:
            raise ExerciseError(f"floor_fraction returned {out!r} {where}: return the fraction, a float")
        try:
            got = float(out)
        except (TypeError, ValueError) as exc:
            raise ExerciseError(f"floor_fraction must return a number {where}, got {out!r:.80}") from exc
        want = _floor(batch, T, heads, d, elem_bytes, bandwidth, ms, training)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        for value, slip in _floor_slips(batch, T, heads, d, elem_bytes, bandwidth, ms, training).items():
            if math.isclose(got, value, rel_tol=1e-9):
                raise ExerciseError(f"floor_fraction returned {got:.6g} {where}, expected {want:.6g}: it looks as if "
                                    f"you {slip}")
        raise ExerciseError(f"floor_fraction returned {got:.6g} {where}, expected {want:.6g}: the bytes that must "
                            f"move ({11 if training else 4} tensors of batch * T * heads * d elements) over the "
                            "bandwidth, divided by the measured time in seconds")
    passed(f"floor_fraction agrees with the book's byte count in {len(cases)} cases, forwards and forwards + "
           "backwards: " + ("random shapes and bandwidths" if seed else
                            "the benchmark's shapes and copy bandwidths, bf16 and float32"))


def interleaved_order(names, rounds: int) -> list:
    """The calls of the benchmark's interleaved rounds, in order: round r calls every name once, starting at the
    (r mod len(names))-th."""
    names = list(names)
    return [name for r in range(rounds) for name in names[r % len(names):] + names[: r % len(names)]]


class _Host:
    """Stand-in methods on a host whose speed changes over time: call number i of any method takes that method's
    base time times the host's slowness at i, and the host is slow in stretches (how a real host's speed wanders
    while a benchmark runs). Each call is recorded."""

    def __init__(self, base: dict, slowness: list):
        self.base, self.slowness = base, slowness
        self.calls: list = []
        self.served: dict = {name: [] for name in base}

    def method(self, name):
        def measure(*args, **kwargs):
            if args or kwargs:
                raise ExerciseError(f"a method was called with arguments {args or kwargs}: each one takes none and "
                                    "returns the time of one call of its method, in ms")
            i = len(self.calls)
            self.calls.append(name)
            ms = self.base[name] * (self.slowness[i] if i < len(self.slowness) else 1.0)
            self.served[name].append(ms)
            return ms

        measure.__name__ = f"measure_{name}"
        return measure


def _describe(order) -> str:
    text = " ".join(order)
    return text if len(text) <= 90 else text[:87] + "..."


@exercise("14.2")
def check_interleaved_medians(interleaved_medians, seed: int = 0) -> None:
    """``interleaved_medians(measures, rounds)`` must call every method once per round, round r in the dict's order
    rotated to start at the (r mod count)-th method, one round after another, and return the median of each method's
    times, a numpy array in the dict's order."""
    cases = [  # (base ms per method, rounds, the host's slowness call by call)
        ({"ours": 1.0, "fla": 1.3, "sdpa": 0.8}, 5, [1, 1, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 2.5, 1, 1]),
        ({"a": 2.0, "b": 1.0, "c": 4.0, "d": 3.0}, 3, [1, 1, 1, 1, 1, 4, 4, 4, 1, 1, 1, 1]),
        ({"only": 0.5}, 4, [1, 3, 1, 1]),
        ({"x": 1.0, "y": 1.0}, 2, [2, 1, 1, 1]),
    ]
    if seed:
        rng = seeded(seed)
        cases = []
        for _ in range(3):
            count, rounds = int(rng.integers(2, 6)), int(rng.integers(3, 8))
            names = [f"m{i}" for i in rng.permutation(9)[:count]]
            base = {name: float(np.round(rng.uniform(0.1, 5.0), 3)) for name in names}
            slowness = [1.0] * (count * rounds)
            start = int(rng.integers(0, count * rounds - count))
            for i in range(start, start + count):  # a slow stretch of one round's length
                slowness[i] = float(np.round(rng.uniform(2.0, 5.0), 2))
            cases.append((base, rounds, slowness))
    for base, rounds, slowness in cases:
        host = _Host(base, slowness)
        measures = {name: host.method(name) for name in base}
        where = f"for methods {list(base)} and rounds = {rounds}"
        out = call_reader(interleaved_medians, "interleaved_medians", (measures, rounds), where)
        want_order = interleaved_order(base, rounds)
        if host.calls != want_order:
            got_order = host.calls
            if sorted(got_order) != sorted(want_order):
                counts = {name: got_order.count(name) for name in base}
                raise ExerciseError(f"interleaved_medians called the methods {counts} times {where}: each method "
                                    f"once per round, {rounds} times in all")
            by_method = [name for name in base for _ in range(rounds)]
            if got_order == by_method:
                raise ExerciseError(f"interleaved_medians timed every round of one method before the next {where}: a "
                                    "slow stretch of the host then lands on one method only. Time every method "
                                    "once per round, one round after another")
            if got_order == [name for _ in range(rounds) for name in base]:
                raise ExerciseError(f"interleaved_medians called the methods in the same order in every round {where}: "
                                    "the first method then always runs first (after the previous shape, on a GPU "
                                    "that has just idled). Rotate: round r starts at method number r mod their count")
            raise ExerciseError(f"interleaved_medians called the methods in the order {_describe(got_order)} {where}, "
                                f"expected {_describe(want_order)}")
        got_all = expect_shape("interleaved_medians", out, (len(base),))
        for name, got in zip(base, got_all):
            values = host.served[name]
            got = float(got)
            want = float(np.median(values))
            if math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12):
                continue
            rounded = [round(x, 4) for x in values]
            if math.isclose(got, float(np.mean(values)), rel_tol=1e-12):
                raise ExerciseError(f"interleaved_medians returned the mean of {name!r}'s times {rounded} {where}: "
                                    f"{got:.4g} ms, where their median is {want:.4g}. One slow round moves a mean; "
                                    "the median keeps to the typical round")
            if math.isclose(got, min(values), rel_tol=1e-12):
                raise ExerciseError(f"interleaved_medians returned the fastest of {name!r}'s times {rounded} {where}; "
                                    f"the benchmark reports the median, {want:.4g} ms (the fastest round is kept "
                                    "beside it in the rounds)")
            raise ExerciseError(f"interleaved_medians returned {got:.6g} ms for {name!r} {where}; its times were "
                                f"{rounded}, whose median is {want:.6g}")
    methods = "two to five methods each" if seed else "one to four methods"
    passed(f"interleaved_medians follows the rotated schedule of interleaved rounds in {len(cases)} cases of "
           f"{methods}, and returns each method's median time, on a host whose speed changes in stretches")
