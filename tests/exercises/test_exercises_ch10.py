"""The chapter 10 exercise checks: the model solutions pass, typical mistakes get a message that names what is
wrong and where, and the suspect packed forward is right exactly when every boundary starts a block."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_edu import lightning_attention, lightning_attention_step
from lightning_edu.exercises import ExerciseError, IntegrityError
from lightning_edu.exercises.ch10 import (
    check_exposes_suspect,
    check_packed_forward,
    check_step,
    reference_packed_forward,
    suspect_packed_forward,
)
from lightning_edu.numpy_reference import masked_product


# ---------------------------------------------------------------------------------------------------------
# Decoding step


def make_step(mistake=None):
    def step(q, k, v, state, lam):
        if mistake == "package":  # the model solution through the package, one token of one head
            o, new_state = lightning_attention_step(q[None, None], k[None, None], v[None, None], state[None, None],
                                                    lam, backend="numpy")
            return o[0, 0], new_state[0, 0]
        outer = np.outer(k, v)
        if mistake == "in_place":
            state *= lam
            state += outer
            return q @ state, state
        if mistake == "transposed":
            new_state = lam * state.T + np.outer(v, k)
            return new_state @ q, new_state
        if mistake == "decay_new":
            new_state = lam * (state + outer)
        elif mistake == "no_decay":
            new_state = state + outer
        else:
            new_state = lam * state + outer
        o = q @ new_state
        if mistake == "old_state":
            o = q @ state
        elif mistake == "o_shape":
            o = o[None, :]
        elif mistake == "nan":
            o = o * np.nan
        elif mistake == "string":
            o = "o"
        elif mistake == "none":
            return None
        elif mistake == "single":
            return o
        elif mistake == "raises":
            raise IndexError("index 5 is out of bounds")
        return o, new_state
    return step


def make_drifting_step():
    calls = []

    def step(q, k, v, state, lam):  # right on the 5 single tokens and the first 20 of the run, then off by 1e-6
        calls.append(1)
        new_state = lam * state + np.outer(k, v) + (1e-6 if len(calls) > 5 + 20 else 0.0)
        return q @ new_state, new_state
    return step


def test_step_model_solutions_pass(capsys):
    check_step(make_step())
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(IntegrityError, match="calls lightning_edu.lightning_attention_step: write the algorithm yourself"):
        check_step(make_step("package"))


@pytest.mark.parametrize("mistake, pattern", [
    ("old_state", "old state"),
    ("decay_new", "decayed the new token"),
    ("transposed", r"shape \(3, 5\).*transposed"),
    ("no_decay", "right at lam = 1 only"),
    ("o_shape", r"o \(the output of step.*shape \(1, 3\), expected \(3,\)"),
    ("in_place", "changed the state you were given in place; return a new array"),
    ("nan", "NaN"),
])
def test_step_mistakes_are_named(mistake, pattern):
    with pytest.raises(ExerciseError, match=pattern):
        check_step(make_step(mistake))


def test_step_run_names_the_first_wrong_token():
    with pytest.raises(ExerciseError, match="first at token 20"):
        check_step(make_drifting_step())


@pytest.mark.parametrize("mistake, pattern", [
    ("raises", "raised IndexError"),
    ("none", "returned None"),
    ("single", "pair"),
    ("string", "not an array"),
])
def test_a_broken_step_is_reported_not_crashed(mistake, pattern):
    with pytest.raises(ExerciseError, match=pattern):
        check_step(make_step(mistake))


# ---------------------------------------------------------------------------------------------------------
# The suspect and the input that exposes it


def qkv(n, d_k=5, d_v=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d_k)), rng.standard_normal((n, d_k)), rng.standard_normal((n, d_v))


def test_reference_is_one_package_call_per_sequence():
    q, k, v = qkv(41)
    bounds = [0, 0, 5, 21, 21, 41]
    o = lightning_attention(q[None, None], k[None, None], v[None, None], 0.9, backend="numpy", cu_seqlens=bounds)
    np.testing.assert_allclose(reference_packed_forward(q, k, v, 0.9, bounds), o[0, 0], rtol=1e-10, atol=1e-12)


@given(st.sampled_from([8, 16, 32]), st.lists(st.integers(0, 4), min_size=1, max_size=5),
       st.sampled_from([1.0, 0.9, 0.5]))
def test_suspect_is_right_when_every_boundary_starts_a_block(block, blocks_per_seq, lam):
    bounds = list(np.cumsum([0] + [b * block for b in blocks_per_seq]))
    bounds = [int(b) for b in bounds]
    if bounds[-1] == 0:
        bounds[-1] = block
    q, k, v = qkv(bounds[-1], seed=len(bounds))
    ref = reference_packed_forward(q, k, v, lam, bounds)
    np.testing.assert_allclose(suspect_packed_forward(q, k, v, lam, bounds, block), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bounds", [[0, 40], [0, 16, 40], [0, 16, 16, 37], [0, 32, 48, 50]])
def test_suspect_is_right_on_aligned_boundaries_and_a_ragged_end(bounds):
    q, k, v = qkv(bounds[-1], seed=1)
    ref = reference_packed_forward(q, k, v, 0.9, bounds)
    np.testing.assert_allclose(suspect_packed_forward(q, k, v, 0.9, bounds), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("bounds", [[0, 5, 40], [0, 16, 21, 40], [0, 31, 33], [0, 1, 2]])
def test_suspect_is_wrong_when_a_boundary_is_inside_a_block(bounds):
    q, k, v = qkv(bounds[-1], seed=2)
    got, ref = suspect_packed_forward(q, k, v, 0.9, bounds), reference_packed_forward(q, k, v, 0.9, bounds)
    assert not np.allclose(got, ref, rtol=1e-6)


def test_exposing_input_passes_and_names_the_token(capsys):
    q, k, v = qkv(40)
    check_exposes_suspect(lambda: (q, k, v, 0.9, [0, 16, 21, 40]))
    out = capsys.readouterr().out
    assert "token 21 (sequence 2, its token 0)" in out and "boundary 21" in out


@pytest.mark.parametrize("bounds, pattern", [
    ([0, 16, 48], r"every boundary you chose \(0, 16, 48\) is a multiple of its block size 16"),
    ([0, 48], "no boundary to cross"),
    ([0, 0, 48, 48], "no boundary to cross"),
])
def test_an_input_the_suspect_gets_right_is_explained(bounds, pattern):
    q, k, v = qkv(48)
    with pytest.raises(ExerciseError, match=pattern):
        check_exposes_suspect(lambda: (q, k, v, 0.9, bounds))


def test_a_degenerate_unaligned_input_is_explained():
    q, k, v = qkv(40)
    with pytest.raises(ExerciseError, match="boundary 5 falls inside a block.*zero keys"):
        check_exposes_suspect(lambda: (q, np.zeros_like(k), v, 0.9, [0, 5, 40]))
    with pytest.raises(ExerciseError, match=r"boundary 5 falls inside a block.*lam = 1e-20 so small"):
        check_exposes_suspect(lambda: (q, k, v, 1e-20, [0, 5, 40]))


@pytest.mark.parametrize("make_input, pattern", [
    (lambda: (*qkv(40), 0.9, [0, 50, 40]), "never decrease"),
    (lambda: (*qkv(40), 0.9, [1, 20, 40]), "start at 0"),
    (lambda: (*qkv(40), 0.9, [0, 20, 39]), "end at the packed length 40"),
    (lambda: (*qkv(40), 1.5, [0, 20, 40]), r"lam must lie in \(0, 1\]"),
    (lambda: (np.full((40, 5), np.nan), *qkv(40)[1:], 0.9, [0, 20, 40]), "NaN"),
    (lambda: (qkv(40)[0][None], *qkv(40)[1:], 0.9, [0, 20, 40]), "must be 2-D"),
    (lambda: (*qkv(40), 0.9), "5 things"),
    (lambda: None, "returned None"),
    (lambda: 1 / 0, "raised ZeroDivisionError"),
    (lambda: ("q", "k", "v", 0.9, [0, 1]), "not an array"),
])
def test_a_bad_input_is_reported_not_crashed(make_input, pattern):
    with pytest.raises(ExerciseError, match=pattern):
        check_exposes_suspect(make_input)


# ---------------------------------------------------------------------------------------------------------
# The reader's packed forward


def packed_by_package(q, k, v, lam, cu_seqlens):
    """The model solution: one lightning_attention call per sequence (the package's own packed path, with
    cu_seqlens, is what the exercise asks the reader to write, so the check refuses it)."""
    o = np.zeros((q.shape[0], v.shape[1]))
    for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if b > a:
            o[a:b] = lightning_attention(q[None, None, a:b], k[None, None, a:b], v[None, None, a:b], lam, backend="numpy")[0, 0]
    return o


def packed_by_cu_seqlens(q, k, v, lam, cu_seqlens):
    o = lightning_attention(q[None, None], k[None, None], v[None, None], lam, backend="numpy", cu_seqlens=cu_seqlens)
    return o[0, 0]


def packed_by_mask(q, k, v, lam, cu_seqlens, select=True):
    """One masked product over the packed rows: decay lam^(t-s) kept only inside a sequence, t >= s."""
    n = q.shape[0]
    seq = np.searchsorted(np.asarray(cu_seqlens[1:]), np.arange(n), side="right")
    t = np.arange(n)
    keep = (seq[:, None] == seq[None, :]) & (t[:, None] >= t[None, :])
    scores = (q @ k.T) * lam ** np.maximum(t[:, None] - t[None, :], 0)
    if select:
        return masked_product(scores, keep, v)
    return (scores * keep) @ v  # the mask multiplies: NaN * 0 = NaN


def packed_no_reset(q, k, v, lam, cu_seqlens):
    return lightning_attention(q[None, None], k[None, None], v[None, None], lam, backend="numpy")[0, 0]


def make_broken(kind):
    def packed_forward(q, k, v, lam, cu_seqlens):
        if kind == "raises":
            raise KeyError("cu")
        if kind == "none":
            return None
        if kind == "string":
            return "o"
        o = packed_by_package(q, k, v, lam, cu_seqlens)
        if kind == "shape":
            return o.T
        if kind == "nan":
            return o * np.nan
        if kind == "lam":  # the decay forgotten in the last sequence
            start = cu_seqlens[-2]
            o[start:] = packed_by_package(q[start:], k[start:], v[start:], 1.0, [0, q.shape[0] - start])
        return o
    return packed_forward


def test_packed_model_solutions_pass(capsys):
    check_packed_forward(packed_by_package)
    check_packed_forward(packed_by_mask)
    assert capsys.readouterr().out.count("Correct") == 2


@pytest.mark.parametrize("answer, name", [
    (packed_by_cu_seqlens, "lightning_edu.packed.packed_forward"),
    (reference_packed_forward, "lightning_edu.exercises.ch10.reference_packed_forward"),
])
def test_packed_forward_by_the_package_is_refused(answer, name):
    with pytest.raises(IntegrityError, match=f"{name}.*write the algorithm yourself"):
        check_packed_forward(answer)


def _pasted_suspect():
    """The suspect's code pasted into an answer cell (the reader's own function, with the suspect's bug): calling
    the package's suspect is refused (test_the_suspect_with_one_row_blocks_is_not_an_answer)."""
    import inspect
    import textwrap

    from lightning_edu import validation

    namespace = {"np": np, "validate_positive_int": validation.validate_positive_int,
                 "validate_cu_seqlens": validation.validate_cu_seqlens, "validate_decay": validation.validate_decay}
    exec(compile(textwrap.dedent(inspect.getsource(suspect_packed_forward)), "<answer 10.3>", "exec"), namespace)
    return namespace["suspect_packed_forward"]


@pytest.mark.parametrize("block", [8, 16, 32])
def test_the_suspects_bug_is_recognised(block):
    pasted = _pasted_suspect()
    with pytest.raises(ExerciseError, match="crosses a boundary inside a block"):
        check_packed_forward(lambda q, k, v, lam, cu: pasted(q, k, v, lam, cu, block))


def test_a_state_running_across_boundaries_is_recognised():
    with pytest.raises(ExerciseError, match="the state runs across sequence boundaries: reset it at every cu_seqlens"):
        check_packed_forward(packed_no_reset)


def test_the_sweep_names_the_failing_boundary():
    def wrong_at_7(q, k, v, lam, cu_seqlens):
        o = packed_by_package(q, k, v, lam, cu_seqlens)
        if list(cu_seqlens) == [0, 7, 24]:
            o[7] += 1.0
        return o

    with pytest.raises(ExerciseError, match=r"one boundary sits at position 7:.*token 7 \(sequence 1, its token 0\)"):
        check_packed_forward(wrong_at_7)


def test_a_nan_leaking_into_another_sequence_is_named():
    with pytest.raises(ExerciseError, match=r"a NaN in sequence 1 .* reached sequence 0's output at token 0.*select"):
        check_packed_forward(lambda *a: packed_by_mask(*a, select=False))


def test_a_nan_leaking_backwards_in_its_own_sequence_is_named():
    def per_sequence_multiplied(q, k, v, lam, cu_seqlens):
        o = np.zeros((q.shape[0], v.shape[1]))
        for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            o[s:e] = packed_by_mask(q[s:e], k[s:e], v[s:e], lam, [0, e - s], select=False)
        return o

    with pytest.raises(ExerciseError, match=r"reached the output at token 6, before it in the same sequence 1"):
        check_packed_forward(per_sequence_multiplied)


@pytest.mark.parametrize("kind, pattern", [
    ("raises", "raised KeyError"),
    ("none", "returned None"),
    ("string", "not an array"),
    ("shape", r"has shape \(3, 40\), expected \(40, 3\)"),
    ("nan", "NaN or inf at token 0"),
    # the decay forgotten: token 0 of a sequence has none yet, so token 1 is the first wrong one
    ("lam", r"first at token 22 \(sequence 2, its token 1\).*right at lam = 1, so the decay is off"),
])
def test_a_broken_packed_forward_is_reported_not_crashed(kind, pattern):
    with pytest.raises(ExerciseError, match=pattern):
        check_packed_forward(make_broken(kind))


def test_a_packed_forward_through_negative_powers_fails_on_a_long_sequence():
    # per sequence, o = (q lambda^t) cumsum(k lambda^-t v): right on short sequences, lambda^-297 overflows at 0.05
    def negative_powers(q, k, v, lam, cu_seqlens):
        out = np.zeros((q.shape[0], v.shape[1]))
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            t = np.arange(b - a)[:, None].astype(float)
            with np.errstate(over="ignore", invalid="ignore"):
                states = np.cumsum((k[a:b] * lam ** -t)[:, :, None] * v[a:b][:, None, :], 0)
                out[a:b] = np.einsum("td,tde->te", q[a:b] * lam**t, states)
        return out

    with pytest.raises(ExerciseError, match="NaN or inf"):
        check_packed_forward(negative_powers)


def test_exposing_the_suspect_takes_a_real_difference_not_overflow_or_rounding():
    from lightning_edu.exercises.ch10 import check_exposes_suspect

    huge = np.full((4, 2), 1e200)  # finite inputs whose outputs overflow: inf - inf "differs"
    with pytest.raises(ExerciseError, match="right outputs themselves overflow"):
        check_exposes_suspect(lambda: (huge, huge, huge, 0.9, [0, 4]))
    # one sequence, terms of 1e7 that cancel to 1e-3: rounding differences, no boundary crossed
    k = np.concatenate([np.full((20, 2), 1e7), np.full((20, 2), -1e7 + 1e-3)])
    with pytest.raises(ExerciseError, match="no boundary to cross"):
        check_exposes_suspect(lambda: (np.ones((40, 2)), k, np.ones((40, 2)), 0.9, [0, 40]))


def test_a_float32_packed_output_is_named_as_such():
    def float32_out(q, k, v, lam, cu_seqlens):  # a token recurrence, reset at each boundary, into a float32 buffer
        out, state, starts = np.zeros((q.shape[0], v.shape[1]), dtype=np.float32), None, set(cu_seqlens[:-1])
        for t in range(q.shape[0]):
            state = np.outer(k[t], v[t]) + (0.0 if t in starts else lam * state)
            out[t] = q[t] @ state
        return out

    with pytest.raises(ExerciseError, match="is float32"):
        check_packed_forward(float32_out)


# ---------------------------------------------------------------------------------------------------------
# The cohort's findings: an allowed helper that is the answer, a transpose, a thread


def test_the_suspect_with_one_row_blocks_is_not_an_answer():
    # with block=1 every boundary starts a block, so the suspect is exact: it must not be allowed to stand in
    with pytest.raises(IntegrityError, match="calls lightning_edu.exercises.ch10.suspect_packed_forward"):
        check_packed_forward(lambda q, k, v, lam, cu: suspect_packed_forward(q, k, v, lam, cu, block=1))


def test_lightning_attention_on_one_sequence_stays_allowed(capsys):
    def per_sequence(q, k, v, lam, cu_seqlens):
        out = np.zeros((q.shape[0], v.shape[1]))
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            if b > a:
                out[a:b] = lightning_attention(q[None, None, a:b], k[None, None, a:b], v[None, None, a:b], lam)[0, 0]
        return out

    check_packed_forward(per_sequence)
    assert "Correct" in capsys.readouterr().out


@pytest.mark.parametrize("step", [
    lambda q, k, v, state, lam: (q @ (lam * state + np.outer(v, k)), lam * state + np.outer(v, k)),
    lambda q, k, v, state, lam: ((lam * state + np.outer(k, v)) @ q, lam * state + np.outer(k, v)),
], ids=["outer-transposed", "read-transposed"])
def test_a_transpose_that_breaks_the_shapes_gets_a_hint(step):
    with pytest.raises(ExerciseError) as info:
        check_step(step)
    text = str(info.value)
    assert "your step raised ValueError" in text and "Hint: a transpose: state is (d_k, d_v)" in text, text
    assert "np.outer(k, v)" in text and "o = q @ new_state" in text
