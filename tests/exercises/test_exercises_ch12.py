"""Exercises 12.1 (the incoming state of every rank) and 12.2 (a rank's outputs): a right answer passes on fixed
and fresh inputs, and each planted mistake is rejected with the message that names it."""

import numpy as np
import pytest

from lightning_edu.exercises import ExerciseError, IntegrityError
from lightning_edu.exercises.ch12 import check_finish_outputs, check_incoming_states, local_states, sequence_states
from lightning_edu.numpy_reference import causal_linear_recurrent


def _combine(power=lambda n: n, local=False, own=False, start=True, head0=False, shift=False):
    def incoming_states(states, counts, lam, initial_state):
        lam3 = (np.full_like(lam, lam[0]) if head0 else lam)[:, None, None]
        cur = initial_state.copy() if start else np.zeros_like(initial_state)
        out = [cur]
        for r in range(len(counts)):
            n = counts[r + 1] if own and r + 1 < len(counts) else counts[r]
            cur = lam3 ** power(n) * (cur + states[r]) if local else lam3 ** power(n) * cur + states[r]
            out.append(cur)
        return out[1:] if shift else out[:-1]

    return incoming_states


def _finish(power=lambda t, n: t + 1, local=1.0, scale_local=False, transpose=False, head0=False):
    def finish_outputs(o_local, q, incoming, lam):
        lam = np.full_like(lam, lam[0]) if head0 else np.asarray(lam)
        n = q.shape[1]
        scale = (lam[:, None] ** power(np.arange(n), n)[None, :])[..., None]
        state = incoming.transpose(0, 2, 1) if transpose else incoming
        return scale * (o_local + q @ state) if scale_local else local * o_local + scale * (q @ state)

    return finish_outputs


@pytest.mark.parametrize("check, right", [(check_incoming_states, _combine()), (check_finish_outputs, _finish())])
def test_a_right_answer_passes_on_fixed_and_fresh_inputs(capsys, check, right):
    check(right)
    check(right, seed=None)
    assert capsys.readouterr().out.count("Correct:") == 2


def test_the_reference_is_the_whole_sequences_recurrence():
    rng = np.random.default_rng(0)
    counts, lam = [3, 4, 2], np.array([0.9, 0.5])
    q, k = rng.standard_normal((2, 2, 9, 3))
    v = rng.standard_normal((2, 9, 2))
    s0 = rng.standard_normal((2, 3, 2))
    states = sequence_states(k, v, lam, counts, s0)
    _, after_7 = causal_linear_recurrent(q[None, :, :7], k[None, :, :7], v[None, :, :7], lam,
                                         initial_state=s0[None], return_state=True)
    np.testing.assert_allclose(states[2], after_7[0], rtol=1e-13)
    np.testing.assert_array_equal(states[0], s0)
    _, alone = causal_linear_recurrent(q[None, :, 3:7], k[None, :, 3:7], v[None, :, 3:7], lam, return_state=True)
    np.testing.assert_allclose(local_states(q, k, v, lam, counts)[1], alone[0], rtol=1e-13)


@pytest.mark.parametrize("check, slip, words", [
    (check_incoming_states, _combine(lambda n: 0), "the carried state is not decayed"),
    (check_incoming_states, _combine(lambda n: n - 1), "lam**(n_{r-1} - 1)"),
    (check_incoming_states, _combine(lambda n: n + 1), "lam**(n_{r-1} + 1)"),
    (check_incoming_states, _combine(local=True), "S_{r-1} was decayed along with IN_{r-1}"),
    (check_incoming_states, _combine(own=True), "decayed by the next rank's token count"),
    (check_incoming_states, _combine(start=False), "the initial state is missing"),
    (check_incoming_states, _combine(shift=True), "the outgoing state"),
    (check_incoming_states, _combine(head0=True), "head 0's lambda"),
    (check_finish_outputs, _finish(lambda t, n: 0 * t), "the incoming state is not decayed"),
    (check_finish_outputs, _finish(lambda t, n: t), "decayed by lam**t"),
    (check_finish_outputs, _finish(lambda t, n: t + 2), "decayed by lam**(t + 2)"),
    (check_finish_outputs, _finish(lambda t, n: n - t), "the powers run backwards"),
    (check_finish_outputs, _finish(local=0.0), "the local outputs are missing"),
    (check_finish_outputs, _finish(scale_local=True), "o_local was decayed along with the correction"),
    (check_finish_outputs, _finish(transpose=True), "the state is used transposed"),
    (check_finish_outputs, _finish(head0=True), "head 0's lambda"),
])
def test_each_usual_slip_is_named(check, slip, words):
    with pytest.raises(ExerciseError, match="wrong") as info:
        check(slip)
    assert words in str(info.value)


@pytest.mark.parametrize("check, answer, words", [
    (check_incoming_states, lambda st, c, lam, s0: [x * np.nan for x in _combine()(st, c, lam, s0)], "NaN or inf"),
    (check_incoming_states, lambda st, c, lam, s0: _combine()(st, c, lam, s0)[:-1], "one per rank is 4"),
    (check_incoming_states, lambda st, c, lam, s0: "states", "got str"),
    (check_incoming_states, lambda st, c, lam, s0: None, "returned None"),
    (check_incoming_states, lambda st, c, lam, s0: [x.transpose(0, 2, 1) for x in _combine()(st, c, lam, s0)],
     "expected (3, 4, 3)"),
    (check_incoming_states, lambda st, c, lam, s0: (st[0].__imul__(2), _combine()(st, c, lam, s0))[1], "in place"),
    (check_incoming_states, lambda st, c, lam, s0: 1 / 0, "raised ZeroDivisionError"),
    (check_incoming_states, lambda st, c, lam, s0: [["a"] * 3] * 4, "rank 0"),
    (check_finish_outputs, lambda o, q, s, lam: _finish()(o, q, s, lam) * np.nan, "NaN or inf"),
    (check_finish_outputs, lambda o, q, s, lam: _finish()(o, q, s, lam)[:, :-1], "expected (3, 6, 3)"),
    (check_finish_outputs, lambda o, q, s, lam: _finish()(o, q, s, lam).tolist(), "not an array"),
    (check_finish_outputs, lambda o, q, s, lam: None, "returned None"),
    (check_finish_outputs, lambda o, q, s, lam: o.__iadd__(_finish()(o, q, s, lam) - o), "in place"),
    (check_finish_outputs, lambda o, q, s, lam: 1 / 0, "raised ZeroDivisionError"),
    (check_finish_outputs, lambda o, q, s, lam: _finish()(o, q, s, lam) + 1e-3, "first at head 0, row 0"),
])
def test_wrong_outputs_get_a_message_never_a_traceback(check, answer, words):
    with pytest.raises(ExerciseError) as info:
        check(answer)
    assert words in str(info.value)


@pytest.mark.parametrize("check, right", [(check_incoming_states, _combine()), (check_finish_outputs, _finish())])
def test_calling_the_package_is_refused(check, right):
    from lightning_edu import lightning_attention

    def answer(*args):
        lightning_attention(np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 1)), 1.0,
                            backend="numpy")
        return right(*args)

    with pytest.raises(IntegrityError, match="lightning_attention"):
        check(answer)


def test_incoming_states_that_divide_by_a_power_of_lambda_fail():
    from lightning_edu.exercises.ch12 import check_incoming_states

    def divided(states, counts, lam, initial_state):  # IN_r = lambda^N_r (S0 + sum lambda^-N_j S_j): overflows
        lam3 = np.asarray(lam)[:, None, None]
        ends = np.cumsum(counts)
        acc, out = initial_state.copy(), [initial_state.copy()]
        with np.errstate(over="ignore", invalid="ignore"):
            for r in range(1, len(counts)):
                acc = acc + lam3 ** (-float(ends[r - 1])) * states[r - 1]
                out.append(lam3 ** float(ends[r - 1]) * acc)
        return out

    with pytest.raises(ExerciseError, match="never divide by a power of lambda"):
        check_incoming_states(divided)


def test_the_12_2_reference_is_the_whole_sequences_outputs():
    # what the check asks for, checked here against one call over the whole sequence (not against the formula)
    rng = np.random.default_rng(1)
    counts, lam = [4, 6], np.array([0.8, 1.0])
    q, k = rng.standard_normal((2, 2, 10, 3))
    v = rng.standard_normal((2, 10, 2))
    s0 = rng.standard_normal((2, 3, 2))
    whole = causal_linear_recurrent(q[None], k[None], v[None], lam, initial_state=s0[None])[0]
    ins = sequence_states(k, v, lam, counts, s0)
    for r, s in enumerate([slice(0, 4), slice(4, 10)]):
        o_local = causal_linear_recurrent(q[None, :, s], k[None, :, s], v[None, :, s], lam)[0]
        np.testing.assert_allclose(_finish()(o_local, q[:, s], ins[r], lam), whole[:, s], rtol=1e-12)
